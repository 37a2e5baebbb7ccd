// The csa command-line tool: one function per subcommand, over the public C++ API only.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "csa/csa.hpp"
#include "cli_common.hpp"
#include "parse.hpp"

namespace csa::tools {

void add_info_command(CLI::App& app, Runtime*& runtime);
void add_prewarm_command(CLI::App& app, Runtime*& runtime);
void add_cache_command(CLI::App& app, Runtime*& runtime);
void add_bench_command(CLI::App& app, Runtime*& runtime);
void add_schedule_command(CLI::App& app, Runtime*& runtime);
void add_tune_command(CLI::App& app, Runtime*& runtime);

}  // namespace csa::tools
