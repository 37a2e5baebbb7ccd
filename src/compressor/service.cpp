#include "compressor/service.hpp"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>

#include "common/env.hpp"
#include "csa_params.h"
#include "common/error.hpp"
#include "compressor/grad_ape_policy.hpp"
#include "compressor/validation.hpp"
#include "compressor/launch_helpers.hpp"
#include "launch/launch.hpp"

namespace csa::compressor {

using detail::device_ptr;
using detail::StreamScratch;

namespace {

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

// One report for the modules of a configuration's layouts (prewarm): the first one's key and
// source, every kernel counted, the worst resources.
void merge_report(std::optional<PrewarmReport>& into, PrewarmReport r) {
  if (!into) {
    into = std::move(r);
    return;
  }
  into->compiled = into->compiled || r.compiled;
  into->kernels += r.kernels;
  into->max_registers = std::max(into->max_registers, r.max_registers);
  if (into->spill_bytes >= 0 && r.spill_bytes >= 0) into->spill_bytes += r.spill_bytes;
  into->stack_bytes = std::max(into->stack_bytes, r.stack_bytes);
  into->ptxas_log += r.ptxas_log;
}

// Register fitting for the modules that have kernels with a residency argument.
cache::CompileFn fitted_compile(const ModuleSpec& spec) {
  if (spec.residency.empty()) return {};
  return [residency = spec.residency](const nvrtc::Compiler& compiler,
                                      const nvrtc::CompileRequest& request) {
    return compile_fitted(compiler, request, residency);
  };
}

}  // namespace

Service::Service(const RuntimeOptions& options, Logger& logger, cache::KernelStore& store,
                 driver::Loader& loader)
    : logger_(logger),
      store_(store),
      loader_(loader),
      compile_options_{options.ptxas_verbose, options.line_info},
      schedule_override_(env::get("CSA_SHORT_WINDOW_SCHEDULE")),
      scratch_(loader, logger),
      devices_(loader) {
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
  records_.retire_all();
}

std::shared_ptr<const schedule::ScheduleSet> Service::schedules() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return schedules_;
}

Family Service::resolve(const Config& config, Family family, const std::string& arch) const {
  check_family(config, family);
  if (family != Family::kAuto) return family;
  // A tail: the short-window family up to its ratios, the long-window one beyond (check_family).
  if (config.tail.any())
    return config.ratio > schedule::kShortWindowMaxRatio ? Family::kLongWindow
                                                         : Family::kShortWindow;
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
  return devices_.traits(ordinal);
}

int Service::current_device() {
  return devices_.current_device();
}

void Service::make_current(int device) {
  devices_.make_current(device);
}

std::shared_ptr<const cache::LoadedModule> Service::load_module(const ModuleSpec& spec,
                                                                bool* compiled) {
  auto cubin = store_.get(spec.key, spec.request, compiled, fitted_compile(spec));
  try {
    return modules().get(spec.key, cubin);
  } catch (const Error& e) {
    if (cubin->compiled || e.code() != Status::kDriverError) throw;
    // A checksum-valid cache entry whose cubin the driver refuses: rebuilt once.
    logger_.warn("the driver refused the cached cubin of {} ({}); rebuilding it", spec.key.label,
                 e.what());
    cubin = store_.rebuild(spec.key, spec.request, fitted_compile(spec));
    if (compiled != nullptr) *compiled = true;
    return modules().get(spec.key, cubin);
  }
}

std::shared_ptr<const Prepared> Service::prepare(const Config& config, int kernel_layout,
                                                 Family family, int device, bool* compiled) {
  check_family(config, family);  // a bad configuration is reported before any driver use
  auto prepared = std::make_shared<Prepared>();
  prepared->config = config;
  prepared->kernel_layout = kernel_layout;
  prepared->device = device_traits(device);
  prepared->programmatic = programmatic_launch_ && prepared->device.cc_major >= 9;
  const auto set = schedules();
  const Family resolved = resolve(config, family, prepared->device.arch);
  prepared->family = resolved;
  if (resolved == Family::kLongWindow) {
    std::vector<schedule::LongWindowSchedule> forward, backward;
    const ModuleSpec spec =
        long_window_spec(config, kernel_layout, prepared->device.arch, *set, &forward, &backward);
    prepared->key = spec.key.hash;
    prepared->slots = spec.slots;
    prepared->module = load_module(spec, compiled);
    prepare_long_window(*prepared, *set, spec);
    logger_.debug("prepared {} on device {} ({}): long-window, {} forward and {} backward kernels",
                  config_label(config), device, prepared->device.arch, forward.size(),
                  backward.size());
    return prepared;
  }
  prepared->schedule = schedule_for(config);
  const ModuleSpec spec = make_module_spec(config, kernel_layout, resolved, prepared->schedule,
                                           prepared->device.arch, compile_options_);
  prepared->key = spec.key.hash;
  prepared->slots = spec.slots;
  prepared->module = load_module(spec, compiled);
  logger_.debug("prepared {} on device {} ({}): {}", config_label(config), device,
                prepared->device.arch, prepared->schedule.describe());
  if (resolved == Family::kShortWindow) {
    driver::Driver& d = loader_.get();
    CUdevice dev = 0;
    d.check(d.api().cuDeviceGet(&dev, device), "cuDeviceGet");
    // CTAs per SM of a backward kernel, from its registers and shared memory.
    auto ctas_of = [&](int slot, int threads) {
      int regs = 0;
      int shared = 0;
      const CUkernel bwd = prepared->kernel(slot);
      d.check(d.api().cuKernelGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, bwd, dev),
              "cuKernelGetAttribute(registers)");
      d.check(d.api().cuKernelGetAttribute(&shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, bwd, dev),
              "cuKernelGetAttribute(shared memory)");
      return schedule::resident_ctas(prepared->device.sm, threads, regs, shared);
    };
    const ShortWindowSlots& slots = prepared->slots.short_window;
    const auto& s = prepared->schedule;
    const int threads = s.backward_tx * s.backward_ty;
    // A tail module at one row lane a CTA holds the fixed-order backward only.
    prepared->backward_ctas_per_sm =
        ctas_of(slots.backward_atomic >= 0 ? slots.backward_atomic : slots.backward_fixed, threads);
    if (slots.backward_fixed_resident >= 0) {
      prepared->resident_backward_ctas_per_sm =
          ctas_of(slots.backward_atomic_resident >= 0 ? slots.backward_atomic_resident
                                                      : slots.backward_fixed_resident,
                  threads);
    }
    if (slots.backward_row_stats_atomic >= 0) {
      prepared->row_stats_backward_ctas_per_sm =
          ctas_of(slots.backward_row_stats_atomic, s.row_stats_tx * s.row_stats_ty);
    }
  }
  return prepared;
}

std::shared_ptr<const Prepared> Service::prepared_for_call(const Config& config, int kernel_layout,
                                                           Family family, CUstream stream) {
  const int device = current_device();
  const RecordCache::Key key = RecordCache::key(config, kernel_layout, family, device);
  if (fast_launch_) {
    if (auto record = records_.find(key)) return record;
  }
  Config wanted = config;  // what a prewarm for this call names
  wanted.strided = kernel_layout == csa_kernel::kLayoutThdStrided;
  launch::ensure_not_capturing(loader_.get(), stream, "compiling or loading kernels",
                               config_label(wanted), prewarm_spec(wanted));
  auto prepared = prepare(config, kernel_layout, family, device, nullptr);
  if (!fast_launch_) return prepared;  // CSA_FAST_LAUNCH=0: resolved again on every call
  return records_.insert(key, std::move(prepared));
}

std::shared_ptr<const Prepared> Service::record(const Config& config, int kernel_layout,
                                                Family family, int device) {
  check_family(config, family);
  const RecordCache::Key key = RecordCache::key(config, kernel_layout, family, device);
  if (auto record = records_.find(key)) return record;
  auto prepared = prepare(config, kernel_layout, family, device, nullptr);
  scratch_.set_aside_capture_words(device);
  return records_.insert(key, std::move(prepared));
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
  std::optional<PrewarmReport> report;
  for (const int layout : kernel_layouts(config)) {
    bool compiled = false;
    auto prepared = prepare(config, layout, family, device, &compiled);
    records_.insert(RecordCache::key(config, layout, family, device), prepared);
    merge_report(report, report_of(config, prepared->device.arch, prepared->key,
                                   *prepared->module->cubin, compiled, 0.0));
  }
  scratch_.set_aside_capture_words(device);
  report->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return *report;
}

PrewarmReport Service::compile_for_arch(const Config& config, const std::string& arch,
                                        Family family) {
  const auto start = std::chrono::steady_clock::now();
  nvrtc::check_arch(arch);
  const auto set = schedules();
  const Family resolved = resolve(config, family, arch);
  std::optional<PrewarmReport> report;
  for (const int layout : kernel_layouts(config)) {
    ModuleSpec spec;
    if (resolved == Family::kLongWindow) {
      std::vector<schedule::LongWindowSchedule> forward, backward;
      spec = long_window_spec(config, layout, arch, *set, &forward, &backward);
    } else {
      spec =
          make_module_spec(config, layout, resolved, schedule_for(config), arch, compile_options_);
    }
    bool compiled = false;
    auto cubin = store_.get(spec.key, spec.request, &compiled, fitted_compile(spec));
    merge_report(report, report_of(config, arch, spec.key.hash, *cubin, compiled, 0.0));
  }
  report->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return *report;
}

void Service::forward(const ForwardArgs& a, CUstream stream, Family family) {
  validate_forward(a);
  check_family(a.config, family);
  if (a.total_comp == 0) return;  // nothing to write
  launch_forward(*prepared_for_call(a.config, kernel_layout(a), family, stream), a, stream);
}

void Service::backward(const BackwardArgs& a, CUstream stream, Family family) {
  validate_backward(a);
  check_family(a.config, family);
  launch_backward(*prepared_for_call(a.config, kernel_layout(a), family, stream), a, stream);
}

CUdeviceptr Service::call_workspace(CUstream stream, bool capturing, std::size_t bytes,
                                    std::optional<StreamScratch>& graph) {
  const CUdeviceptr workspace = scratch_.stream_workspace(stream, capturing, bytes);
  return workspace != 0 ? workspace : graph.emplace(driver(), bytes, stream).get();
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
  if (a.config.tail.norm) {
    d.check(d.api().cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(a.grad_norm_weight), 0,
                                     static_cast<std::size_t>(a.config.head_dim), stream),
            "cuMemsetD32Async (grad_norm_weight)");
  }
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
