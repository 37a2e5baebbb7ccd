#include <map>

#include "cli_common.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

namespace csa::tools {

void add_config_options(CLI::App* cmd, Config& config) {
  cmd->add_option("--ratio", config.ratio, "tokens pooled per row")
      ->required()
      ->check(CLI::Range(1, 256));
  cmd->add_option("--coff", config.coff, "1: own-block window; 2: overlapping window")
      ->required()
      ->check(CLI::Range(1, 2));
  cmd->add_option("--head-dim", config.head_dim, "columns of an output row")
      ->required()
      ->check(CLI::Range(1, 4096));
}

void add_io_options(CLI::App* cmd, DType& dtype, Layout& layout) {
  const std::map<std::string, DType> dtypes = {
      {"bf16", DType::kBf16}, {"fp16", DType::kF16}, {"fp32", DType::kF32}};
  const std::map<std::string, Layout> layouts = {{"thd", Layout::kThd}, {"sbhd", Layout::kSbhd}};
  cmd->add_option("--dtype", dtype,
                  "element type of kv, score, out and their gradients: bf16, fp16 or fp32 "
                  "(default: bf16)")
      ->transform(CLI::CheckedTransformer(dtypes));
  cmd->add_option("--layout", layout,
                  "thd (packed sequences with offsets) or sbhd ((S, B, width), every batch column "
                  "one sequence) (default: thd)")
      ->transform(CLI::CheckedTransformer(layouts));
}

void add_tail_options(CLI::App* cmd, TailShape& tail) {
  cmd->add_flag("--norm", tail.norm, "fuse the RMSNorm over head_dim (a learned weight)");
  const std::map<std::string, DType> weights = {{"bf16", DType::kBf16}, {"fp32", DType::kF32}};
  cmd->add_option("--norm-weight", tail.norm_weight_dtype,
                  "the norm weight's type: fp32 or bf16 (default: fp32)")
      ->transform(CLI::CheckedTransformer(weights));
  cmd->add_option("--rope-dim", tail.rope_dim,
                  "fuse RoPE on the last N columns (even, <= head_dim; default: 0, none)")
      ->check(CLI::Range(0, 4096));
  cmd->add_flag("!--rope-half-split", tail.rope_interleaved,
                "RoPE pairs (i, i + N/2) instead of the interleaved (2i, 2i+1)");
  cmd->add_flag("--hadamard", tail.hadamard,
                "fuse the Hadamard transform of size head_dim (a power of two), scaled by "
                "head_dim^-1/2");
}

void add_direction_option(CLI::App* cmd, std::vector<std::string>& directions,
                          const std::vector<std::string>& allowed) {
  std::string all;
  for (const auto& d : allowed) all += (all.empty() ? "" : ", ") + d;
  cmd->add_option("--direction", directions,
                  fmt::format("only these directions, repeatable: {} (default: all)", all))
      ->check(CLI::IsMember(allowed));
}

bool wants(const std::vector<std::string>& directions, const std::string& d) {
  return directions.empty() ||
         std::find(directions.begin(), directions.end(), d) != directions.end();
}

std::string resolve_arch(Runtime& runtime, const std::string& arch, const std::string& option) {
  if (!arch.empty()) {
    const auto archs = supported_archs();
    const std::string base =
        arch.back() == 'a' || arch.back() == 'f' ? arch.substr(0, arch.size() - 1) : arch;
    const auto number = [](const std::string& a) {
      int cc = 0;
      const char* end = a.data() + a.size();
      const auto [ptr, ec] =
          std::from_chars(a.data() + std::min<std::size_t>(3, a.size()), end, cc);
      return a.rfind("sm_", 0) == 0 && ec == std::errc() && ptr == end ? cc : -1;
    };
    if (std::find(archs.begin(), archs.end(), base) == archs.end() || number(base) < 80) {
      std::string list;
      for (const auto& a : archs)
        if (number(a) >= 80) list += (list.empty() ? "" : ", ") + a;
      throw CLI::ValidationError(
          option,
          fmt::format("'{}' is not an arch this NVRTC compiles for csa (one of: {})", arch, list));
    }
    return arch;
  }
  const DriverInfo info = runtime.driver_info();
  if (info.available && !info.devices.empty())
    return fmt::format("sm_{}{}", info.devices[0].cc_major, info.devices[0].cc_minor);
  throw CLI::ValidationError(option,
                             fmt::format("no GPU here ({}); name the arch to use, e.g. {} sm_90",
                                         info.available ? "no device" : info.reason, option));
}

void print_json(const nlohmann::json& j) {
  fmt::print("{}\n", j.dump(2));
}

nlohmann::json to_json(const Config& c) {
  return {{"ratio", c.ratio},
          {"coff", c.coff},
          {"head_dim", c.head_dim},
          {"dtype", dtype_name(c.dtype)},
          {"layout", layout_name(c.layout)},
          {"tail", tail_name(c.tail)}};
}

nlohmann::json to_json(const PrewarmReport& r) {
  return {{"config", to_json(r.config)},
          {"arch", r.arch},
          {"key", r.key},
          {"compiled", r.compiled},
          {"source", r.source},
          {"seconds", r.seconds},
          {"kernels", r.kernels},
          {"max_registers", r.max_registers},
          {"spill_bytes", r.spill_bytes},
          {"stack_bytes", r.stack_bytes}};
}

}  // namespace csa::tools
