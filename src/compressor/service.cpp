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
  r.source = cubin.source;
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
      scratch_(loader, logger) {
  std::vector<std::string> warnings;
  fast_launch_ = env::flag("CSA_FAST_LAUNCH", true, warnings);
  programmatic_launch_ = env::flag("CSA_PROGRAMMATIC_LAUNCH", true, warnings);
  for (const auto& warning : warnings) logger_.warn("{}", warning);
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

Service::~Service() = default;

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
         "cuCtxSetCurrent or csa_set_device)");
  }
  CUdevice dev = 0;
  d.check(d.api().cuCtxGetDevice(&dev), "cuCtxGetDevice");
  return static_cast<int>(dev);
}

void Service::make_current(int device) {
  driver::Driver& d = loader_.get();
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) {
    CUdevice current = 0;
    d.check(d.api().cuCtxGetDevice(&current), "cuCtxGetDevice");
    if (current == device) return;
  }
  device_traits(device);  // validates the ordinal
  CUdevice dev = 0;
  d.check(d.api().cuDeviceGet(&dev, device), "cuDeviceGet");
  // NOTE: the primary context (the CUDA runtime's and the frameworks') is retained and never
  // released here: it is shared with everything else in the process.
  d.check(d.api().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  d.check(d.api().cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

std::shared_ptr<const cache::LoadedModule> Service::load_module(const ModuleSpec& spec,
                                                                bool* compiled) {
  auto cubin = store_.get(spec.key, spec.request, compiled);
  try {
    return modules().get(spec.key, cubin);
  } catch (const Error& e) {
    if (cubin->compiled || e.code() != Status::kDriverError) throw;
    // A checksum-valid cache entry whose cubin the driver refuses: rebuilt once.
    logger_.warn("the driver refused the cached cubin of {} ({}); rebuilding it", spec.key.label,
                 e.what());
    cubin = store_.rebuild(spec.key, spec.request);
    if (compiled != nullptr) *compiled = true;
    return modules().get(spec.key, cubin);
  }
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
    prepared->module = load_module(spec, compiled);
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
  prepared->module = load_module(spec, compiled);
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
  scratch_.set_aside_capture_words(device);
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
  scratch_.set_aside_capture_words(device);
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
  // through claim words; captured, where claim words are left (and a CTA has at least
  // captured_one_launch_min rows x slots of work: 0, always, by default).
  const int slots = c.ratio * c.coff;  // window slots
  bool fixed_order =
      deterministic ||
      (s.fixed_order_default &&
       (!s.one_launch || (capturing && static_cast<std::int64_t>(grid.rows_per_cta) * slots <
                                           s.captured_one_launch_min)));
  if (!fixed_order) {
    // The claim words are per column block (x).
    const CUdeviceptr words = accumulate ? 0 : scratch_.claim_words(grid.grid_x, capturing, stream);
    if (words != 0 || accumulate || !s.fixed_order_default) {
      prepare_atomic_grad_ape(params, a, ape_elems, words, stream);
      launch::launch(d, p.kernel(kSwBackwardAtomic), shape, params, stream, "backward launch");
      return;
    }
    fixed_order = true;
  }
  const std::size_t workspace_bytes =
      static_cast<std::size_t>(grid.grid_y) * ape_elems * sizeof(float);
  CUdeviceptr workspace = scratch_.stream_workspace(stream, capturing, workspace_bytes);
  std::optional<StreamScratch> graph_scratch;  // under capture: memory owned by the graph
  if (workspace == 0) workspace = graph_scratch.emplace(d, workspace_bytes, stream).get();
  params.workspace = device_ptr<float>(workspace);
  launch::launch(d, p.kernel(kSwBackwardFixed), shape, params, stream, "backward launch");
  launch_ape_reduce(d, p.kernel(kSwApeReduce), params.workspace, a, ape_elems, grid.grid_y,
                    {32, s.reduce_lanes, 1}, p.device.sm_count, p.programmatic, stream);
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
  if (num_segments < 0 || num_segments > kMaxSegments || ratio < 1 || ratio > kMaxRatio ||
      total_tokens < 0 || total_comp < 0 || total_tokens >= (std::int64_t{1} << 31) ||
      total_comp >= (std::int64_t{1} << 31)) {
    fail(Status::kInvalidArgument,
         "check_offsets: num_segments {}, ratio {}, total_tokens {}, total_comp {} out of range",
         num_segments, ratio, total_tokens, total_comp);
  }
  driver::Driver& d = driver();
  launch::ensure_not_capturing(d, stream, "reading offsets back from the device", "check_offsets",
                               "4,2,128");
  const DeviceTraits t = device_traits(current_device());
  const ModuleSpec spec = make_utility_spec(t.arch, compile_options_);
  auto module = load_module(spec, nullptr);
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
