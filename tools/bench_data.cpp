#include "bench_data.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "csa/reference.hpp"
#include "layout_data.hpp"
#include "parse.hpp"

namespace csa::tools {

Pack parse_pack(const std::string& text) {
  Pack p;
  p.label = text;
  constexpr std::int64_t kMaxTokens = (std::int64_t{1} << 31) - 1;
  constexpr std::int64_t kMaxSegments = 1 << 20;
  const auto x = text.find('x');
  if (x != std::string::npos) {
    const auto count = parse_int(text.substr(0, x), 1, kMaxSegments, "--shape pack count");
    const auto len = parse_int(text.substr(x + 1), 0, kMaxTokens, "--shape pack length");
    if (count * len > kMaxTokens)
      throw CLI::ValidationError("--shape", "pack '" + text + "' holds more than 2^31 - 1 tokens");
    p.seqlens.assign(static_cast<std::size_t>(count), static_cast<std::int32_t>(len));
    return p;
  }
  std::int64_t total = 0;
  for (const auto& item : split(text, '+')) {
    const auto len = parse_int(item, 0, kMaxTokens, "--shape pack length");
    total += len;
    if (total > kMaxTokens || p.seqlens.size() >= kMaxSegments)
      throw CLI::ValidationError("--shape", "pack '" + text + "' holds more than 2^31 - 1 tokens");
    p.seqlens.push_back(static_cast<std::int32_t>(len));
  }
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

TailInputs make_tail_inputs(const Config& c, const HostInputs& in, std::uint64_t seed) {
  TailInputs t;
  const TailShape& shape = c.tail;
  if (shape.norm) {
    std::mt19937_64 rng(seed ^ 0x7a11u);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    const bool bf16 = shape.norm_weight_dtype == DType::kBf16;
    for (int j = 0; j < c.head_dim; ++j) {
      float w = 1.0f + normal(rng);
      if (bf16) {
        const std::uint16_t h = reference::float_to_bf16(w);
        w = reference::bf16_to_float(h);
        t.weight.push_back(static_cast<std::uint8_t>(h & 0xff));
        t.weight.push_back(static_cast<std::uint8_t>(h >> 8));
      } else {
        const auto* b = reinterpret_cast<const std::uint8_t*>(&w);
        t.weight.insert(t.weight.end(), b, b + 4);
      }
      t.weight_f32.push_back(w);
    }
  }
  if (shape.rope()) {
    std::int64_t longest = 0;
    for (std::size_t s = 0; s + 1 < in.cu.size(); ++s)
      longest = std::max<std::int64_t>(longest, in.cu[s + 1] - in.cu[s]);
    t.max_blocks = std::max<std::int64_t>(1, longest / c.ratio);
    const int half = shape.rope_dim / 2;
    for (std::int64_t b = 0; b < t.max_blocks; ++b) {
      for (int i = 0; i < half; ++i) {
        const double angle = static_cast<double>(b * c.ratio) *
                             std::pow(10000.0, -2.0 * i / static_cast<double>(shape.rope_dim));
        t.cos.push_back(static_cast<float>(std::cos(angle)));
        t.sin.push_back(static_cast<float>(std::sin(angle)));
      }
    }
  }
  return t;
}

namespace {

device::Buffer upload_or_placeholder(const void* data, std::size_t bytes) {
  device::Buffer b(std::max<std::size_t>(bytes, 16));
  if (bytes != 0) b.upload(data, bytes);
  return b;
}

}  // namespace

DeviceTail::DeviceTail(const Config& config, const TailInputs& t)
    : shape(config.tail),
      max_blocks(t.max_blocks),
      weight(upload_or_placeholder(t.weight.data(), t.weight.size())),
      cos(upload_or_placeholder(t.cos.data(), t.cos.size() * 4)),
      sin(upload_or_placeholder(t.sin.data(), t.sin.size() * 4)) {}

Tail DeviceTail::tail() const {
  Tail d;
  if (shape.norm) d.norm_weight = weight.get();
  if (shape.rope()) {
    d.rope_cos = cos.as<float>();
    d.rope_sin = sin.as<float>();
    d.rope_max_blocks = max_blocks;
  }
  return d;
}

Tail host_tail(const Config& config, const TailInputs& t) {
  Tail h;
  if (config.tail.norm) h.norm_weight = t.weight.data();
  if (config.tail.rope()) {
    h.rope_cos = t.cos.data();
    h.rope_sin = t.sin.data();
    h.rope_max_blocks = t.max_blocks;
  }
  return h;
}

std::int64_t forward_bytes(const HostInputs& in, int element_bytes) {
  const std::int64_t width = static_cast<std::int64_t>(in.config.coff) * in.config.head_dim;
  return element_bytes * (2 * in.total_tokens * width + in.total_comp * in.config.head_dim);
}

std::int64_t backward_bytes(const HostInputs& in, int element_bytes) {
  const std::int64_t width = static_cast<std::int64_t>(in.config.coff) * in.config.head_dim;
  return element_bytes * (4 * in.total_tokens * width + in.total_comp * in.config.head_dim);
}

LaidInputs lay_out(const HostInputs& in, DType dtype, Layout layout, std::int64_t stride) {
  const Config& c = in.config;
  const int bytes = element_size(dtype);
  const std::int64_t width = static_cast<std::int64_t>(c.coff) * c.head_dim;
  LaidInputs l;
  l.kv = encode(in.kv, dtype);
  l.score = encode(in.score, dtype);
  l.grad_out = encode(in.grad_out, dtype);
  if (layout == Layout::kSbhd) {
    const auto batch = static_cast<std::int64_t>(in.cu.size()) - 1;
    l.seq_len = batch > 0 ? in.cu[1] - in.cu[0] : 0;
    for (std::size_t b = 1; b < in.cu.size(); ++b) {
      if (in.cu[b] - in.cu[b - 1] != l.seq_len)
        throw std::invalid_argument("sbhd needs a pack of equal lengths (NxLEN)");
    }
    l.kv = to_sbhd(l.kv, l.seq_len, batch, width, bytes);
    l.score = to_sbhd(l.score, l.seq_len, batch, width, bytes);
    l.grad_out = to_sbhd(l.grad_out, l.seq_len / c.ratio, batch, c.head_dim, bytes);
  }
  if (stride != 0) {
    l.kv = spread(l.kv, in.total_tokens, width, stride, bytes);
    l.score = spread(l.score, in.total_tokens, width, stride, bytes);
  }
  return l;
}

namespace {

LaidInputs laid_as_configured(const HostInputs& in) {
  return lay_out(in, in.config.dtype, in.config.layout);
}

std::size_t element_bytes(const HostInputs& in) {
  return static_cast<std::size_t>(element_size(in.config.dtype));
}

}  // namespace

DeviceInputs::DeviceInputs(HostInputs host)
    : in(std::move(host)),
      cu(in.cu.size() * 4),
      cuc(in.cuc.size() * 4),
      ape(in.ape.size() * 4),
      kv(in.kv.size() * element_bytes(in)),
      score(in.score.size() * element_bytes(in)),
      grad_out(in.grad_out.size() * element_bytes(in)),
      out(in.grad_out.size() * element_bytes(in)),
      grad_kv(in.kv.size() * element_bytes(in)),
      grad_score(in.kv.size() * element_bytes(in)),
      grad_ape(in.ape.size() * 4) {
  const LaidInputs laid = laid_as_configured(in);
  seq_len = laid.seq_len;
  cu.upload(in.cu.data(), cu.size());
  cuc.upload(in.cuc.data(), cuc.size());
  ape.upload(in.ape.data(), ape.size());
  kv.upload(laid.kv.data(), kv.size());
  score.upload(laid.score.data(), score.size());
  grad_out.upload(laid.grad_out.data(), grad_out.size());
}

reference::HostProblem host_problem(const HostInputs& in, const LaidInputs& laid) {
  const bool sbhd = in.config.layout == Layout::kSbhd;
  reference::HostProblem h;
  h.kv = laid.kv.data();
  h.score = laid.score.data();
  h.ape = in.ape.data();
  h.cu_seqlens = sbhd ? nullptr : in.cu.data();
  h.cu_seqlens_comp = sbhd ? nullptr : in.cuc.data();
  h.total_tokens = in.total_tokens;
  h.num_segments = static_cast<std::int32_t>(in.cu.size() - 1);
  h.total_comp = in.total_comp;
  h.config = in.config;
  h.seq_len = laid.seq_len;
  return h;
}

ForwardArgs DeviceInputs::forward() const {
  const bool sbhd = in.config.layout == Layout::kSbhd;
  ForwardArgs a;
  a.kv = kv.get();
  a.score = score.get();
  a.ape = ape.as<float>();
  a.cu_seqlens = sbhd ? nullptr : cu.as<std::int32_t>();
  a.cu_seqlens_comp = sbhd ? nullptr : cuc.as<std::int32_t>();
  a.out = out.get();
  a.total_tokens = in.total_tokens;
  a.num_segments = static_cast<std::int32_t>(in.cu.size() - 1);
  a.total_comp = in.total_comp;
  a.config = in.config;
  a.seq_len = seq_len;
  return a;
}

BackwardArgs DeviceInputs::backward(std::uint32_t flags) const {
  const bool sbhd = in.config.layout == Layout::kSbhd;
  BackwardArgs a;
  a.kv = kv.get();
  a.score = score.get();
  a.ape = ape.as<float>();
  a.cu_seqlens = sbhd ? nullptr : cu.as<std::int32_t>();
  a.cu_seqlens_comp = sbhd ? nullptr : cuc.as<std::int32_t>();
  a.grad_out = grad_out.get();
  a.grad_kv = grad_kv.get();
  a.grad_score = grad_score.get();
  a.grad_ape = grad_ape.as<float>();
  a.total_tokens = in.total_tokens;
  a.num_segments = static_cast<std::int32_t>(in.cu.size() - 1);
  a.total_comp = in.total_comp;
  a.config = in.config;
  a.flags = flags;
  a.seq_len = seq_len;
  return a;
}

std::vector<std::uint8_t> DeviceInputs::download(const device::Buffer& buffer) {
  std::vector<std::uint8_t> h(buffer.size());
  buffer.download(h.data(), buffer.size());
  return h;
}

std::vector<std::uint16_t> DeviceInputs::download16(const device::Buffer& buffer) {
  std::vector<std::uint16_t> h(buffer.size() / 2);
  buffer.download(h.data(), buffer.size());
  return h;
}

int rotation_sets(std::int64_t bytes_per_call, std::int64_t l2_bytes) {
  const std::int64_t bytes = std::max<std::int64_t>(bytes_per_call, 1);
  return static_cast<int>(std::clamp<std::int64_t>((3 * l2_bytes + bytes - 1) / bytes, 2, 256));
}

}  // namespace csa::tools
