#include "bench_data.hpp"

#include <CLI/CLI.hpp>

#include <random>
#include <sstream>

#include "csa/reference.hpp"

namespace csa::tools {

Pack parse_pack(const std::string& text) {
  Pack p;
  p.label = text;
  const auto x = text.find('x');
  try {
    if (x != std::string::npos) {
      const int count = std::stoi(text.substr(0, x));
      const int len = std::stoi(text.substr(x + 1));
      p.seqlens.assign(static_cast<std::size_t>(count), len);
    } else {
      std::istringstream in(text);
      std::string item;
      while (std::getline(in, item, '+')) p.seqlens.push_back(std::stoi(item));
    }
  } catch (const std::exception&) {
    throw CLI::ValidationError("pack", "'" + text + "' is not NxLEN or LEN+LEN+...");
  }
  if (p.seqlens.empty()) throw CLI::ValidationError("pack", "'" + text + "' has no segments");
  return p;
}

HostInputs make_inputs(const Config& c, const Pack& pack, std::uint64_t seed) {
  HostInputs in;
  in.config = c;
  in.cu = {0};
  in.cuc = {0};
  for (int len : pack.seqlens) {
    in.cu.push_back(in.cu.back() + len);
    in.cuc.push_back(in.cuc.back() + len / c.ratio);
  }
  in.total_tokens = in.cu.back();
  in.total_comp = in.cuc.back();
  const std::int64_t width = static_cast<std::int64_t>(c.coff) * c.head_dim;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](std::vector<std::uint16_t>& v, std::int64_t n, float scale) {
    v.resize(static_cast<std::size_t>(n));
    for (auto& x : v) x = reference::float_to_bf16(scale * normal(rng));
  };
  fill(in.kv, in.total_tokens * width, 1.0f);
  fill(in.score, in.total_tokens * width, 1.5f);
  in.ape.resize(static_cast<std::size_t>(c.ratio * width));
  for (auto& x : in.ape) x = 0.25f * normal(rng);
  fill(in.grad_out, in.total_comp * c.head_dim, 1.0f);
  return in;
}

std::int64_t forward_bytes(const HostInputs& in) {
  const std::int64_t width = static_cast<std::int64_t>(in.config.coff) * in.config.head_dim;
  return 2 * (2 * in.total_tokens * width + in.total_comp * in.config.head_dim);
}

std::int64_t backward_bytes(const HostInputs& in) {
  const std::int64_t width = static_cast<std::int64_t>(in.config.coff) * in.config.head_dim;
  return 2 * (4 * in.total_tokens * width + in.total_comp * in.config.head_dim);
}

}  // namespace csa::tools
