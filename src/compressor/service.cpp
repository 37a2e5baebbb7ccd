#include "compressor/service.hpp"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>

#include "common/env.hpp"
#include "csa_params.h"
#include "common/error.hpp"
#include "compressor/validation.hpp"
#include "compressor/launch_helpers.hpp"
#include "launch/launch.hpp"

namespace csa::compressor {

using detail::blocks_for;
using detail::device_ptr;
using detail::fill_gradients;
using detail::fill_inputs;
using detail::launch_ape_reduce;
using detail::StreamScratch;

namespace {

constexpr unsigned kReferenceThreads = 256;

PrewarmReport report_of(const Config& config, const std::string& arch, const std::string& key,
                        const cache::StoredCubin& cubin, bool compiled, double seconds) {
  PrewarmReport r;
  r.config = config;
  r.arch = arch;
  r.key = key;
  r.compiled = compiled;
  r.seconds = seconds;
  r.kernels = static_cast<int>(cubin.entry.lowered_names.size());
  r.ptxas_log = cubin.entry.log;
  const auto resources = nvrtc::parse_ptxas_report(cubin.entry.log);
  if (!resources.empty()) {
    r.max_registers = 0;
    r.spill_bytes = 0;
    r.stack_bytes = 0;
    for (const auto& k : resources) {
      r.max_registers = std::max(r.max_registers, k.registers);
      r.spill_bytes += k.spill_store_bytes + k.spill_load_bytes;
      r.stack_bytes = std::max(r.stack_bytes, k.stack_bytes);
    }
  }
  return r;
}

}  // namespace

Service::Service(const RuntimeOptions& options, Logger& logger, cache::KernelStore& store,
                 driver::Loader& loader)
    : logger_(logger),
      store_(store),
      loader_(loader),
      compile_options_{options.ptxas_verbose, options.line_info},
      schedule_override_(env::get("CSA_SHORT_WINDOW_SCHEDULE")),
      fast_launch_(env::flag("CSA_FAST_LAUNCH", true)),
      programmatic_launch_(env::flag("CSA_PROGRAMMATIC_LAUNCH", true)) {
  auto set = std::make_shared<schedule::ScheduleSet>(schedule::ScheduleSet::embedded());
  if (const auto file = env::get("CSA_SCHEDULE_FILE")) {
    std::ifstream in(*file, std::ios::binary);
    if (!in) {
      fail(Status::kInvalidArgument, "CSA_SCHEDULE_FILE {}: cannot be read", *file);
    }
    std::ostringstream text;
    text << in.rdbuf();
    set->add(schedule::parse_schedule_table(text.str(), *file));
    logger_.info("schedule table {} overrides the embedded table of its arch", *file);
  }
  schedules_ = std::move(set);
}

void Service::set_schedule_table(schedule::ScheduleTable table) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto set = std::make_shared<schedule::ScheduleSet>(*schedules_);
  set->add(std::move(table));
  schedules_ = std::move(set);
  for (auto& [key, record] : records_) retired_.push_back(std::move(record));
  records_.clear();
}

std::shared_ptr<const schedule::ScheduleSet> Service::schedules() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedules_;
}

Family Service::resolve(const Config& config, Family family, const std::string& arch) const {
  check_family(config, family);
  if (family != Family::kAuto) return family;
  return schedules()->route(config, arch);
}

Service::~Service() {
  std::string why;
  driver::Driver* d = loader_.try_get(&why);
  if (d == nullptr) return;
  // Errors are ignored: at process exit the driver may already be shutting down.
  for (const auto& w : workspaces_) d->api().cuMemFree(w.ptr);
  for (const auto& slab : capture_slabs_) d->api().cuMemFree(slab.ptr);
}

CUdeviceptr Service::stream_workspace(CUstream stream, bool capturing, std::size_t bytes,
                                      WorkspaceUse use) {
  if (capturing) return 0;
  driver::Driver& d = loader_.get();
  unsigned long long stream_id = 0;
  d.check(d.api().cuStreamGetId(stream, &stream_id), "cuStreamGetId");
  // The driver documents a stream's id as unique for the life of the process, so a stream the
  // application created needs nothing else (a recycled handle has a new id). The special
  // handles (the NULL stream, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) exist once per context:
  // only they are told apart by the context's id too, which costs two more driver queries.
  unsigned long long context_id = 0;
  if (stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD) {
    CUcontext ctx = nullptr;
    d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
    d.check(d.api().cuCtxGetId(ctx, &context_id), "cuCtxGetId");
  }
  std::lock_guard<std::mutex> lock(workspace_mutex_);
  auto it = std::find_if(workspaces_.begin(), workspaces_.end(), [&](const StreamWorkspace& w) {
    return w.context_id == context_id && w.stream_id == stream_id && w.use == use;
  });
  if (it != workspaces_.end() && it->bytes >= bytes) return it->ptr;
  const std::size_t grown = std::max<std::size_t>(bytes, 1 << 20);
  CUdeviceptr ptr = 0;
  d.check(d.api().cuMemAllocAsync(&ptr, grown, stream), "cuMemAllocAsync (grad_ape workspace)");
  if (use == WorkspaceUse::kClaimWords) {
    // Zeroed once: every launch leaves the words as it found them (zero_once_per_call).
    d.check(d.api().cuMemsetD32Async(ptr, 0, grown / sizeof(std::uint32_t), stream),
            "cuMemsetD32Async (grad_ape claim words)");
  }
  if (it != workspaces_.end()) {
    // Stream-ordered: freed after every kernel already queued on this stream that uses it.
    d.api().cuMemFreeAsync(it->ptr, stream);
    it->ptr = ptr;
    it->bytes = grown;
  } else {
    workspaces_.push_back({context_id, stream_id, use, ptr, grown});
  }
  return ptr;
}

cache::ModuleCache& Service::modules() {
  driver::Driver& d = loader_.get();
  std::call_once(modules_once_, [&] { modules_ = std::make_unique<cache::ModuleCache>(d); });
  return *modules_;
}

schedule::ShortWindowSchedule Service::schedule_for(const Config& config) const {
  return schedule::select_short_window(config, schedule_override_);
}

DeviceTraits Service::device_traits(int ordinal) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = devices_.find(ordinal);
    if (it != devices_.end()) return it->second;
  }
  driver::Driver& d = loader_.get();
  const auto& api = d.api();
  int count = 0;
  d.check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    fail(Status::kInvalidArgument, "device {} does not exist ({} CUDA devices)", ordinal, count);
  }
  CUdevice dev = 0;
  d.check(api.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  int major = 0;
  int minor = 0;
  DeviceTraits t;
  t.ordinal = ordinal;
  d.check(api.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
          "cuDeviceGetAttribute(major)");
  d.check(api.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
          "cuDeviceGetAttribute(minor)");
  d.check(api.cuDeviceGetAttribute(&t.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
          "cuDeviceGetAttribute(multiprocessor count)");
  d.check(api.cuDeviceGetAttribute(&t.sm.registers,
                                   CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, dev),
          "cuDeviceGetAttribute(registers per SM)");
  d.check(api.cuDeviceGetAttribute(&t.sm.threads,
                                   CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev),
          "cuDeviceGetAttribute(threads per SM)");
  d.check(
      api.cuDeviceGetAttribute(&t.sm.ctas, CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, dev),
      "cuDeviceGetAttribute(blocks per SM)");
  d.check(api.cuDeviceGetAttribute(&t.sm.shared_bytes,
                                   CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, dev),
          "cuDeviceGetAttribute(shared memory per SM)");
  if (major < 8) {
    fail(Status::kUnsupported, "device {} has compute capability {}.{}; csa needs 8.0 or newer",
         ordinal, major, minor);
  }
  t.arch = fmt::format("sm_{}{}", major, minor);
  t.cc_major = major;
  nvrtc::check_arch(t.arch);
  std::lock_guard<std::mutex> lock(mutex_);
  devices_.emplace(ordinal, t);
  return t;
}

int Service::current_device() {
  driver::Driver& d = loader_.get();
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    fail(Status::kInvalidArgument,
         "the calling thread has no current CUDA context; select a device first (cudaSetDevice, "
         "cuCtxSetCurrent or csa::device::make_current)");
  }
  CUdevice dev = 0;
  d.check(d.api().cuCtxGetDevice(&dev), "cuCtxGetDevice");
  return static_cast<int>(dev);
}

std::shared_ptr<const Prepared> Service::prepare(const Config& config, Family family, int device,
                                                 bool* compiled) {
  check_family(config, family);  // a bad configuration is reported before any driver use
  auto prepared = std::make_shared<Prepared>();
  prepared->config = config;
  prepared->device = device_traits(device);
  prepared->programmatic = programmatic_launch_ && prepared->device.cc_major >= 9;
  const auto set = schedules();
  const Family resolved = resolve(config, family, prepared->device.arch);
  prepared->family = resolved;
  if (resolved == Family::kLongWindow) {
    std::vector<schedule::LongWindowSchedule> forward, backward;
    LongWindowSlots slots;
    const ModuleSpec spec =
        long_window_spec(config, prepared->device.arch, *set, &forward, &backward, &slots);
    prepared->key = spec.key.hash;
    auto cubin = store_.get(spec.key, spec.request, compiled);
    prepared->module = modules().get(spec.key, cubin);
    prepare_long_window(*prepared, *set, forward, backward, slots);
    logger_.debug("prepared {} on device {} ({}): long-window, {} forward and {} backward kernels",
                  config_label(config), device, prepared->device.arch, forward.size(),
                  backward.size());
    return prepared;
  }
  prepared->schedule = schedule_for(config);
  const ModuleSpec spec = make_module_spec(config, resolved, prepared->schedule,
                                           prepared->device.arch, compile_options_);
  prepared->key = spec.key.hash;
  auto cubin = store_.get(spec.key, spec.request, compiled);
  prepared->module = modules().get(spec.key, cubin);
  logger_.debug("prepared {} on device {} ({}): {}", config_label(config), device,
                prepared->device.arch, prepared->schedule.describe());
  if (resolved == Family::kShortWindow) {
    driver::Driver& d = loader_.get();
    CUdevice dev = 0;
    d.check(d.api().cuDeviceGet(&dev, device), "cuDeviceGet");
    int regs = 0;
    int shared = 0;
    const CUkernel bwd = prepared->kernel(kSwBackwardAtomic);
    d.check(d.api().cuKernelGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, bwd, dev),
            "cuKernelGetAttribute(registers)");
    d.check(d.api().cuKernelGetAttribute(&shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, bwd, dev),
            "cuKernelGetAttribute(shared memory)");
    prepared->backward_resident_ctas = schedule::resident_ctas(
        prepared->device.sm, prepared->schedule.backward_tx * prepared->schedule.backward_ty, regs,
        shared);
  }
  return prepared;
}

std::shared_ptr<const Prepared> Service::prepared_for_call(const Config& config, Family family,
                                                           CUstream stream) {
  const int device = current_device();
  const RecordKey key{config.ratio, config.coff, config.head_dim, static_cast<int>(family), device};
  if (fast_launch_) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = records_.find(key);
    if (it != records_.end()) return it->second;
  }
  launch::ensure_not_capturing(loader_.get(), stream, "compiling or loading kernels",
                               config_label(config), prewarm_spec(config));
  auto prepared = prepare(config, family, device, nullptr);
  if (!fast_launch_) return prepared;  // CSA_FAST_LAUNCH=0: resolved again on every call
  std::lock_guard<std::mutex> lock(mutex_);
  return records_.emplace(key, std::move(prepared)).first->second;
}

std::shared_ptr<const Prepared> Service::record(const Config& config, Family family, int device) {
  check_family(config, family);
  const RecordKey key{config.ratio, config.coff, config.head_dim, static_cast<int>(family), device};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = records_.find(key);
    if (it != records_.end()) return it->second;
  }
  auto prepared = prepare(config, family, device, nullptr);
  set_aside_capture_words(device);
  std::lock_guard<std::mutex> lock(mutex_);
  return records_.emplace(key, std::move(prepared)).first->second;
}

void Service::check_record_device(const Prepared& p) {
  const int device = current_device();
  if (device != p.device.ordinal) {
    fail(Status::kInvalidArgument,
         "the plan for {} was prepared for device {} but the calling thread's current device is {}",
         config_label(p.config), p.device.ordinal, device);
  }
}

void Service::forward_with(const Prepared& p, const ForwardArgs& a, CUstream stream) {
  validate_forward(a);
  if (a.total_comp == 0) return;
  check_record_device(p);
  launch_forward(p, a, stream);
}

void Service::backward_with(const Prepared& p, const BackwardArgs& a, CUstream stream) {
  validate_backward(a);
  check_record_device(p);
  launch_backward(p, a, stream);
}

PrewarmReport Service::prewarm(const Config& config, int device, Family family) {
  const auto start = std::chrono::steady_clock::now();
  const RecordKey key{config.ratio, config.coff, config.head_dim, static_cast<int>(family), device};
  bool compiled = false;
  auto prepared = prepare(config, family, device, &compiled);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    records_.emplace(key, prepared);
  }
  set_aside_capture_words(device);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report_of(config, prepared->device.arch, prepared->key, *prepared->module->cubin, compiled,
                   seconds);
}

PrewarmReport Service::compile_for_arch(const Config& config, const std::string& arch,
                                        Family family) {
  const auto start = std::chrono::steady_clock::now();
  nvrtc::check_arch(arch);
  const auto set = schedules();
  const Family resolved = resolve(config, family, arch);
  ModuleSpec spec;
  if (resolved == Family::kLongWindow) {
    std::vector<schedule::LongWindowSchedule> forward, backward;
    spec = long_window_spec(config, arch, *set, &forward, &backward, nullptr);
  } else {
    spec = make_module_spec(config, resolved, schedule_for(config), arch, compile_options_);
  }
  bool compiled = false;
  auto cubin = store_.get(spec.key, spec.request, &compiled);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report_of(config, arch, spec.key.hash, *cubin, compiled, seconds);
}

void Service::forward(const ForwardArgs& a, CUstream stream, Family family) {
  validate_forward(a);
  check_family(a.config, family);
  if (a.total_comp == 0) return;  // nothing to write
  launch_forward(*prepared_for_call(a.config, family, stream), a, stream);
}

void Service::launch_forward(const Prepared& p, const ForwardArgs& a, CUstream stream) {
  if (p.family == Family::kLongWindow) {
    forward_long(p, a, stream);
    return;
  }
  csa_kernel::ForwardParams params{};
  fill_inputs(params, a);
  params.out = static_cast<csa_u16*>(a.out);
  launch::LaunchShape shape;
  if (p.family == Family::kReference) {
    shape.grid_x = blocks_for(a.total_comp * a.config.head_dim, kReferenceThreads);
    shape.block_x = kReferenceThreads;
    launch::launch(driver(), p.kernel(kRefForward), shape, params, stream,
                   "reference forward launch");
    return;
  }
  const auto choice = schedule::forward_choice(p.schedule, a.config, a.total_comp);
  const int ncv = a.config.head_dim / choice.vec;
  shape.block_x = static_cast<unsigned>(choice.threads);
  shape.programmatic = p.programmatic;
  shape.grid_x = blocks_for(a.total_comp * ncv, shape.block_x);
  const int slot = choice.wide ? kSwForwardWide : kSwForward;
  launch::launch(driver(), p.kernel(slot), shape, params, stream, "forward launch");
}

void Service::backward(const BackwardArgs& a, CUstream stream, Family family) {
  validate_backward(a);
  check_family(a.config, family);
  launch_backward(*prepared_for_call(a.config, family, stream), a, stream);
}

void Service::launch_backward(const Prepared& p, const BackwardArgs& a, CUstream stream) {
  if (p.family == Family::kLongWindow) {
    backward_long(p, a, stream);
    return;
  }
  driver::Driver& d = driver();
  const Config& c = a.config;
  const std::int64_t width = static_cast<std::int64_t>(c.coff) * c.head_dim;
  const std::int64_t ape_elems = c.ratio * width;
  const bool accumulate = (a.flags & kAccumulateGradApe) != 0;

  csa_kernel::BackwardParams params{};
  fill_inputs(params, a);
  fill_gradients(params, a);
  params.accumulate = accumulate ? 1 : 0;

  if (p.family == Family::kReference) {
    launch::LaunchShape shape;
    shape.block_x = kReferenceThreads;
    if (a.total_tokens > 0) {
      shape.grid_x = blocks_for(a.total_tokens * width, kReferenceThreads);
      launch::launch(d, p.kernel(kRefBackwardZeros), shape, params, stream,
                     "reference backward zeros launch");
    }
    if (a.total_comp > 0) {
      shape.grid_x = blocks_for(a.total_comp * c.head_dim, kReferenceThreads);
      launch::launch(d, p.kernel(kRefBackwardRows), shape, params, stream,
                     "reference backward launch");
    }
    shape.grid_x = blocks_for(ape_elems, kReferenceThreads);
    launch::launch(d, p.kernel(kRefGradApe), shape, params, stream, "reference grad_ape launch");
    return;
  }

  const auto& s = p.schedule;
  const auto grid =
      schedule::backward_grid(s, c, a.total_comp, p.device.sm_count, p.backward_resident_ctas);
  params.rows_per_cta = grid.rows_per_cta;
  launch::LaunchShape shape;
  shape.grid_x = static_cast<unsigned>(grid.grid_x);
  shape.grid_y = static_cast<unsigned>(grid.grid_y);
  shape.block_x = static_cast<unsigned>(s.backward_tx);
  shape.block_y = static_cast<unsigned>(s.backward_ty);
  shape.programmatic = p.programmatic;
  const bool deterministic = (a.flags & kDeterministic) != 0;
  const bool capturing = launch::is_capturing(d, stream);
  // One launch instead of two (one_launch): the atomic form, which zeroes grad_ape itself
  // through claim words; captured, only with enough work per CTA and claim words left.
  const int slots = c.ratio * (c.coff == 2 ? 2 : 1);
  bool fixed_order =
      deterministic ||
      (s.fixed_order_default &&
       (!s.one_launch || (capturing && static_cast<std::int64_t>(grid.rows_per_cta) * slots <
                                           s.captured_one_launch_min)));
  if (!fixed_order) {
    // The claim words are per column block (x).
    const CUdeviceptr words = accumulate ? 0 : claim_words(grid.grid_x, capturing, stream);
    if (words != 0 || accumulate || !s.fixed_order_default) {
      prepare_atomic_grad_ape(params, a, ape_elems, words, stream);
      launch::launch(d, p.kernel(kSwBackwardAtomic), shape, params, stream, "backward launch");
      return;
    }
    fixed_order = true;
  }
  const std::size_t workspace_bytes =
      static_cast<std::size_t>(grid.grid_y) * ape_elems * sizeof(float);
  CUdeviceptr workspace = stream_workspace(stream, capturing, workspace_bytes);
  std::optional<StreamScratch> graph_scratch;  // under capture: memory owned by the graph
  if (workspace == 0) workspace = graph_scratch.emplace(d, workspace_bytes, stream).get();
  params.workspace = device_ptr<float>(workspace);
  launch::launch(d, p.kernel(kSwBackwardFixed), shape, params, stream, "backward launch");
  launch_ape_reduce(d, p.kernel(kSwApeReduce), params.workspace, a, ape_elems, grid.grid_y,
                    {32, s.reduce_lanes, 1}, p.device.sm_count, p.programmatic, stream);
}

CUdeviceptr Service::claim_words(std::int64_t column_blocks, bool capturing, CUstream stream) {
  const std::size_t bytes = static_cast<std::size_t>(column_blocks) * sizeof(unsigned long long);
  if (capturing) return take_capture_words(bytes);
  if (capture_words_low_.load(std::memory_order_relaxed)) refill_capture_words();
  return stream_workspace(stream, false, bytes, WorkspaceUse::kClaimWords);
}

namespace {

unsigned long long current_context_id(const driver::Driver& d) {
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  unsigned long long id = 0;
  d.check(d.api().cuCtxGetId(ctx, &id), "cuCtxGetId");
  return id;
}

}  // namespace

CUdeviceptr Service::take_capture_words(std::size_t bytes) {
  driver::Driver& d = loader_.get();
  const unsigned long long context_id = current_context_id(d);
  const std::size_t need =
      (bytes + kCaptureWordsAlign - 1) / kCaptureWordsAlign * kCaptureWordsAlign;
  std::lock_guard<std::mutex> lock(workspace_mutex_);
  std::size_t left = 0;
  CUdeviceptr taken = 0;
  for (auto& slab : capture_slabs_) {
    if (slab.context_id != context_id) continue;
    if (taken == 0 && slab.bytes - slab.used >= need) {
      taken = slab.ptr + slab.used;
      slab.used += need;
    }
    left += slab.bytes - slab.used;
  }
  if (left < kCaptureSlabBytes / 4) capture_words_low_.store(true, std::memory_order_relaxed);
  if (taken == 0) {
    logger_.debug(
        "no claim words left for a captured backward ({} bytes): it keeps the form "
        "without them; an eager backward on this context allocates more",
        bytes);
  }
  return taken;
}

void Service::refill_capture_words() {
  driver::Driver& d = loader_.get();
  const auto& api = d.api();
  const unsigned long long context_id = current_context_id(d);
  std::lock_guard<std::mutex> lock(workspace_mutex_);
  std::size_t left = 0;
  for (const auto& slab : capture_slabs_)
    if (slab.context_id == context_id) left += slab.bytes - slab.used;
  if (left < kCaptureSlabBytes / 4) {
    // Zeroed on a stream of its own and waited for: the words must be zero for a graph replayed
    // on any stream, and no caller's stream is held up. Stream-ordered allocation, so that a
    // capture running in another thread is not disturbed.
    CUstream own = nullptr;
    d.check(api.cuStreamCreate(&own, CU_STREAM_NON_BLOCKING), "cuStreamCreate (claim words)");
    CUdeviceptr ptr = 0;
    CUresult r = api.cuMemAllocAsync(&ptr, kCaptureSlabBytes, own);
    if (r == CUDA_SUCCESS) {
      r = api.cuMemsetD32Async(ptr, 0, kCaptureSlabBytes / sizeof(std::uint32_t), own);
      if (r == CUDA_SUCCESS) r = api.cuStreamSynchronize(own);
      if (r != CUDA_SUCCESS) api.cuMemFreeAsync(ptr, own);
    }
    api.cuStreamDestroy(own);
    d.check(r, "allocating and zeroing claim words for captured backwards");
    capture_slabs_.push_back({context_id, ptr, kCaptureSlabBytes, 0});
  }
  capture_words_low_.store(false, std::memory_order_relaxed);
}

void Service::set_aside_capture_words(int device) {
  if (!capture_words_low_.load(std::memory_order_relaxed)) return;
  driver::Driver& d = loader_.get();
  CUcontext ctx = nullptr;
  CUdevice current = 0;
  if (d.api().cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr ||
      d.api().cuCtxGetDevice(&current) != CUDA_SUCCESS || static_cast<int>(current) != device)
    return;  // the calls will run in a context not current here: the first eager call does it
  try {
    refill_capture_words();
  } catch (const Error& e) {
    // Best effort: without them, captured calls take the forms without claim words.
    logger_.warn("setting aside claim words for captured backwards failed: {}", e.what());
  }
}

void Service::prepare_atomic_grad_ape(csa_kernel::BackwardParams& params, const BackwardArgs& a,
                                      std::int64_t ape_elems, CUdeviceptr words, CUstream stream) {
  if ((a.flags & kAccumulateGradApe) != 0) return;
  if (words != 0) {
    params.workspace = device_ptr<float>(words);
    return;
  }
  driver::Driver& d = driver();
  d.check(d.api().cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(a.grad_ape), 0,
                                   static_cast<std::size_t>(ape_elems), stream),
          "cuMemsetD32Async (grad_ape)");
}

OffsetReport Service::check_offsets(const std::int32_t* cu, const std::int32_t* cuc,
                                    std::int32_t num_segments, std::int64_t total_tokens,
                                    std::int64_t total_comp, std::int32_t ratio, CUstream stream) {
  if (cu == nullptr || cuc == nullptr)
    fail(Status::kInvalidArgument,
         "check_offsets: cu_seqlens and cu_seqlens_comp must not be null");
  if (num_segments < 0 || ratio < 1 || total_tokens < 0 || total_comp < 0 ||
      total_tokens >= (std::int64_t{1} << 31) || total_comp >= (std::int64_t{1} << 31)) {
    fail(Status::kInvalidArgument,
         "check_offsets: num_segments {}, ratio {}, total_tokens {}, total_comp {} out of range",
         num_segments, ratio, total_tokens, total_comp);
  }
  driver::Driver& d = driver();
  launch::ensure_not_capturing(d, stream, "reading offsets back from the device", "check_offsets",
                               "4,2,128");
  const DeviceTraits t = device_traits(current_device());
  const ModuleSpec spec = make_utility_spec(t.arch, compile_options_);
  auto module = modules().get(spec.key, store_.get(spec.key, spec.request));
  StreamScratch report(d, 2 * sizeof(std::int32_t), stream);
  csa_kernel::OffsetCheckParams params{};
  params.cu_seqlens = cu;
  params.cu_seqlens_comp = cuc;
  params.report = device_ptr<std::int32_t>(report.get());
  params.num_segments = num_segments;
  params.total_tokens = static_cast<csa_i32>(total_tokens);
  params.total_comp = static_cast<csa_i32>(total_comp);
  params.ratio = ratio;
  launch::LaunchShape shape;
  shape.block_x = 32;
  launch::launch(d, module->kernels.at(0), shape, params, stream, "offset check launch");
  std::int32_t host[2] = {-1, 0};
  d.check(d.api().cuStreamSynchronize(stream), "cuStreamSynchronize (offset check)");
  d.check(d.api().cuMemcpyDtoH(host, report.get(), sizeof host), "cuMemcpyDtoH (offset check)");
  OffsetReport r;
  r.ok = host[0] < 0;
  r.index = host[0];
  static const char* const kRules[] = {"",
                                       "cu_seqlens[0] and cu_seqlens_comp[0] must be 0",
                                       "cu_seqlens decreases",
                                       "cu_seqlens exceeds total_tokens",
                                       "cu_seqlens_comp step differs from floor(seqlen / ratio)",
                                       "cu_seqlens_comp exceeds total_comp"};
  if (!r.ok) r.message = fmt::format("entry {}: {}", host[0], kRules[std::clamp(host[1], 0, 5)]);
  return r;
}

}  // namespace csa::compressor
