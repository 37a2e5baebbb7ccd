#include <dlfcn.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <sstream>

#include "api/runtime_impl.hpp"
#include "compressor/grad_ape_policy.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "compressor/validation.hpp"
#include "schedule/short_window.hpp"
#include "schedule/table.hpp"

namespace csa {

RuntimeOptions RuntimeOptions::from_environment() {
  RuntimeOptions o;
  auto& w = o.warnings;
  o.cache_dir = env::get("CSA_CACHE_DIR").value_or("");
  o.disk_cache = !env::flag("CSA_DISABLE_DISK_CACHE", false, w);
  if (const auto path = env::get("CSA_CACHE_PATH")) {
    std::string item;
    std::istringstream in(*path);
    while (std::getline(in, item, ':'))
      if (!item.empty()) o.cache_layers.push_back(item);
  }
  o.cache_max_bytes = env::integer("CSA_CACHE_MAX_BYTES", 1,
                                   std::numeric_limits<std::int64_t>::max(), o.cache_max_bytes, w);
  o.prebuilt_kernels = env::flag("CSA_PREBUILT_KERNELS", true, w);
  o.jit_enabled = !env::flag("CSA_DISABLE_JIT", false, w);
  o.ptxas_verbose = env::flag("CSA_PTXAS_VERBOSE", true, w);
  o.line_info = env::flag("CSA_LINEINFO", false, w);
  o.log_level = env::get("CSA_LOG_LEVEL").value_or("");
  return o;
}

std::string prebuilt_kernels_directory() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&prebuilt_kernels_directory), &info) == 0 ||
      info.dli_fname == nullptr)
    return {};
  return (std::filesystem::path(info.dli_fname).parent_path() / "csa-kernels").string();
}

Runtime::Runtime(RuntimeOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Runtime::~Runtime() = default;

Runtime& Runtime::default_runtime() {
  // NOTE: the one process-wide instance, created on first use; trainers that want control
  // over its options or lifetime build their own Runtime instead.
  static Runtime runtime;
  return runtime;
}

void Runtime::forward(const ForwardArgs& args, Stream stream, Family family) {
  impl_->service.forward(args, reinterpret_cast<CUstream>(stream), family);
}

void Runtime::backward(const BackwardArgs& args, Stream stream, Family family) {
  impl_->service.backward(args, reinterpret_cast<CUstream>(stream), family);
}

PrewarmReport Runtime::prewarm(const Config& config, int device, Family family) {
  return impl_->service.prewarm(config, device, family);
}

PrewarmReport Runtime::compile_for_arch(const Config& config, std::string_view arch,
                                        Family family) {
  return impl_->service.compile_for_arch(config, std::string(arch), family);
}

OffsetReport Runtime::check_offsets(const std::int32_t* cu_seqlens,
                                    const std::int32_t* cu_seqlens_comp, std::int32_t num_segments,
                                    std::int64_t total_tokens, std::int64_t total_comp,
                                    std::int32_t ratio, Stream stream) {
  return impl_->service.check_offsets(cu_seqlens, cu_seqlens_comp, num_segments, total_tokens,
                                      total_comp, ratio, reinterpret_cast<CUstream>(stream));
}

void Runtime::set_schedule_table(std::string_view json_text, std::string_view source_name) {
  impl_->service.set_schedule_table(
      schedule::parse_schedule_table(json_text, std::string(source_name)));
}

bool keeps_pooled_rows(const Config& config) {
  return config.tail.any() && config.ratio > schedule::kShortWindowMaxRatio;
}

bool has_row_stats_backward(const Config& config) {
  return config.tail.norm && !config.tail.hadamard &&
         config.ratio <= schedule::kShortWindowMaxRatio;
}

ScheduleChoice Runtime::select_schedule(const Config& config, Direction direction,
                                        std::int64_t rows, std::string_view arch) {
  const std::string a(arch);
  nvrtc::check_arch(a);
  compressor::validate_config(config);
  if (rows < 0) fail(Status::kInvalidArgument, "rows is {} (must be >= 0)", rows);
  ScheduleChoice choice;
  choice.family = impl_->service.resolve(config, Family::kAuto, a);
  if (choice.family == Family::kShortWindow) {
    // The schedule the launch path uses, CSA_SHORT_WINDOW_SCHEDULE included.
    const schedule::ShortWindowSchedule s = impl_->service.schedule_for(config);
    choice.schedule = s.describe();
    if (direction == Direction::kBackward) {
      // The kernel of this row count: the resident one of the call's kernels, if they have one.
      const int kernel_layout = compressor::kernel_layouts(config).back();
      const bool resident = schedule::backward_resident_ctas_for(s, config, kernel_layout) > 0 &&
                            schedule::backward_takes_resident(s, config, rows);
      choice.schedule += resident ? ",kernel=resident" : ",kernel=default";
    } else {
      const schedule::ForwardChoice f = schedule::forward_choice(s, config, rows);
      choice.schedule += f.wide ? ",kernel=wide" : ",kernel=narrow";
      // The tail's kernels hold whole rows: their own vector width and CTA size.
      if (config.tail.any())
        choice.schedule += fmt::format(",tail_vec={},tail_threads={}", f.vec, f.threads);
    }
    // The tail is under the tolerance contract (its row sums are not the reference's order).
    choice.contract = config.tail.any() ? "tolerance" : "bitwise";
    const compressor::GradApeForm form = compressor::short_window_grad_ape(s);
    choice.grad_ape_atomic = direction == Direction::kBackward && form.atomic;
    choice.grad_ape_atomic_needs_claim_words = choice.grad_ape_atomic && form.needs_claim_words;
    return choice;
  }
  const auto set = impl_->service.schedules();
  const schedule::Selection sel = set->select(config, direction, rows, a);
  choice.table_arch = sel.table_arch;
  if (const schedule::ScheduleTable* t = set->table_for(a); t != nullptr && sel.entry >= 0) {
    choice.table_source = t->source;
    const schedule::TableEntry& e = t->entries[static_cast<std::size_t>(sel.entry)];
    if (e.dtype) choice.entry_dtype = dtype_name(*e.dtype);
    if (e.layout) choice.entry_layout = layout_name(*e.layout);
    if (e.tail) choice.entry_tail = *e.tail;
  }
  choice.entry = sel.entry;
  choice.bucket = sel.bucket;
  choice.rows_min = sel.rows_min;
  choice.rows_max = sel.rows_max;
  choice.schedule = sel.schedule.describe();
  choice.contract = sel.schedule.bitwise() ? "bitwise" : "tolerance";
  choice.grad_ape_atomic =
      direction == Direction::kBackward && compressor::long_window_atomic(sel.schedule, false);
  return choice;
}

std::string Runtime::schedule_table_json(std::string_view arch) {
  const auto set = impl_->service.schedules();
  const schedule::ScheduleTable* t = set->table_for(std::string(arch));
  return t == nullptr ? std::string() : schedule::to_json(*t);
}

std::vector<std::string> Runtime::schedule_table_archs() {
  std::vector<std::string> out;
  for (const auto& [cc, table] : impl_->service.schedules()->tables()) out.push_back(table.arch);
  return out;
}

void validate_shape(const Config& config, std::int64_t total_tokens, std::int32_t num_segments,
                    std::int64_t total_comp) {
  compressor::validate_sizes(config, total_tokens, num_segments, total_comp);
}

void validate_schedule_table(std::string_view json_text, std::string_view source_name) {
  schedule::parse_schedule_table(json_text, std::string(source_name));
}

DriverInfo Runtime::driver_info() {
  DriverInfo info;
  driver::Driver* d = impl_->loader.try_get(&info.reason);
  if (d == nullptr) return info;
  info.available = true;
  info.driver_version = d->version();
  const auto& api = d->api();
  int count = 0;
  d->check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    d->check(api.cuDeviceGet(&dev, i), "cuDeviceGet");
    DeviceInfo di;
    di.ordinal = i;
    char name[256] = {};
    d->check(api.cuDeviceGetName(name, sizeof name - 1, dev), "cuDeviceGetName");
    di.name = name;
    int l2 = 0;
    d->check(
        api.cuDeviceGetAttribute(&di.cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
        "cuDeviceGetAttribute");
    d->check(
        api.cuDeviceGetAttribute(&di.cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
        "cuDeviceGetAttribute");
    d->check(api.cuDeviceGetAttribute(&di.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
             "cuDeviceGetAttribute");
    d->check(api.cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev),
             "cuDeviceGetAttribute");
    di.l2_bytes = l2;
    std::size_t mem = 0;
    d->check(api.cuDeviceTotalMem(&mem, dev), "cuDeviceTotalMem");
    di.memory_bytes = static_cast<std::int64_t>(mem);
    info.devices.push_back(di);
  }
  return info;
}

std::string Runtime::info_json() {
  Runtime& rt = *this;
  nlohmann::json j;
  j["version"] = version();
  j["nvrtc"] = nvrtc_version();
  j["nvrtc_archs"] = supported_archs();
  const DriverInfo d = rt.driver_info();
  j["driver"] = {{"available", d.available}, {"reason", d.reason}, {"version", d.driver_version}};
  j["devices"] = nlohmann::json::array();
  for (const auto& dev : d.devices) {
    j["devices"].push_back({{"ordinal", dev.ordinal},
                            {"name", dev.name},
                            {"arch", "sm_" + std::to_string(dev.cc_major * 10 + dev.cc_minor)},
                            {"sm_count", dev.sm_count},
                            {"l2_bytes", dev.l2_bytes},
                            {"memory_bytes", dev.memory_bytes}});
  }
  const CacheInfo c = rt.cache_info();
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : c.layers) {
    layers.push_back({{"directory", l.directory},
                      {"read_only_layer", l.read_only_layer},
                      {"state", l.state},
                      {"entries", l.entries},
                      {"bytes", l.bytes}});
  }
  j["cache"] = {{"directory", c.directory}, {"persistent", c.persistent}, {"entries", c.entries},
                {"bytes", c.bytes},         {"max_bytes", c.max_bytes},   {"layers", layers}};
  j["default_configs"] = nlohmann::json::array();
  for (const auto& cfg : default_configs()) {
    j["default_configs"].push_back(
        {{"ratio", cfg.ratio}, {"coff", cfg.coff}, {"head_dim", cfg.head_dim}});
  }
  return j.dump();
}

CacheInfo Runtime::cache_info() const {
  return impl_->disk.info();
}
std::int64_t Runtime::clear_disk_cache() {
  return impl_->disk.clear();
}
const RuntimeOptions& Runtime::options() const {
  return impl_->options;
}

void forward(const ForwardArgs& args, Stream stream) {
  Runtime::default_runtime().forward(args, stream);
}
void backward(const BackwardArgs& args, Stream stream) {
  Runtime::default_runtime().backward(args, stream);
}

const char* version() noexcept {
  return CSA_VERSION_STRING;
}

std::string nvrtc_version() {
  const auto [major, minor] = nvrtc::Compiler::version();
  return fmt::format("{}.{}", major, minor);
}

std::vector<std::string> supported_archs() {
  std::vector<std::string> out;
  for (int a : nvrtc::Compiler::supported_archs()) out.push_back(fmt::format("sm_{}", a));
  return out;
}

std::vector<Config> default_configs() {
  // DeepSeek-V4 production shapes: CSA main (4,2,512) and indexer (4,2,128); ratio 2 trainings.
  return {{4, 512, 2}, {4, 128, 2}, {2, 512, 2}, {2, 128, 2}};
}

}  // namespace csa
