// The devices calls run on: their traits (arch, SMs, per-SM limits) read from the driver once
// per ordinal, and the calling thread's current device.
#pragma once

#include <map>
#include <mutex>
#include <string>

#include "driver/loader.hpp"
#include "schedule/short_window.hpp"

namespace csa::compressor {

struct DeviceTraits {
  int ordinal = 0;
  int cc_major = 0;
  std::string arch;  // "sm_90"
  int sm_count = 0;
  schedule::SmLimits sm;
};

class DeviceRegistry {
 public:
  explicit DeviceRegistry(driver::Loader& loader) : loader_(loader) {}

  // Throws for an ordinal that does not exist or a device older than sm_80.
  DeviceTraits traits(int ordinal);
  // The current context's device; throws when the thread has no current context.
  int current_device();
  // Makes `device`'s primary context current on the calling thread unless a context of that
  // device already is (csa_set_device).
  void make_current(int device);

 private:
  driver::Loader& loader_;
  std::mutex mutex_;
  std::map<int, DeviceTraits> devices_;
};

}  // namespace csa::compressor
