// What a prepared (configuration, kernel layout, family, device) holds: the resolved
// schedules, the loaded module and every launch datum a call needs, resolved once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/module_cache.hpp"
#include "compressor/device_registry.hpp"
#include "compressor/kernel_spec.hpp"
#include "csa/csa.hpp"
#include "schedule/long_window.hpp"
#include "schedule/short_window.hpp"

namespace csa::compressor {

// One bucket of a long-window direction: its row range end, schedule, kernel and launch data.
struct PreparedBucket {
  std::int64_t max_rows = -1;  // -1: unbounded
  schedule::LongWindowSchedule schedule;
  int slot = 0;  // kernel slot in the module
  int shared_bytes = 0;
  int resident_ctas = 1;  // CTAs per SM (backward grid sizing, the forward's early prefetch)
  // Backward: the fixed-order kernel (the bucket's own unless it adds grad_ape atomically),
  // which deterministic calls take.
  int fixed_slot = 0;
  int fixed_resident_ctas = 1;
};

struct Prepared {
  Config config;
  int kernel_layout = 0;  // csa_kernel::LayoutKind of the kernels
  Family family = Family::kShortWindow;
  schedule::ShortWindowSchedule schedule;
  DeviceTraits device;
  std::string key;                           // cache key of the module
  int backward_ctas_per_sm = 1;              // of the backward kernel (from its registers)
  int resident_backward_ctas_per_sm = 1;     // of the resident backward kernel, if any
  int row_stats_backward_ctas_per_sm = 1;    // of the tail's row-stats backward, if any
  std::vector<PreparedBucket> long_forward;  // long-window buckets, ascending rows
  std::vector<PreparedBucket> long_backward;
  KernelSlots slots;          // the module's named kernels
  bool programmatic = false;  // launch with programmatic dependent launch (sm_90+)
  std::shared_ptr<const cache::LoadedModule> module;
  CUkernel kernel(int slot) const { return module->kernels.at(static_cast<std::size_t>(slot)); }
};

}  // namespace csa::compressor
