#include <fmt/format.h>

#include "commands.hpp"

namespace csa::tools {

namespace {

void print_cache(const CacheInfo& c) {
  fmt::print("cache: {} ({}), {} entries, {:.1f} MB, bound {:.1f} GB\n",
             c.directory.empty() ? "(none)" : c.directory, c.persistent ? "on disk" : "memory only",
             c.entries, static_cast<double>(c.bytes) / 1e6, static_cast<double>(c.max_bytes) / 1e9);
  for (const auto& l : c.layers) {
    fmt::print("  {} {}: {}, {} entries, {:.1f} MB\n",
               l.read_only_layer ? "read-only layer" : "cache directory", l.directory, l.state,
               l.entries, static_cast<double>(l.bytes) / 1e6);
  }
}

}  // namespace

void add_info_command(CLI::App& app, Runtime*& runtime) {
  auto* cmd =
      app.add_subcommand("info", "NVRTC, driver and devices, and the kernel cache's layers");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "print one JSON object instead of text");
  cmd->callback([&runtime, json] {
    const nlohmann::json j = nlohmann::json::parse(runtime->info_json());
    if (*json) {
      print_json(j);
      return;
    }
    fmt::print("csa {}\n", version());
    fmt::print("NVRTC {} (targets: {})\n", nvrtc_version(), fmt::join(supported_archs(), " "));
    if (!j["driver"]["available"].get<bool>()) {
      fmt::print("driver: none ({})\n", j["driver"]["reason"].get<std::string>());
    } else {
      const int v = j["driver"]["version"].get<int>();
      fmt::print("driver: CUDA {}.{}, {} device(s)\n", v / 1000, (v % 1000) / 10,
                 j["devices"].size());
      for (const auto& dev : j["devices"]) {
        fmt::print("  [{}] {} {} {} SMs, L2 {:.0f} MB, {:.1f} GiB\n", dev["ordinal"].get<int>(),
                   dev["name"].get<std::string>(), dev["arch"].get<std::string>(),
                   dev["sm_count"].get<int>(), dev["l2_bytes"].get<double>() / 1e6,
                   dev["memory_bytes"].get<double>() / double(1 << 30));
      }
    }
    print_cache(runtime->cache_info());
  });
}

void add_cache_command(CLI::App& app, Runtime*& runtime) {
  auto* cmd = app.add_subcommand("cache", "inspect or clear the kernel cache");
  cmd->require_subcommand(1);
  auto json = std::make_shared<bool>(false);
  auto* info =
      cmd->add_subcommand("info", "the cache's layers, entries and sizes (creates nothing)");
  info->add_flag("--json", *json, "print one JSON object instead of text");
  info->callback([&runtime, json] {
    if (*json) {
      print_json(nlohmann::json::parse(runtime->info_json())["cache"]);
    } else {
      print_cache(runtime->cache_info());
    }
  });
  cmd->add_subcommand("clear",
                      "remove csa's entries (and stale temp files) from the cache directory; "
                      "other files and the read-only layers are kept")
      ->callback([&runtime] {
        const auto removed = runtime->clear_disk_cache();
        fmt::print("removed {} entries from {}\n", removed, runtime->cache_info().directory);
      });
}

}  // namespace csa::tools
