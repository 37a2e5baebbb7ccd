// What every csa subcommand shares: the configuration options (one form everywhere), the one
// vocabulary of directions, arch resolution, and JSON on stdout.
#pragma once

#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "csa/csa.hpp"

namespace csa::tools {

// --ratio, --coff, --head-dim, each required and range-checked.
void add_config_options(CLI::App* cmd, Config& config);

// --dtype bf16|fp16|fp32 and --layout thd|sbhd (default: bf16, thd).
void add_io_options(CLI::App* cmd, DType& dtype, Layout& layout);

// --norm, --norm-weight fp32|bf16, --rope-dim N, --rope-half-split, --hadamard: the fused
// tail (config.tail; default: none).
void add_tail_options(CLI::App* cmd, TailShape& tail);

// The directions: "fwd", "bwd" and, where offered, "bwd-det" (the deterministic backward).
inline const std::vector<std::string> kDirections = {"fwd", "bwd"};
inline const std::vector<std::string> kBenchDirections = {"fwd", "bwd", "bwd-det"};
// --direction (repeatable; default: all of `allowed`).
void add_direction_option(CLI::App* cmd, std::vector<std::string>& directions,
                          const std::vector<std::string>& allowed);
bool wants(const std::vector<std::string>& directions, const std::string& d);

// `arch` checked (CLI::ValidationError naming `option`), or device 0's when empty; when there
// is no GPU either, CLI::ValidationError saying to pass `option`.
std::string resolve_arch(Runtime& runtime, const std::string& arch, const std::string& option);

void print_json(const nlohmann::json& j);

nlohmann::json to_json(const PrewarmReport& r);
nlohmann::json to_json(const Config& c);

}  // namespace csa::tools
