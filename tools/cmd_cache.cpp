#include <fmt/format.h>

#include "commands.hpp"

namespace csa::tools {

void add_cache_command(CLI::App& app, Runtime*& runtime) {
  auto* cmd = app.add_subcommand("cache", "inspect or clear the kernel cache");
  cmd->require_subcommand(1);
  cmd->add_subcommand("info", "location, entries and size")->callback([&runtime] {
    const CacheInfo c = runtime->cache_info();
    fmt::print("directory: {}\nstorage:   {}\nentries:   {}\nbytes:     {}\n",
               c.directory.empty() ? "(none)" : c.directory,
               c.persistent ? "on disk" : "memory only", c.entries, c.bytes);
  });
  cmd->add_subcommand("clear", "remove every cache entry")->callback([&runtime] {
    const auto removed = runtime->clear_disk_cache();
    fmt::print("removed {} entries from {}\n", removed, runtime->cache_info().directory);
  });
}

}  // namespace csa::tools
