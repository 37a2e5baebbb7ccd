#include <fmt/format.h>

#include "commands.hpp"

namespace csa::tools {

void add_info_command(CLI::App& app, Runtime*& runtime) {
  auto* cmd = app.add_subcommand("info", "NVRTC version, driver and devices, kernel cache");
  cmd->callback([&runtime] {
    std::string archs;
    for (const auto& a : supported_archs()) archs += (archs.empty() ? "" : " ") + a;
    fmt::print("csa {}\n", version());
    fmt::print("NVRTC {} (targets: {})\n", nvrtc_version(), archs);
    const DriverInfo d = runtime->driver_info();
    if (!d.available) {
      fmt::print("driver: none ({})\n", d.reason);
    } else {
      fmt::print("driver: CUDA {}.{}, {} device(s)\n", d.driver_version / 1000,
                 (d.driver_version % 1000) / 10, d.devices.size());
      for (const auto& dev : d.devices) {
        fmt::print("  [{}] {} sm_{}{} {} SMs, L2 {:.0f} MB, {:.1f} GiB\n", dev.ordinal, dev.name,
                   dev.cc_major, dev.cc_minor, dev.sm_count,
                   static_cast<double>(dev.l2_bytes) / 1e6,
                   static_cast<double>(dev.memory_bytes) / double(1 << 30));
      }
    }
    const CacheInfo c = runtime->cache_info();
    fmt::print(
        "cache: {} ({}), {} entries, {:.1f} MB\n", c.directory.empty() ? "(none)" : c.directory,
        c.persistent ? "on disk" : "memory only", c.entries, static_cast<double>(c.bytes) / 1e6);
  });
}

}  // namespace csa::tools
