// NVRTC compiles every shipped configuration (short- and long-window, every bucket kernel) for
// sm_80, sm_90 and sm_100, and every `csa tune` candidate for sm_90, with no spills and no local
// memory beyond the ledger of modules known to use it (tests/local_memory.txt, exact); compile
// failures carry the log and the options.
#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "common/error.hpp"
#include "compressor/kernel_sources.hpp"
#include "compressor/kernel_spec.hpp"
#include "compressor/register_fit.hpp"
#include "csa_params.h"
#include "nvrtc/compiler.hpp"
#include "schedule/long_window.hpp"
#include "test_util.hpp"
#include "tune_plan.hpp"

namespace csa::test {
namespace {

// The shipped set: every short-window ratio, both coffs, an odd head_dim (scalar kernels), a
// small even one and the widest-block even ones (vectorised kernels, multi-CTA columns); the
// long-window family likewise, with head_dims under 8.
std::vector<Config> shipped_configs() {
  std::vector<Config> out;
  for (int ratio = 1; ratio <= 16; ++ratio)
    for (int coff : {1, 2})
      for (int d : {65, 128, 512}) out.push_back({ratio, d, coff});
  for (const auto& c : default_configs()) out.push_back(c);
  out.push_back({4, 4096, 2});
  out.push_back({16, 4096, 2});
  out.push_back({16, 1, 1});
  // Long-window family: the crossover ratio, the powers of two up to 256, widest head_dim.
  for (int ratio : {17, 32, 64, 128, 256})
    for (int coff : {1, 2})
      for (int d : {65, 128, 512}) out.push_back({ratio, d, coff});
  out.push_back({128, 4096, 1});
  out.push_back({256, 4096, 2});
  // Column blocks narrower than the backward ring's 16-byte chunks (head_dim below 8).
  out.push_back({17, 1, 1});
  out.push_back({128, 3, 2});
  out.push_back({256, 7, 2});
  return out;
}

// A module's local memory as ptxas reports it: spill stores + loads, the largest stack frame.
struct LocalMemory {
  int spill = 0;
  int stack = 0;
};
bool operator==(const LocalMemory& a, const LocalMemory& b) {
  return a.spill == b.spill && a.stack == b.stack;
}

// The modules that use local memory today, by the label the tests print: one line each,
// "<label>\t<spill bytes>\t<stack bytes>" ('#' starts a comment). A module must match its line
// exactly (no line: none at all), so a new spill, a larger one and a removed one all fail
// until the ledger says so; each failure prints the line to put there.
const std::map<std::string, LocalMemory>& local_memory_ledger() {
  static const std::map<std::string, LocalMemory> ledger = [] {
    std::map<std::string, LocalMemory> out;
    std::ifstream in(CSA_LOCAL_MEMORY_LEDGER);
    if (!in) throw std::runtime_error("cannot read " CSA_LOCAL_MEMORY_LEDGER);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      const auto a = line.find('\t');
      const auto b = a == std::string::npos ? a : line.find('\t', a + 1);
      if (b == std::string::npos)
        throw std::runtime_error("malformed ledger line in " CSA_LOCAL_MEMORY_LEDGER ": " + line);
      out[line.substr(0, a)] = {std::stoi(line.substr(a + 1, b - a - 1)),
                                std::stoi(line.substr(b + 1))};
    }
    return out;
  }();
  return ledger;
}

// Empty when `what` uses exactly the local memory its ledger line says (none without a line).
std::string local_memory_failure(const std::string& what, const PrewarmReport& r) {
  const LocalMemory used{r.spill_bytes, r.stack_bytes};
  const auto& ledger = local_memory_ledger();
  const auto it = ledger.find(what);
  const LocalMemory known = it == ledger.end() ? LocalMemory{} : it->second;
  if (used == known) return {};
  return fmt::format(
      "{}: spill {} B, stack {} B where tests/local_memory.txt says {} B, {} B; "
      "its line: {}\t{}\t{}\n{}",
      what, used.spill, used.stack, known.spill, known.stack, what, used.spill, used.stack,
      r.ptxas_log);
}

// Compiles every job for its arch in parallel; each must report its resources, no warnings,
// and the local memory of its ledger line (none without one).
void compile_without_local_memory(const std::vector<std::pair<Config, std::string>>& jobs) {
  RuntimeOptions o;
  o.disk_cache = false;
  Runtime rt(o);
  std::atomic<std::size_t> next{0};
  std::mutex mutex;
  std::vector<std::string> failures;
  int max_registers = 0;
  int modules = 0;
  auto worker = [&] {
    for (std::size_t i = next++; i < jobs.size(); i = next++) {
      const auto& [config, arch] = jobs[i];
      const std::string what = fmt::format(
          "{} ratio={} coff={} head_dim={} {} {}{} tail={}", arch, config.ratio, config.coff,
          config.head_dim, dtype_name(config.dtype), layout_name(config.layout),
          config.strided ? " strided" : "", tail_name(config.tail));
      try {
        const PrewarmReport r = rt.compile_for_arch(config, arch);
        std::lock_guard<std::mutex> lock(mutex);
        modules += config.strided ? 2 : 1;
        max_registers = std::max(max_registers, r.max_registers);
        if (r.max_registers <= 0) failures.push_back(what + ": no ptxas report");
        if (r.ptxas_log.find("warning") != std::string::npos)
          failures.push_back(what + ": warnings\n" + r.ptxas_log);
        if (auto f = local_memory_failure(what, r); !f.empty()) failures.push_back(std::move(f));
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        failures.push_back(what + ": " + e.what());
      }
    }
  };
  std::vector<std::thread> threads;
  const unsigned n = std::max(2u, std::thread::hardware_concurrency());
  for (unsigned t = 0; t < n; ++t) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  std::printf("compiled %d modules, max %d registers per thread\n", modules, max_registers);
}

// Each shape in every element type, THD (packed and strided: bf16 packed compiled again in
// one module) and SBHD, for sm_80, sm_90 and sm_100.
std::vector<std::pair<Config, std::string>> every_type_and_layout(
    const std::vector<Config>& shapes) {
  std::vector<std::pair<Config, std::string>> jobs;
  for (const char* arch : {"sm_80", "sm_90", "sm_100"}) {
    for (Config c : shapes) {
      for (DType t : {DType::kBf16, DType::kF16, DType::kF32}) {
        c.dtype = t;
        c.layout = Layout::kThd;
        c.strided = true;
        jobs.emplace_back(c, arch);
        c.layout = Layout::kSbhd;
        c.strided = false;
        jobs.emplace_back(c, arch);
      }
    }
  }
  return jobs;
}

TEST(NvrtcCompile, EveryShippedConfigurationWithoutLocalMemory) {
  std::vector<std::pair<Config, std::string>> jobs;
  for (const char* arch : {"sm_80", "sm_90", "sm_100"})
    for (const auto& c : shipped_configs()) jobs.emplace_back(c, arch);
  compile_without_local_memory(jobs);
}

// Every kernel template under every I/O policy: each family (short-window, long-window at the
// crossover and at 128, the narrowest and widest head_dims) in fp16 and fp32 THD packed, and
// every type THD strided and SBHD (bf16 THD packed is the test above).
TEST(NvrtcCompile, EveryElementTypeAndLayoutWithoutLocalMemory) {
  std::vector<Config> shapes;
  for (int ratio : {2, 16, 128})
    for (int coff : {1, 2})
      for (int d : {65, 512}) shapes.push_back({ratio, d, coff});
  shapes.push_back({4, 4096, 2});
  // Windows of 5..8 slots: their modules hold the resident backward (and the fp16 wide
  // forward its residency target), fitted to 80 registers.
  shapes.push_back({4, 128, 2});
  shapes.push_back({4, 512, 2});  // the production shape
  shapes.push_back({8, 65, 1});
  shapes.push_back({256, 7, 2});
  shapes.push_back({17, 128, 1});
  compile_without_local_memory(every_type_and_layout(shapes));
}

// Every fused-tail forward: the production tails (4,2,512 norm + RoPE 64; 4,2,128 norm + RoPE
// 64 + Hadamard) and their ratio-2 forms, the widest windows (ratio 16), one column a thread
// (head_dim 96), half-split pairs and a bf16 weight, in every type and layout.
TEST(NvrtcCompile, EveryTailKernelWithoutLocalMemory) {
  auto tail = [](int ratio, int d, int coff, bool norm, int rope_dim, bool hadamard) {
    Config c{ratio, d, coff};
    c.tail.norm = norm;
    c.tail.rope_dim = rope_dim;
    c.tail.hadamard = hadamard;
    return c;
  };
  std::vector<Config> shapes = {
      tail(4, 512, 2, true, 64, false), tail(4, 128, 2, true, 64, true),
      tail(2, 512, 2, true, 64, false), tail(2, 128, 2, true, 64, true),
      tail(16, 512, 2, true, 64, true), tail(16, 128, 1, true, 64, true),
      tail(4, 128, 1, false, 64, false), tail(8, 512, 2, false, 0, true),
      tail(4, 96, 2, true, 32, false), tail(8, 1024, 2, true, 64, true),
      // The long-window family's (ratio > 16): the production shape, a coff-2 indexer-like
      // one, every stage but the norm over the whole row.
      tail(128, 512, 1, true, 64, false), tail(32, 128, 2, true, 64, true),
      tail(64, 64, 1, false, 64, true)};
  Config half = tail(4, 128, 2, true, 64, true);
  half.tail.rope_interleaved = false;
  half.tail.norm_weight_dtype = DType::kBf16;
  shapes.push_back(half);
  compile_without_local_memory(every_type_and_layout(shapes));
}

// Every schedule `csa tune` measures on an sm_90 device (as the loader fits it) compiles with no
// spills and no local memory, so a tuning run cannot write a table whose kernels spill.
TEST(NvrtcCompile, EveryTunerCandidateWithoutLocalMemory) {
  for (const Config c :
       {Config{128, 128, 1}, Config{128, 128, 2}, Config{128, 512, 1}, Config{128, 512, 2}}) {
    nlohmann::json entries = nlohmann::json::array();
    for (const Direction d : {Direction::kForward, Direction::kBackward}) {
      nlohmann::json buckets = nlohmann::json::array();
      const auto candidates = tools::tune_candidates(c, d);
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        nlohmann::json b = candidates[i].bucket;
        b["max_rows"] = i + 1 < candidates.size() ? nlohmann::json(i + 1) : nlohmann::json(nullptr);
        buckets.push_back(b);
      }
      entries.push_back(tools::make_entry(c, d, buckets));
    }
    const nlohmann::json table = {{"schema_version", 1}, {"arch", "sm_90"}, {"entries", entries}};
    RuntimeOptions o;
    o.disk_cache = false;
    Runtime rt(o);
    rt.set_schedule_table(table.dump(), "tuner candidates");
    const std::string what =
        fmt::format("tuner sm_90 ratio={} coff={} head_dim={}", c.ratio, c.coff, c.head_dim);
    const PrewarmReport r = rt.compile_for_arch(c, "sm_90");
    EXPECT_EQ(local_memory_failure(what, r), "");
    EXPECT_EQ(r.ptxas_log.find("warning"), std::string::npos) << what << "\n" << r.ptxas_log;
  }
}

// The production long-window tail's candidates in the tail's split forms (the backward's
// row-stats form where fitting keeps it: not in the ring kernels of 64 registers a thread; the
// forward's row-kernel and cluster forms) compile with no local memory, tail_rows_forward and
// tail_row_stats with them.
TEST(NvrtcCompile, EverySplitTailTunerCandidateWithoutLocalMemory) {
  Config c{128, 512, 1};
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  nlohmann::json entries = nlohmann::json::array();
  for (const Direction d : {Direction::kForward, Direction::kBackward}) {
    nlohmann::json buckets = nlohmann::json::array();
    for (const auto& candidate : tools::tune_candidates(c, d)) {
      const nlohmann::json& b = candidate.bucket;
      if (!b.contains("tail_backward") && !b.contains("tail_forward")) continue;
      schedule::LongWindowSchedule s;
      s.vec = b["vec"];
      s.cols = b["cols"];
      s.threads = b["threads"];
      s.serial = b["serial"];
      s.fast_exp = b["fast_exp"];
      s.stages = b.value("stages", 1);
      s.atomic_ape = b.value("grad_ape", "fixed_order") == "atomic";
      s.row_stats = b.contains("tail_backward");
      if (b.contains("tail_forward"))
        s.tail_forward = b["tail_forward"] == "cluster"
                             ? schedule::LongWindowSchedule::TailForward::kCluster
                             : schedule::LongWindowSchedule::TailForward::kRowKernel;
      const auto fitted = schedule::fit_long_window(c, s, "sm_90", d);
      if (fitted.row_stats || fitted.row_kernel() || fitted.cluster()) buckets.push_back(b);
    }
    ASSERT_GE(buckets.size(), 10U);
    for (std::size_t i = 0; i < buckets.size(); ++i)
      buckets[i]["max_rows"] = i + 1 < buckets.size() ? nlohmann::json(i + 1) : nlohmann::json();
    entries.push_back(tools::make_entry(c, d, buckets));
  }
  const nlohmann::json table = {{"schema_version", 1}, {"arch", "sm_90"}, {"entries", entries}};
  RuntimeOptions o;
  o.disk_cache = false;
  Runtime rt(o);
  rt.set_schedule_table(table.dump(), "split-tail tuner candidates");
  const PrewarmReport r = rt.compile_for_arch(c, "sm_90");
  EXPECT_EQ(local_memory_failure("split-tail tuner candidates sm_90 128,1,512 norm+rope64", r), "");
  EXPECT_EQ(r.ptxas_log.find("warning"), std::string::npos) << r.ptxas_log;
  EXPECT_NE(r.ptxas_log.find("tail_rows_forward"), std::string::npos);
  EXPECT_NE(r.ptxas_log.find("tail_row_stats"), std::string::npos);
}

// The short-window module of `c` for `arch` (THD-packed unless named), as the library
// specifies it.
compressor::ModuleSpec short_window_module(const Config& c, const std::string& arch,
                                           int kernel_layout = csa_kernel::kLayoutThdPacked) {
  return compressor::make_module_spec(c, kernel_layout, Family::kShortWindow,
                                      schedule::select_short_window(c), arch,
                                      compressor::CompileOptions{});
}

// The local memory (spill traffic and stack) of kernel `name` in `report`; -1 where absent.
int kernel_local_bytes(const std::vector<nvrtc::KernelResources>& report, const std::string& name) {
  for (const auto& k : report)
    if (k.name == name) return k.spill_store_bytes + k.spill_load_bytes + k.stack_bytes;
  ADD_FAILURE() << name << " not in the report";
  return -1;
}

// Register fitting on a real module: at ptxas's own choice the sm_80 2,2,128 bf16 fixed-order
// backward takes 48 registers and spills; compiled again with the five CTAs per SM those
// allow named, it uses no local memory, and the module's other kernels keep their names.
TEST(NvrtcCompile, RegisterFittingPinsWhatPtxasSpilled) {
  const auto spec = short_window_module(Config{2, 128, 2}, "sm_80");
  ASSERT_FALSE(spec.residency.empty());
  nvrtc::Compiler compiler(compressor::kernel_headers());
  const nvrtc::CompileResult plain = compiler.compile(spec.request);
  const nvrtc::CompileResult fitted =
      compressor::compile_fitted(compiler, spec.request, spec.residency);
  auto local_bytes = [](const nvrtc::CompileResult& r) {
    int bytes = 0;
    for (const auto& k : nvrtc::parse_ptxas_report(r.log))
      bytes += k.spill_store_bytes + k.spill_load_bytes + k.stack_bytes;
    return bytes;
  };
  EXPECT_GT(local_bytes(plain), 0) << plain.log;
  EXPECT_EQ(local_bytes(fitted), 0) << fitted.log;
  ASSERT_EQ(fitted.lowered_names.size(), plain.lowered_names.size());
  const int slot = spec.slots.short_window.backward_fixed;
  ASSERT_GE(slot, 0);
  EXPECT_NE(fitted.lowered_names[slot], plain.lowered_names[slot]);
  EXPECT_NE(fitted.lowered_names[slot].find("ELi5ELi0EEEv"), std::string::npos)  // default form
      << fitted.lowered_names[slot];
  int unchanged = 0;
  for (std::size_t i = 0; i < plain.lowered_names.size(); ++i)
    unchanged += fitted.lowered_names[i] == plain.lowered_names[i] ? 1 : 0;
  EXPECT_GE(unchanged, 2);  // the forward and the reduction at least
}

// A kernel that still uses local memory at the residency its registers give climbs to fewer
// CTAs: sm_100 13,1,65 (atomic backward at ptxas's choice: 64 registers and a spilled 64-bit
// count; pinned at four CTAs it spills too, at three it needs none).
TEST(NvrtcCompile, RegisterFittingClimbsWhereThePinnedBudgetSpills) {
  const auto spec = short_window_module(Config{13, 65, 1}, "sm_100");
  ASSERT_FALSE(spec.residency.empty());
  nvrtc::Compiler compiler(compressor::kernel_headers());
  const nvrtc::CompileResult fitted =
      compressor::compile_fitted(compiler, spec.request, spec.residency);
  for (const auto& k : nvrtc::parse_ptxas_report(fitted.log))
    EXPECT_EQ(k.spill_store_bytes + k.spill_load_bytes + k.stack_bytes, 0) << k.name;
  const int slot = spec.slots.short_window.backward_atomic;
  ASSERT_GE(slot, 0);
  EXPECT_NE(fitted.lowered_names[slot].find("ELi3ELi0EEEv"), std::string::npos)  // default form
      << fitted.lowered_names[slot];
}

// A kernel at a named residency that still uses local memory takes another form where that
// uses less: the sm_90 fp16 THD tail with a bf16 weight, half-split pairs and the Hadamard
// transform (4,2,128), whose resident backwards (windows of 8 slots at three CTAs) keep values
// across their rows in local memory in the default form; the fixed-order one needs none in the
// zeros-first form, the atomic one in the lean form. The module's other kernels keep theirs.
TEST(NvrtcCompile, RegisterFittingTakesAnotherFormWhereItUsesLess) {
  Config c{4, 128, 2};
  c.dtype = DType::kF16;
  c.tail.norm = true;
  c.tail.norm_weight_dtype = DType::kBf16;
  c.tail.rope_dim = 64;
  c.tail.rope_interleaved = false;
  c.tail.hadamard = true;
  const auto spec = short_window_module(c, "sm_90");
  nvrtc::Compiler compiler(compressor::kernel_headers());
  const nvrtc::CompileResult plain = compiler.compile(spec.request);
  const auto plain_report = nvrtc::parse_ptxas_report(plain.log);
  const auto fitted = compressor::compile_fitted(compiler, spec.request, spec.residency);
  const auto fitted_report = nvrtc::parse_ptxas_report(fitted.log);
  const auto fixed = static_cast<std::size_t>(spec.slots.short_window.backward_fixed_resident);
  const auto atomic = static_cast<std::size_t>(spec.slots.short_window.backward_atomic_resident);
  ASSERT_LT(fixed, plain.lowered_names.size());
  ASSERT_LT(atomic, plain.lowered_names.size());
  ASSERT_EQ(fitted.lowered_names.size(), plain.lowered_names.size());
  // At three CTAs an SM, in the zeros-first and the lean form.
  const auto ending = [](int form) { return "ELi3ELi" + std::to_string(form) + "EEEv"; };
  const std::pair<std::size_t, std::string> moved[] = {
      {fixed, ending(csa_kernel::kBackwardFormZerosFirst)},
      {atomic, ending(csa_kernel::kBackwardFormLean)}};
  for (const auto& [slot, name_end] : moved) {
    EXPECT_GT(kernel_local_bytes(plain_report, plain.lowered_names[slot]), 0) << plain.log;
    EXPECT_NE(fitted.lowered_names[slot].find(name_end), std::string::npos)
        << fitted.lowered_names[slot];
  }
  for (std::size_t i = 0; i < fitted.lowered_names.size(); ++i) {
    EXPECT_EQ(kernel_local_bytes(fitted_report, fitted.lowered_names[i]), 0)
        << fitted.lowered_names[i];
    if (i != fixed && i != atomic) {
      EXPECT_EQ(fitted.lowered_names[i], plain.lowered_names[i]);
    }
  }
}

// A residency the schedule named gives way last, where it still uses local memory in every
// form: the sm_80 fp16 SBHD tail at head_dim 512 (norm + RoPE 64), whose resident backwards
// (three CTAs of 256 threads, 80 registers) spill in each form, takes them at two CTAs in the
// default form with none; its fp16 wide forward keeps its three CTAs (it needs none there).
TEST(NvrtcCompile, RegisterFittingGivesANamedResidencyWayLast) {
  Config c{4, 512, 2};
  c.dtype = DType::kF16;
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  const auto spec = short_window_module(c, "sm_80", csa_kernel::kLayoutSbhd);
  nvrtc::Compiler compiler(compressor::kernel_headers());
  const nvrtc::CompileResult plain = compiler.compile(spec.request);
  const auto plain_report = nvrtc::parse_ptxas_report(plain.log);
  const auto fitted = compressor::compile_fitted(compiler, spec.request, spec.residency);
  const auto fitted_report = nvrtc::parse_ptxas_report(fitted.log);
  const auto& slots = spec.slots.short_window;
  ASSERT_EQ(fitted.lowered_names.size(), plain.lowered_names.size());
  int gave_way = 0;
  for (const int slot : {slots.backward_fixed_resident, slots.backward_atomic_resident}) {
    if (slot < 0) continue;
    const auto i = static_cast<std::size_t>(slot);
    ASSERT_LT(i, plain.lowered_names.size());
    if (kernel_local_bytes(plain_report, plain.lowered_names[i]) == 0) continue;
    EXPECT_NE(fitted.lowered_names[i].find("ELi2ELi0EEEv"), std::string::npos)
        << fitted.lowered_names[i];
    ++gave_way;
  }
  EXPECT_GE(gave_way, 1) << plain.log;
  ASSERT_GE(slots.forward_wide, 0);
  const auto wide = static_cast<std::size_t>(slots.forward_wide);
  EXPECT_EQ(fitted.lowered_names[wide], plain.lowered_names[wide]);
  for (const auto& name : fitted.lowered_names)
    EXPECT_EQ(kernel_local_bytes(fitted_report, name), 0) << name;
}

TEST(NvrtcCompile, ReferenceFamilyCompiles) {
  RuntimeOptions o;
  o.disk_cache = false;
  Runtime rt(o);
  const auto r = rt.compile_for_arch({16, 65, 2}, "sm_90", Family::kReference);
  EXPECT_EQ(r.kernels, 4);
}

TEST(NvrtcCompile, FailureCarriesLogAndOptions) {
  nvrtc::Compiler compiler(compressor::kernel_headers());
  nvrtc::CompileRequest r;
  r.source = "#include \"csa_common.cuh\"\n__global__ void broken() { undefined_symbol(); }\n";
  r.source_name = "broken.cu";
  r.name_expressions = {"broken"};
  r.options = {"-std=c++17", "--fmad=false"};
  r.arch = "sm_90";
  try {
    compiler.compile(r);
    FAIL() << "compiled";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kCompileError);
    const std::string what = e.what();
    EXPECT_NE(what.find("undefined_symbol"), std::string::npos) << what;
    EXPECT_NE(what.find("--fmad=false"), std::string::npos) << what;
    EXPECT_NE(what.find("sm_90"), std::string::npos) << what;
  }
}

TEST(NvrtcCompile, ArchIsChecked) {
  RuntimeOptions o;
  o.disk_cache = false;
  Runtime rt(o);
  EXPECT_THROW(rt.compile_for_arch({4, 128, 2}, "sm90"), Error);
  try {
    rt.compile_for_arch({4, 128, 2}, "sm_70");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kUnsupported);
  }
  EXPECT_THROW(rt.compile_for_arch({4, 128, 2}, "sm_999"), Error);
}

TEST(PtxasReport, Parses) {
  const auto r = nvrtc::parse_ptxas_report(
      "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
      "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
      "ptxas info    : Used 40 registers, used 0 barriers\n");
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].name, "_Z1kv");
  EXPECT_EQ(r[0].registers, 40);
  EXPECT_EQ(r[0].stack_bytes, 8);
  EXPECT_EQ(r[0].spill_store_bytes, 4);
  EXPECT_EQ(r[0].spill_load_bytes, 12);
}

// A device function's properties after an entry's (the module's slow-path division, say) add
// to that entry's: its zeros never replace the entry's spills.
TEST(PtxasReport, CalleePropertiesAddToTheEntrys) {
  const auto r = nvrtc::parse_ptxas_report(
      "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z1kv\n"
      "ptxas         .     8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
      "ptxas info    : Used 80 registers, used 0 barriers, 8 bytes cumulative stack size\n"
      "ptxas info    : Function properties for _Z4slowff\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Compiling entry function '_Z1jv' for 'sm_90'\n"
      "ptxas info    : Function properties for _Z1jv\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 32 registers, used 0 barriers, 16 bytes cumulative stack size\n");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].name, "_Z1kv");
  EXPECT_EQ(r[0].registers, 80);
  EXPECT_EQ(r[0].stack_bytes, 8);
  EXPECT_EQ(r[0].spill_store_bytes, 8);
  EXPECT_EQ(r[0].spill_load_bytes, 4);
  EXPECT_EQ(r[1].name, "_Z1jv");
  EXPECT_EQ(r[1].stack_bytes, 16);  // a callee's frame, in the cumulative size
  EXPECT_EQ(r[1].spill_store_bytes, 0);
}

}  // namespace
}  // namespace csa::test
