// The compressor service: prepares (schedule, key, compile or load, launch record) once per
// (configuration, family, device) and launches calls against the prepared record.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cache/kernel_store.hpp"
#include "cache/module_cache.hpp"
#include "common/logger.hpp"
#include "compressor/device_registry.hpp"
#include "compressor/kernel_spec.hpp"
#include "compressor/launch_helpers.hpp"
#include "compressor/prepared.hpp"
#include "compressor/record_cache.hpp"
#include "compressor/scratch_pool.hpp"
#include "driver/loader.hpp"
#include "schedule/short_window.hpp"
#include "schedule/table.hpp"

namespace csa_kernel {
struct BackwardParams;  // kernels/csa_params.h
}

namespace csa::compressor {

class Service {
 public:
  Service(const RuntimeOptions& options, Logger& logger, cache::KernelStore& store,
          driver::Loader& loader);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  void forward(const ForwardArgs& args, CUstream stream, Family family);
  void backward(const BackwardArgs& args, CUstream stream, Family family);

  // The plan API: a record prepared once (no capture check: never called while capturing a
  // stream), then calls against it that skip the record lookup.
  std::shared_ptr<const Prepared> record(const Config& config, int kernel_layout, Family family,
                                         int device);
  void forward_with(const Prepared& p, const ForwardArgs& args, CUstream stream);
  void backward_with(const Prepared& p, const BackwardArgs& args, CUstream stream);
  PrewarmReport prewarm(const Config& config, int device, Family family);
  PrewarmReport compile_for_arch(const Config& config, const std::string& arch, Family family);
  OffsetReport check_offsets(const std::int32_t* cu, const std::int32_t* cuc,
                             std::int32_t num_segments, std::int64_t total_tokens,
                             std::int64_t total_comp, std::int32_t ratio, CUstream stream);

  DeviceTraits device_traits(int ordinal);

  // Schedule tables: replacing one retires every prepared record (kept alive, never reused).
  void set_schedule_table(schedule::ScheduleTable table);
  std::shared_ptr<const schedule::ScheduleSet> schedules() const;
  // The family serving `config` on `arch` (kAuto routed by the table).
  Family resolve(const Config& config, Family family, const std::string& arch) const;
  // The short-window schedule of `config` (the rule, then CSA_SHORT_WINDOW_SCHEDULE).
  schedule::ShortWindowSchedule schedule_for(const Config& config) const;
  // The current context's device; throws when the thread has no current context.
  int current_device();
  // Makes `device`'s primary context current on the calling thread unless a context of that
  // device already is (csa_set_device).
  void make_current(int device);
  driver::Driver& driver() { return loader_.get(); }

 private:
  std::shared_ptr<const Prepared> prepared_for_call(const Config& config, int kernel_layout,
                                                    Family family, CUstream stream);
  void launch_forward(const Prepared& p, const ForwardArgs& a, CUstream stream);
  void launch_backward(const Prepared& p, const BackwardArgs& a, CUstream stream);
  void check_record_device(const Prepared& p);
  std::shared_ptr<const Prepared> prepare(const Config& config, int kernel_layout, Family family,
                                          int device, bool* compiled);
  cache::ModuleCache& modules();
  // The module of `spec` loaded on the driver (compiled or read from the cache first).
  std::shared_ptr<const cache::LoadedModule> load_module(const ModuleSpec& spec, bool* compiled);
  ModuleSpec long_window_spec(const Config& config, int kernel_layout, const std::string& arch,
                              const schedule::ScheduleSet& set,
                              std::vector<schedule::LongWindowSchedule>* forward,
                              std::vector<schedule::LongWindowSchedule>* backward) const;
  // The bucket records of `p`, whose module (`spec`, from long_window_spec) holds every
  // bucket's kernel.
  void prepare_long_window(Prepared& p, const schedule::ScheduleSet& set, const ModuleSpec& spec);
  void forward_long(const Prepared& p, const ForwardArgs& a, CUstream stream);
  void backward_long(const Prepared& p, const BackwardArgs& a, CUstream stream);

  Logger& logger_;
  cache::KernelStore& store_;
  driver::Loader& loader_;
  CompileOptions compile_options_;
  std::optional<std::string> schedule_override_;
  bool fast_launch_ = true;  // CSA_FAST_LAUNCH=0: no record cache, everything resolved per call
  bool programmatic_launch_ = true;  // CSA_PROGRAMMATIC_LAUNCH=0: plain stream serialization

  ScratchPool scratch_;  // stream workspaces and claim words
  // A call's workspace of `bytes`: the stream's (ScratchPool::stream_workspace), or under capture
  // memory the graph owns, which `graph` holds until the call's launches are recorded.
  CUdeviceptr call_workspace(CUstream stream, bool capturing, std::size_t bytes,
                             std::optional<detail::StreamScratch>& graph);
  // Before an atomic-grad_ape backward launch (both families): overwriting, hands the kernel
  // `words` (claim_words), with which it zeroes grad_ape (and the tail's grad_w) itself
  // (claim_zero_if_first), or where there are none memsets of them go first; accumulating,
  // nothing.
  void prepare_atomic_grad_ape(csa_kernel::BackwardParams& params, const BackwardArgs& a,
                               std::int64_t ape_elems, CUdeviceptr words, CUstream stream);

  std::once_flag modules_once_;
  std::unique_ptr<cache::ModuleCache> modules_;

  mutable std::mutex mutex_;  // guards schedules_ (never held while compiling)
  std::shared_ptr<const schedule::ScheduleSet> schedules_;
  RecordCache records_;
  DeviceRegistry devices_;
};

}  // namespace csa::compressor
