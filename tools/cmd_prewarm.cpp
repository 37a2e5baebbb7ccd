#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include "commands.hpp"

namespace csa::tools {

namespace {

struct PrewarmOptions {
  std::vector<std::string> configs;
  std::string arch;
  int device = 0;
  unsigned jobs = 0;
  bool fail_on_spill = false;
};

void run_prewarm(Runtime& runtime, const PrewarmOptions& o) {
  std::vector<Config> configs;
  for (const auto& text : o.configs) configs.push_back(parse_config(text));
  if (configs.empty()) configs = default_configs();
  const unsigned jobs =
      std::max(1u, std::min<unsigned>(o.jobs ? o.jobs : std::thread::hardware_concurrency(),
                                      static_cast<unsigned>(configs.size())));
  const bool terminal = ::isatty(STDOUT_FILENO) != 0;
  std::vector<PrewarmReport> reports(configs.size());
  std::vector<std::string> errors(configs.size());
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> done{0};
  std::mutex print_mutex;
  auto worker = [&] {
    for (std::size_t i = next++; i < configs.size(); i = next++) {
      try {
        reports[i] = o.arch.empty() ? runtime.prewarm(configs[i], o.device)
                                    : runtime.compile_for_arch(configs[i], o.arch);
      } catch (const std::exception& e) {  // nothing may escape a worker thread
        errors[i] = e.what();
      }
      const std::size_t n = ++done;
      if (terminal) {
        std::lock_guard<std::mutex> lock(print_mutex);
        fmt::print("\r[{}/{}] {}\x1b[K", n, configs.size(), format_config(configs[i]));
        std::fflush(stdout);
      }
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < jobs; ++t) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  if (terminal) fmt::print("\r\x1b[K");
  int failures = 0;
  fmt::print("{:<14} {:<8} {:<9} {:>8} {:>5} {:>6} {:>6}\n", "config", "arch", "source", "seconds",
             "regs", "spill", "stack");
  for (std::size_t i = 0; i < configs.size(); ++i) {
    if (!errors[i].empty()) {
      ++failures;
      fmt::print("{:<14} FAILED: {}\n", format_config(configs[i]), errors[i]);
      continue;
    }
    const auto& r = reports[i];
    fmt::print("{:<14} {:<8} {:<9} {:>8.3f} {:>5} {:>6} {:>6}\n", format_config(configs[i]), r.arch,
               r.compiled ? "compiled" : "cache", r.seconds, r.max_registers, r.spill_bytes,
               r.stack_bytes);
    if (o.fail_on_spill && (r.spill_bytes != 0 || r.stack_bytes != 0)) {
      ++failures;
      fmt::print("{:<14} uses local memory (spill {} B, stack {} B)\n", format_config(configs[i]),
                 r.spill_bytes, r.stack_bytes);
    }
  }
  const CacheInfo c = runtime.cache_info();
  fmt::print("cache: {} ({})\n", c.directory.empty() ? "(none)" : c.directory,
             c.persistent ? "on disk" : "memory only");
  if (failures > 0)
    throw Error(Status::kCompileError, fmt::format("{} configuration(s) failed", failures));
}

}  // namespace

void add_prewarm_command(CLI::App& app, Runtime*& runtime) {
  auto opts = std::make_shared<PrewarmOptions>();
  auto* cmd = app.add_subcommand(
      "prewarm",
      "compile (or load from the cache) every kernel of the given configurations; "
      "default: the production set 4,2,512 4,2,128 2,2,512 2,2,128");
  cmd->add_option("--config,-c", opts->configs, "RATIO,COFF,HEAD_DIM (repeatable)");
  cmd->add_option("--arch", opts->arch, "compile for this arch (e.g. sm_90) without a GPU");
  cmd->add_option("--device", opts->device, "device ordinal (without --arch)");
  cmd->add_option("--jobs,-j", opts->jobs, "parallel compiles (default: all cores)");
  cmd->add_flag("--fail-on-spill", opts->fail_on_spill,
                "exit non-zero if a kernel uses local memory");
  cmd->callback([opts, &runtime] { run_prewarm(*runtime, *opts); });
}

}  // namespace csa::tools
