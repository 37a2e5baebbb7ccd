#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "commands.hpp"

namespace csa::tools {

namespace {

struct PrewarmOptions {
  std::vector<std::string> configs;
  std::vector<std::string> archs;
  int device = 0;
  unsigned jobs = 0;
  bool fail_on_spill = false;
  bool json = false;
  DType dtype = DType::kBf16;
  Layout layout = Layout::kThd;
  bool strided = false;
  TailShape tail;
};

struct Job {
  Config config;
  std::string arch;  // empty: the device's
};

std::string job_name(const Job& j) {
  return j.arch.empty() ? format_config(j.config) : format_config(j.config) + " " + j.arch;
}

// Progress on stderr (stdout keeps the table or the JSON): on a terminal one line showing what
// is compiling and for how long, redrawn twice a second; elsewhere a line per finished job.
class Progress {
 public:
  Progress(std::size_t total) : total_(total), terminal_(::isatty(STDERR_FILENO) != 0) {
    if (terminal_) ticker_ = std::thread([this] { tick(); });
  }
  ~Progress() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (ticker_.joinable()) ticker_.join();
    if (terminal_) fmt::print(stderr, "\r\x1b[K");
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void start(std::size_t i, const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    running_.emplace_back(i, name);
  }
  void finish(std::size_t i, const std::string& name, const std::string& outcome) {
    std::lock_guard<std::mutex> lock(mutex_);
    running_.erase(std::remove_if(running_.begin(), running_.end(),
                                  [&](const auto& r) { return r.first == i; }),
                   running_.end());
    ++done_;
    if (!terminal_) fmt::print(stderr, "[{}/{}] {}: {}\n", done_, total_, name, outcome);
  }

 private:
  void tick() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      std::string names;
      for (const auto& r : running_) names += (names.empty() ? "" : ", ") + r.second;
      fmt::print(stderr, "\r\x1b[K[{}/{}] {:.1f} s, compiling or loading: {}", done_, total_, s,
                 names);
      std::fflush(stderr);
      wake_.wait_for(lock, std::chrono::milliseconds(500));
    }
  }

  std::size_t total_;
  bool terminal_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::size_t done_ = 0;
  std::vector<std::pair<std::size_t, std::string>> running_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::thread ticker_;
};

void run_prewarm(Runtime& runtime, const PrewarmOptions& o) {
  std::vector<Config> configs;
  for (const auto& text : o.configs) configs.push_back(parse_config(text));
  if (configs.empty()) configs = default_configs();
  for (auto& c : configs) {
    c.dtype = o.dtype;
    c.layout = o.layout;
    c.strided = o.strided;
    c.tail = o.tail;
  }
  std::vector<Job> jobs;
  if (o.archs.empty()) {
    const DriverInfo d = runtime.driver_info();
    if (!d.available || static_cast<int>(d.devices.size()) <= o.device) {
      throw CLI::ValidationError(
          "--arch", fmt::format("no GPU {} here ({}); compile without one for an arch: csa "
                                "prewarm --arch sm_90",
                                o.device, d.available ? "no such device" : d.reason));
    }
    for (const auto& c : configs) jobs.push_back({c, ""});
  } else {
    for (const auto& arch : o.archs) {
      const std::string a = resolve_arch(runtime, arch, "--arch");
      for (const auto& c : configs) jobs.push_back({c, a});
    }
  }
  const unsigned threads =
      std::max(1u, std::min<unsigned>(o.jobs ? o.jobs : std::thread::hardware_concurrency(),
                                      static_cast<unsigned>(jobs.size())));
  std::vector<PrewarmReport> reports(jobs.size());
  std::vector<std::string> errors(jobs.size());
  {
    Progress progress(jobs.size());
    std::atomic<std::size_t> next{0};
    auto worker = [&] {
      for (std::size_t i = next++; i < jobs.size(); i = next++) {
        const std::string name = job_name(jobs[i]);
        progress.start(i, name);
        try {
          reports[i] = jobs[i].arch.empty()
                           ? runtime.prewarm(jobs[i].config, o.device)
                           : runtime.compile_for_arch(jobs[i].config, jobs[i].arch);
        } catch (const std::exception& e) {  // nothing may escape a worker thread
          errors[i] = e.what();
        }
        progress.finish(i, name,
                        errors[i].empty() ? fmt::format("{} in {:.2f} s",
                                                        reports[i].compiled ? "compiled" : "loaded",
                                                        reports[i].seconds)
                                          : "FAILED");
      }
    };
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) pool.emplace_back(worker);
    for (auto& t : pool) t.join();
  }
  int failures = 0;
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const bool spilled = errors[i].empty() && o.fail_on_spill &&
                         (reports[i].spill_bytes != 0 || reports[i].stack_bytes != 0);
    if (!errors[i].empty() || spilled) ++failures;
    nlohmann::json j = errors[i].empty() ? to_json(reports[i]) : nlohmann::json::object();
    if (!errors[i].empty()) {
      j["config"] = to_json(jobs[i].config);
      j["error"] = errors[i];
    }
    if (spilled) j["error"] = "uses local memory";
    out.push_back(j);
  }
  if (o.json) {
    print_json({{"reports", out}, {"cache", nlohmann::json::parse(runtime.info_json())["cache"]}});
  } else {
    fmt::print("{:<40} {:<8} {:<9} {:>8} {:>5} {:>6} {:>6}  {}\n", "config", "arch", "source",
               "seconds", "regs", "spill", "stack", "served from");
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      if (!errors[i].empty()) {
        fmt::print("{:<40} FAILED: {}\n", format_config(jobs[i].config), errors[i]);
        continue;
      }
      const auto& r = reports[i];
      fmt::print("{:<40} {:<8} {:<9} {:>8.3f} {:>5} {:>6} {:>6}  {}\n", format_config(r.config),
                 r.arch, r.compiled ? "compiled" : "cache", r.seconds, r.max_registers,
                 r.spill_bytes, r.stack_bytes, r.source);
      if (o.fail_on_spill && (r.spill_bytes != 0 || r.stack_bytes != 0))
        fmt::print("{:<40} uses local memory (spill {} B, stack {} B)\n", format_config(r.config),
                   r.spill_bytes, r.stack_bytes);
    }
    const CacheInfo c = runtime.cache_info();
    fmt::print("cache: {} ({})\n", c.directory.empty() ? "(none)" : c.directory,
               c.persistent ? "on disk" : "memory only");
  }
  if (failures > 0)
    throw Error(Status::kCompileError, fmt::format("{} configuration(s) failed", failures));
}

}  // namespace

void add_prewarm_command(CLI::App& app, Runtime*& runtime) {
  auto opts = std::make_shared<PrewarmOptions>();
  auto* cmd = app.add_subcommand(
      "prewarm",
      "compile (or load from the cache) every kernel of the given configurations; default: the "
      "production set");
  cmd->add_option("--config,-c", opts->configs,
                  "a configuration, ratio=R,coff=C,head_dim=D (or R,C,D), repeatable (default: "
                  "ratio=4,coff=2,head_dim=512 ratio=4,coff=2,head_dim=128 "
                  "ratio=2,coff=2,head_dim=512 ratio=2,coff=2,head_dim=128)");
  cmd->add_option("--arch", opts->archs,
                  "compile for this arch without a GPU (e.g. sm_90), repeatable (default: the "
                  "device's)");
  cmd->add_option("--device", opts->device, "device ordinal, without --arch")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--jobs,-j", opts->jobs, "parallel compiles (default: one per core)");
  add_io_options(cmd, opts->dtype, opts->layout);
  add_tail_options(cmd, opts->tail);
  cmd->add_flag("--strided", opts->strided,
                "also the kernels of THD calls with row strides (SBHD kernels always take them)");
  cmd->add_flag("--fail-on-spill", opts->fail_on_spill,
                "exit 1 if a kernel uses local memory (spills or a stack frame)");
  cmd->add_flag("--json", opts->json, "print one JSON object instead of the table");
  cmd->callback([opts, &runtime] { run_prewarm(*runtime, *opts); });
}

}  // namespace csa::tools
