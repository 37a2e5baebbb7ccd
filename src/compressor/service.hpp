// The compressor service: prepares (schedule, key, compile or load, launch record) once per
// (configuration, family, device) and launches calls against the prepared record.
#pragma once

#include <array>
#include <atomic>
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
#include "compressor/kernel_spec.hpp"
#include "driver/loader.hpp"
#include "schedule/short_window.hpp"
#include "schedule/table.hpp"

namespace csa_kernel {
struct BackwardParams;  // kernels/csa_params.h
}

namespace csa::compressor {

struct DeviceTraits {
  int ordinal = 0;
  int cc_major = 0;
  std::string arch;  // "sm_90"
  int sm_count = 0;
  schedule::SmLimits sm;
};

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

// Everything a call needs, resolved once.
struct Prepared {
  Config config;
  Family family = Family::kShortWindow;
  schedule::ShortWindowSchedule schedule;
  DeviceTraits device;
  std::string key;                           // cache key of the module
  int backward_resident_ctas = 1;            // backward CTAs per SM (from the kernel's registers)
  std::vector<PreparedBucket> long_forward;  // long-window buckets, ascending rows
  std::vector<PreparedBucket> long_backward;
  int long_ape_reduce_slot = 0;
  int long_ape_reduce_quads_slot = -1;  // LongWindowSlots::ape_reduce_quads
  bool programmatic = false;            // launch with programmatic dependent launch (sm_90+)
  std::shared_ptr<const cache::LoadedModule> module;
  CUkernel kernel(int slot) const { return module->kernels.at(static_cast<std::size_t>(slot)); }
};

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
  std::shared_ptr<const Prepared> record(const Config& config, Family family, int device);
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
  // The current context's device; throws when the thread has no current context.
  int current_device();
  driver::Driver& driver() { return loader_.get(); }

 private:
  using RecordKey = std::tuple<int, int, int, int, int>;  // ratio, coff, head_dim, family, device

  std::shared_ptr<const Prepared> prepared_for_call(const Config& config, Family family,
                                                    CUstream stream);
  void launch_forward(const Prepared& p, const ForwardArgs& a, CUstream stream);
  void launch_backward(const Prepared& p, const BackwardArgs& a, CUstream stream);
  void check_record_device(const Prepared& p);
  std::shared_ptr<const Prepared> prepare(const Config& config, Family family, int device,
                                          bool* compiled);
  cache::ModuleCache& modules();
  schedule::ShortWindowSchedule schedule_for(const Config& config) const;
  ModuleSpec long_window_spec(const Config& config, const std::string& arch,
                              const schedule::ScheduleSet& set,
                              std::vector<schedule::LongWindowSchedule>* forward,
                              std::vector<schedule::LongWindowSchedule>* backward,
                              LongWindowSlots* slots) const;
  // The bucket records of `p`, whose module holds the kernels `forward` and `backward` (as
  // long_window_spec listed them) at `slots`.
  void prepare_long_window(Prepared& p, const schedule::ScheduleSet& set,
                           const std::vector<schedule::LongWindowSchedule>& forward,
                           const std::vector<schedule::LongWindowSchedule>& backward,
                           const LongWindowSlots& slots);
  void forward_long(const Prepared& p, const ForwardArgs& a, CUstream stream);
  void backward_long(const Prepared& p, const BackwardArgs& a, CUstream stream);

  Logger& logger_;
  cache::KernelStore& store_;
  driver::Loader& loader_;
  CompileOptions compile_options_;
  std::optional<std::string> schedule_override_;
  bool fast_launch_ = true;  // CSA_FAST_LAUNCH=0: no record cache, everything resolved per call
  bool programmatic_launch_ = true;  // CSA_PROGRAMMATIC_LAUNCH=0: plain stream serialization

  // Scratch per (context, stream), grown on demand: the fixed-order grad_ape partials, and the
  // atomic backward's claim words (kClaimWords: zeroed when allocated; every launch leaves them
  // so, see zero_once_per_call).
  // NOTE: keyed by the driver's unique context and stream ids, never by handle values, which
  // can be reused after a stream is destroyed while its work is still running.
  enum class WorkspaceUse { kPartials, kClaimWords };
  struct StreamWorkspace {
    // 0 for an application-created stream: its id is unique for the life of the process.
    unsigned long long context_id = 0;
    unsigned long long stream_id = 0;
    WorkspaceUse use = WorkspaceUse::kPartials;
    CUdeviceptr ptr = 0;
    std::size_t bytes = 0;
  };
  // A workspace of at least `bytes` usable in stream order on `stream`, or 0 when the stream
  // is `capturing` (the caller's one query per call; it then allocates inside the graph).
  CUdeviceptr stream_workspace(CUstream stream, bool capturing, std::size_t bytes,
                               WorkspaceUse use = WorkspaceUse::kPartials);
  std::mutex workspace_mutex_;  // guards workspaces_ and capture_slabs_
  std::vector<StreamWorkspace> workspaces_;

  // Claim words for captured atomic backwards. A graph replays a launch with the words it was
  // captured with, so every captured call takes words of its own, never handed out again (the
  // graph may be replayed for as long as the Runtime lives), from slabs zeroed when they were
  // allocated, one list per context. A slab is allocated outside capture only (by an eager
  // atomic backward while capture_words_low_): a call captured with none left takes the form
  // without claim words (the fixed order, or a memset of grad_ape).
  // NOTE: one graph's words serve one replay at a time: two instantiations of one captured
  // graph must not run concurrently (CUDA already serializes replays of one instantiation).
  struct CaptureSlab {
    unsigned long long context_id = 0;
    CUdeviceptr ptr = 0;
    std::size_t bytes = 0;
    std::size_t used = 0;
  };
  static constexpr std::size_t kCaptureSlabBytes = 64 << 10;
  static constexpr std::size_t kCaptureWordsAlign = 256;
  std::vector<CaptureSlab> capture_slabs_;
  std::atomic<bool> capture_words_low_{true};
  // Under capture: `bytes` of zeroed claim words for this call alone, or 0 when none are left.
  CUdeviceptr take_capture_words(std::size_t bytes);
  // Outside capture: a new slab for the current context when its slabs are running low.
  void refill_capture_words();
  // After prewarm or a plan's prepare on `device`: refill_capture_words when the current
  // context is on that device, so that graphs captured before any eager backward get claim
  // words too; best effort (a failure is logged, never raised).
  void set_aside_capture_words(int device);

  // The claim words of an atomic-grad_ape backward (both families) that overwrites grad_ape:
  // the stream's outside capture, the call's own under capture; 0 where there are none.
  CUdeviceptr claim_words(std::int64_t column_blocks, bool capturing, CUstream stream);
  // Before an atomic-grad_ape backward launch (both families): overwriting, hands the kernel
  // `words` (claim_words), with which it zeroes grad_ape itself (zero_once_per_call), or where
  // there are none a memset of grad_ape goes first; accumulating, nothing.
  void prepare_atomic_grad_ape(csa_kernel::BackwardParams& params, const BackwardArgs& a,
                               std::int64_t ape_elems, CUdeviceptr words, CUstream stream);

  std::once_flag modules_once_;
  std::unique_ptr<cache::ModuleCache> modules_;

  mutable std::mutex mutex_;  // guards records_ and devices_ (never held while compiling)
  std::map<RecordKey, std::shared_ptr<const Prepared>> records_;
  std::vector<std::shared_ptr<const Prepared>> retired_;  // callers may still hold references
  std::map<int, DeviceTraits> devices_;
  std::shared_ptr<const schedule::ScheduleSet> schedules_;
};

}  // namespace csa::compressor
