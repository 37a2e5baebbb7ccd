// The fused tail's forward on the GPU (pool + RMSNorm + RoPE (+ Hadamard), y rounded once):
// the production tails and ratio 2, over ragged THD packs with capacity padding and over SBHD,
// in every element type, against the CPU fp32 chain reference (the tolerance contract), the
// fp64 oracle (at least as close as the fp32 reference, and closer than the unfused chain a
// trainer runs today, which rounds after the pooling and after each stage), with rstd, every
// output NaN-poisoned first, and runs repeated bitwise.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <cstring>
#include <tuple>

#include "contract.hpp"
#include "gpu_fixture.hpp"
#include "layout_data.hpp"

namespace csa::test {
namespace {

using tools::contract_failure;
using tools::element_value;

struct TailCase {
  int ratio, coff, head_dim;
  TailShape tail;
  DType dtype;
  Layout layout;
};

TailShape shape(bool norm, int rope_dim, bool hadamard, bool interleaved = true,
                DType weight = DType::kF32) {
  TailShape t;
  t.norm = norm;
  t.norm_weight_dtype = weight;
  t.rope_dim = rope_dim;
  t.rope_interleaved = interleaved;
  t.hadamard = hadamard;
  return t;
}

std::string name_of(const TailCase& c) {
  std::string tail = tail_name(c.tail);
  for (auto& ch : tail)
    if (ch == '+' || ch == '-') ch = '_';
  return fmt::format("r{}_c{}_d{}_{}_{}_{}", c.ratio, c.coff, c.head_dim, tail, dtype_name(c.dtype),
                     layout_name(c.layout));
}

std::vector<TailCase> all_cases() {
  std::vector<TailCase> out;
  const std::vector<TailCase> base = {
      {4, 2, 512, shape(true, 64, false), DType::kBf16, Layout::kThd},  // production
      {4, 2, 128, shape(true, 64, true), DType::kBf16, Layout::kThd},   // indexer
      {2, 2, 512, shape(true, 64, false), DType::kBf16, Layout::kThd},
      {2, 2, 128, shape(true, 64, true), DType::kBf16, Layout::kThd},
      // One stage at a time, half-split pairs, a bf16 weight, one column a thread (d = 96).
      {4, 2, 128, shape(true, 0, false, true, DType::kBf16), DType::kBf16, Layout::kThd},
      {4, 1, 128, shape(false, 64, false, false), DType::kBf16, Layout::kThd},
      {8, 2, 512, shape(false, 0, true), DType::kBf16, Layout::kThd},
      {4, 2, 96, shape(true, 32, false), DType::kBf16, Layout::kThd},
      {16, 1, 64, shape(true, 64, true, false), DType::kBf16, Layout::kThd},
      // Rows across four warps: the Hadamard transform's two cross-warp stages and the
      // half-split rotation's exchange after them in the backward.
      {16, 1, 256, shape(true, 64, true, false), DType::kBf16, Layout::kThd},
      // The long-window family (ratio > 16): the production tail, a coff-2 one with every
      // stage, the rotation and the Hadamard without the norm, a bf16 weight at ratio 256.
      {128, 1, 512, shape(true, 64, false), DType::kBf16, Layout::kThd},
      {32, 2, 128, shape(true, 64, true), DType::kBf16, Layout::kThd},
      {64, 1, 64, shape(false, 64, true, false), DType::kBf16, Layout::kThd},
      {256, 1, 256, shape(true, 0, false, true, DType::kBf16), DType::kBf16, Layout::kThd},
  };
  for (const TailCase& c : base) {
    for (DType t : {DType::kBf16, DType::kF16, DType::kF32}) {
      for (Layout l : {Layout::kThd, Layout::kSbhd}) {
        TailCase k = c;
        k.dtype = t;
        k.layout = l;
        out.push_back(k);
      }
    }
  }
  return out;
}

double rel_err(double got, double want) {
  return std::fabs(got - want) / std::max(1.0, std::fabs(want));
}

// The scaled Hadamard transform of one row in fp32, the result rounded to the type.
void hadamard_rounded(std::vector<float>& x, const std::function<float(float)>& round) {
  const auto d = x.size();
  for (std::size_t h = 1; h < d; h *= 2)
    for (std::size_t i = 0; i < d; i += 2 * h)
      for (std::size_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  for (auto& v : x) v = round(v * scale);
}

// The chain a PyTorch trainer runs today on one row of pooled values (already rounded to the
// type): RMSNorm in fp32 rounded to the type, RoPE rounded, the Hadamard rounded.
std::vector<double> unfused_row(std::vector<float> x, const TailCase& c, const tools::TailInputs& t,
                                std::int64_t block, const std::function<float(float)>& round) {
  const int d = c.head_dim;
  if (c.tail.norm) {
    float ss = 0.0f;
    for (float v : x) ss += v * v;
    const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(d) + 1e-6f);
    for (int j = 0; j < d; ++j) x[j] = round((x[j] * rstd) * t.weight_f32[j]);
  }
  if (c.tail.rope()) {
    const int half = c.tail.rope_dim / 2;
    const int first = d - c.tail.rope_dim;
    const std::int64_t b = std::min<std::int64_t>(block, t.max_blocks - 1);
    std::vector<float> y = x;
    for (int i = 0; i < half; ++i) {
      const int ia = c.tail.rope_interleaved ? first + 2 * i : first + i;
      const int ib = c.tail.rope_interleaved ? ia + 1 : ia + half;
      const float co = t.cos[static_cast<std::size_t>(b * half + i)];
      const float si = t.sin[static_cast<std::size_t>(b * half + i)];
      y[ia] = round(x[ia] * co - x[ib] * si);
      y[ib] = round(x[ia] * si + x[ib] * co);
    }
    x = y;
  }
  if (c.tail.hadamard) hadamard_rounded(x, round);
  return std::vector<double>(x.begin(), x.end());
}

// One case's problem: a ragged THD pack with an empty and a short segment, spare token
// capacity and padding rows, or SBHD columns of 37 blocks and a tail; its tail tensors on the
// device and on the host, and the CPU references over the same bytes.
struct TailProblem {
  TailCase c;
  bool sbhd;
  Config config;
  Problem p;  // bf16 values, THD (segment-major)
  tools::HostInputs host;
  tools::TailInputs t;
  tools::DeviceInputs dev;
  tools::DeviceTail tail_d;
  device::Buffer rstd_d, grad_w_d, pooled_d;
  tools::LaidInputs laid;
  reference::HostProblem h;
  Tail ht;

  static Problem make(const TailCase& c, std::uint64_t seed) {
    const bool sb = c.layout == Layout::kSbhd;
    const std::vector<std::int32_t> lens =
        sb ? std::vector<std::int32_t>(3, 37 * c.ratio + c.ratio - 1)
           : std::vector<std::int32_t>{1023, 0, 2 * c.ratio - 1, 509, c.ratio - 1, 130};
    return make_problem({c.ratio, c.head_dim, c.coff}, lens, sb ? 0 : kExtraTokens,
                        sb ? 0 : kExtraRows, seed);
  }
  static tools::HostInputs with_config(const Problem& p, const Config& config) {
    tools::HostInputs h = host_inputs(p);
    h.config = config;
    return h;
  }

  TailProblem(const TailCase& cs, std::uint64_t seed)
      : c(cs),
        sbhd(cs.layout == Layout::kSbhd),
        config{cs.ratio, cs.head_dim, cs.coff, cs.dtype, cs.layout, false, cs.tail},
        p(make(cs, seed)),
        host(with_config(p, config)),
        t(tools::make_tail_inputs(config, host, seed)),
        dev(host),
        tail_d(config, t),
        rstd_d(static_cast<std::size_t>(std::max<std::int64_t>(p.total_comp, 4)) * 4),
        grad_w_d(static_cast<std::size_t>(cs.head_dim) * 4),
        pooled_d(static_cast<std::size_t>(std::max<std::int64_t>(p.total_comp, 1)) *
                 static_cast<std::size_t>(cs.head_dim) * 4),
        laid(tools::lay_out(host, cs.dtype, cs.layout)),
        h(tools::host_problem(host, laid)),
        ht(tools::host_tail(config, t)) {}

  // The long-window family's tail: the forward keeps the pooled rows, its backward reads them.
  bool long_window() const { return keeps_pooled_rows(config); }
  // A short-window tail's backward in its row-stats form: from the pooled rows too.
  bool row_stats = false;
  bool keeps_pooled() const { return long_window() || row_stats; }
  ForwardArgs forward_args() const {
    ForwardArgs a = dev.forward();
    a.tail = tail_d.tail();
    if (c.tail.norm) a.rstd = rstd_d.as<float>();
    if (keeps_pooled()) a.pooled = pooled_d.as<float>();
    return a;
  }
  BackwardArgs backward_args(std::uint32_t flags) const {
    BackwardArgs a = dev.backward(flags);
    a.tail = tail_d.tail();
    if (c.tail.norm) a.grad_norm_weight = grad_w_d.as<float>();
    if (keeps_pooled() && c.tail.norm) a.pooled = pooled_d.as<float>();
    return a;
  }
  // The row's block in its segment (padding rows: 0).
  std::int64_t block_of(std::int64_t row) const {
    if (sbhd) return row / p.segments();
    std::size_t s = 0;
    while (s + 1 < p.cuc.size() && p.cuc[s + 1] <= row) ++s;
    return s + 1 < p.cuc.size() ? row - p.cuc[s] : 0;
  }
  float round(float v) const {
    switch (c.dtype) {
      case DType::kBf16:
        return reference::bf16_to_float(reference::float_to_bf16(v));
      case DType::kF16:
        return reference::fp16_to_float(reference::float_to_fp16(v));
      default:
        return v;
    }
  }
  // The pooled rows as a trainer's unfused chain keeps them (rounded to the type).
  std::vector<std::uint8_t> pooled() const {
    reference::HostProblem hp = h;
    hp.config.tail = TailShape{};
    std::vector<std::uint8_t> out(dev.out.size());
    reference::forward_fp32(hp, out.data());
    return out;
  }
};

// One row of the unfused chain's backward from grad_y (each stage's gradient rounded to the
// type): the Hadamard, the rotation's transpose, the norm's backward from the rounded pooled
// row x (its saved activation).
std::vector<float> unfused_row_backward(std::vector<float> g, const std::vector<float>& x,
                                        const TailProblem& tp, std::int64_t block) {
  const TailCase& c = tp.c;
  const int d = c.head_dim;
  const tools::TailInputs& t = tp.t;
  auto round = [&](float v) { return tp.round(v); };
  if (c.tail.hadamard) hadamard_rounded(g, round);
  if (c.tail.rope()) {
    const int half = c.tail.rope_dim / 2;
    const int first = d - c.tail.rope_dim;
    const std::int64_t b = std::min<std::int64_t>(block, t.max_blocks - 1);
    std::vector<float> r = g;
    for (int i = 0; i < half; ++i) {
      const int ia = c.tail.rope_interleaved ? first + 2 * i : first + i;
      const int ib = c.tail.rope_interleaved ? ia + 1 : ia + half;
      const float co = t.cos[static_cast<std::size_t>(b * half + i)];
      const float si = t.sin[static_cast<std::size_t>(b * half + i)];
      r[ia] = round(g[ia] * co + g[ib] * si);
      r[ib] = round(g[ib] * co - g[ia] * si);
    }
    g = r;
  }
  if (c.tail.norm) {
    float ss = 0.0f, dot = 0.0f;
    for (int j = 0; j < d; ++j) {
      ss += x[j] * x[j];
      dot += t.weight_f32[j] * g[j] * x[j];
    }
    const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(d) + 1e-6f);
    const float coef = rstd * rstd * rstd * dot / static_cast<float>(d);
    for (int j = 0; j < d; ++j) g[j] = round(rstd * t.weight_f32[j] * g[j] - coef * x[j]);
  }
  return g;
}

struct ErrorSums {
  double sq = 0, max = 0;
  void add(double got, double want) {
    sq += (got - want) * (got - want);
    max = std::max(max, rel_err(got, want));
  }
};

class GpuTail : public Gpu, public ::testing::WithParamInterface<TailCase> {};

// The forward against the fp32 chain reference, the fp64 oracle and the unfused chain; bitwise
// run to run; rstd.
void check_forward(const TailCase& c) {
  const std::uint64_t seed = base_seed() + static_cast<std::uint64_t>(c.ratio * 131 + c.head_dim);
  TailProblem tp(c, seed);
  const Problem& p = tp.p;
  SCOPED_TRACE(p.describe() + " " + name_of(c));
  const ForwardArgs a = tp.forward_args();
  const std::size_t out_bytes = tp.dev.out.size();
  auto run = [&] {
    tp.dev.out.fill(0xff);
    tp.rstd_d.fill(0xff);
    tp.pooled_d.fill(0xff);
    g_runtime->forward(a, nullptr);
    device::synchronize(nullptr);
    return tools::DeviceInputs::download(tp.dev.out);
  };
  const std::vector<std::uint8_t> got = run();
  std::vector<float> rstd(static_cast<std::size_t>(p.total_comp));
  if (c.tail.norm) tp.rstd_d.download(rstd.data(), rstd.size() * 4);
  EXPECT_EQ(run(), got) << "not bitwise run to run";
  if (tp.long_window()) {
    // Without the caller's pooled buffer the rows go to scratch memory: the same y.
    ForwardArgs scratch = a;
    scratch.pooled = nullptr;
    tp.dev.out.fill(0xff);
    g_runtime->forward(scratch, nullptr);
    device::synchronize(nullptr);
    EXPECT_EQ(tools::DeviceInputs::download(tp.dev.out), got) << "pooled in scratch memory";
  }

  std::vector<std::uint8_t> ref(out_bytes);
  std::vector<float> ref_rstd(static_cast<std::size_t>(p.total_comp));
  reference::tail_forward_fp32(tp.h, tp.ht, ref.data(), c.tail.norm ? ref_rstd.data() : nullptr);
  const std::vector<std::uint8_t> chain_ref = ref;  // the whole chain on the CPU: fp64 parity
  if (tp.long_window()) {
    // The long-window family hands out its fp32 pooled rows: they meet the fp32 contract
    // against the CPU's, and y is compared with the CPU tail over them, so that the CPU's
    // libm expf (not CUDA's) does not count against the tail (a window of 256 slots flips
    // about 0.3 % of bf16 roundings through it alone).
    const auto n = static_cast<std::size_t>(p.total_comp * c.head_dim);
    std::vector<float> pooled_gpu(n), pooled_cpu(n);
    tp.pooled_d.download(pooled_gpu.data(), n * 4);
    reference::pooled_fp32(tp.h, pooled_cpu.data());
    auto bytes = [](const std::vector<float>& v) {
      std::vector<std::uint8_t> b(v.size() * 4);
      std::memcpy(b.data(), v.data(), b.size());
      return b;
    };
    const std::string pooled_broken =
        contract_failure(bytes(pooled_gpu), bytes(pooled_cpu), DType::kF32, false, "pooled");
    EXPECT_TRUE(pooled_broken.empty()) << pooled_broken;
    reference::tail_rows_fp32(tp.h, tp.ht, pooled_gpu.data(), ref.data(),
                              c.tail.norm ? ref_rstd.data() : nullptr);
  }
  std::vector<double> y64(static_cast<std::size_t>(p.comp_elems()));
  reference::tail_forward_fp64(tp.h, tp.ht, y64.data());
  const std::string broken = contract_failure(got, ref, c.dtype, false, "y");
  EXPECT_TRUE(broken.empty()) << broken;
  if (c.tail.norm) {
    for (std::size_t r = 0; r < rstd.size(); ++r)
      ASSERT_LE(rel_err(rstd[r], ref_rstd[r]), 1e-5) << "rstd row " << r;
  }

  // fp64 parity and the unfused chain: pooled rows rounded to the type, then each stage.
  const std::vector<std::uint8_t> pooled = tp.pooled();
  const int d = c.head_dim;
  ErrorSums fused, unfused, ref32;
  for (std::int64_t row = 0; row < p.total_comp; ++row) {
    std::vector<float> x(static_cast<std::size_t>(d));
    for (int j = 0; j < d; ++j)
      x[j] =
          static_cast<float>(element_value(pooled, c.dtype, static_cast<std::size_t>(row * d + j)));
    const auto chain =
        unfused_row(x, c, tp.t, tp.block_of(row), [&](float v) { return tp.round(v); });
    for (int j = 0; j < d; ++j) {
      const auto i = static_cast<std::size_t>(row * d + j);
      fused.add(element_value(got, c.dtype, i), y64[i]);
      unfused.add(chain[static_cast<std::size_t>(j)], y64[i]);
      ref32.add(element_value(chain_ref, c.dtype, i), y64[i]);
    }
  }
  EXPECT_LE(fused.max, 1.5 * ref32.max + 1e-6)
      << "the fused tail is further from fp64 than the fp32 chain reference";
  if (c.dtype != DType::kF32) {
    EXPECT_LE(fused.sq, unfused.sq)
        << "the fused tail is further from fp64 (squared error " << fused.sq
        << ") than the unfused chain (" << unfused.sq << ")";
  }
}

TEST_P(GpuTail, ForwardMeetsTheChainReferenceAndBeatsTheUnfusedChain) {
  check_forward(GetParam());
}

// The backward (in its row-stats form with `row_stats`) against the fp32 chain reference, the
// fp64 oracle and the unfused chain, both grad_ape forms, determinism and accumulation.
void check_backward(const TailCase& c, bool row_stats) {
  const std::uint64_t seed = base_seed() + static_cast<std::uint64_t>(c.ratio * 137 + c.head_dim);
  TailProblem tp(c, seed);
  tp.row_stats = row_stats;
  const Problem& p = tp.p;
  SCOPED_TRACE(p.describe() + " " + name_of(c) + (row_stats ? " row-stats form" : ""));
  const std::size_t tok_bytes = tp.dev.grad_kv.size();
  const std::size_t ape_n = p.ape.size();
  const auto d = static_cast<std::size_t>(c.head_dim);
  struct Grads {
    std::vector<std::uint8_t> kv, score;
    std::vector<float> ape, w;
  };
  // Poisoned outputs; grad_ape and grad_w preset (NaN: overwritten, or values to accumulate).
  auto run = [&](std::uint32_t flags, float preset) {
    tp.dev.grad_kv.fill(0xff);
    tp.dev.grad_score.fill(0xff);
    const std::vector<float> ape0(ape_n, preset), w0(d, preset);
    tp.dev.grad_ape.upload(ape0.data(), ape_n * 4);
    tp.grad_w_d.upload(w0.data(), d * 4);
    g_runtime->backward(tp.backward_args(flags), nullptr);
    device::synchronize(nullptr);
    Grads g{tools::DeviceInputs::download(tp.dev.grad_kv),
            tools::DeviceInputs::download(tp.dev.grad_score), std::vector<float>(ape_n),
            std::vector<float>(d)};
    tp.dev.grad_ape.download(g.ape.data(), ape_n * 4);
    if (c.tail.norm) tp.grad_w_d.download(g.w.data(), d * 4);
    return g;
  };
  if (tp.keeps_pooled()) {  // the pooled rows the backward reads
    g_runtime->forward(tp.forward_args(), nullptr);
    device::synchronize(nullptr);
  }
  // The default call sums grad_ape and grad_w as the schedule does (atomically where it adds
  // them in one launch); the deterministic one in the fixed order, bitwise run to run.
  const Grads got = run(0, std::nanf(""));
  const Grads det = run(kDeterministic, std::nanf(""));
  const Grads again = run(kDeterministic, std::nanf(""));
  EXPECT_EQ(det.kv, got.kv) << "grad_kv differs between the grad_ape forms";
  EXPECT_EQ(det.score, got.score) << "grad_score differs between the grad_ape forms";
  EXPECT_EQ(again.kv, det.kv) << "grad_kv not bitwise run to run";
  EXPECT_EQ(again.score, det.score) << "grad_score not bitwise run to run";
  EXPECT_EQ(again.ape, det.ape) << "deterministic grad_ape not bitwise run to run";
  EXPECT_EQ(again.w, det.w) << "deterministic grad_w not bitwise run to run";
  const auto near = [](float a, float b) {
    return std::fabs(a - b) <= 1e-3f * std::max(1.0f, std::fabs(b));
  };
  for (std::size_t i = 0; i < ape_n; ++i)
    ASSERT_TRUE(near(got.ape[i], det.ape[i]))
        << "ape " << i << ": " << got.ape[i] << " vs " << det.ape[i];
  for (std::size_t j = 0; j < (c.tail.norm ? d : 0); ++j)
    ASSERT_TRUE(near(got.w[j], det.w[j]))
        << "grad_w " << j << ": " << got.w[j] << " vs " << det.w[j];
  const Grads acc_det = run(kDeterministic | kAccumulateGradApe, 0.5f);
  for (std::size_t i = 0; i < ape_n; ++i)
    ASSERT_EQ(acc_det.ape[i], 0.5f + det.ape[i]) << "ape " << i;
  for (std::size_t j = 0; j < (c.tail.norm ? d : 0); ++j)
    ASSERT_EQ(acc_det.w[j], 0.5f + det.w[j]) << "grad_w accumulates: " << j;
  const Grads acc = run(kAccumulateGradApe, 0.5f);
  EXPECT_EQ(acc.kv, got.kv);
  for (std::size_t i = 0; i < ape_n; ++i)
    ASSERT_TRUE(near(acc.ape[i], 0.5f + det.ape[i])) << "ape accumulates: " << i;
  for (std::size_t j = 0; j < (c.tail.norm ? d : 0); ++j)
    ASSERT_TRUE(near(acc.w[j], 0.5f + det.w[j])) << "grad_w accumulates: " << j;

  // The fp32 chain reference and the fp64 oracle over the same grad_y bytes.
  const std::vector<std::uint8_t>& gy = tp.laid.grad_out;
  Grads ref{std::vector<std::uint8_t>(tok_bytes), std::vector<std::uint8_t>(tok_bytes),
            std::vector<float>(ape_n), std::vector<float>(d)};
  reference::tail_backward_fp32(tp.h, tp.ht, gy.data(), ref.kv.data(), ref.score.data(),
                                ref.ape.data(), c.tail.norm ? ref.w.data() : nullptr);
  const auto tok_n = static_cast<std::size_t>(p.token_elems());
  std::vector<double> kv64(tok_n), score64(tok_n), ape64(ape_n), w64(d);
  reference::tail_backward_fp64(tp.h, tp.ht, gy.data(), kv64.data(), score64.data(), ape64.data(),
                                c.tail.norm ? w64.data() : nullptr);
  for (const auto& [name, a, b] : {std::tuple{"grad_kv", &got.kv, &ref.kv},
                                   std::tuple{"grad_score", &got.score, &ref.score}}) {
    const std::string broken = contract_failure(*a, *b, c.dtype, false, name);
    EXPECT_TRUE(broken.empty()) << broken;
  }
  auto parity = [&](const char* name, auto&& got_at, auto&& ref_at, const std::vector<double>& want,
                    std::size_t n) {
    ErrorSums fused, ref32;
    for (std::size_t i = 0; i < n; ++i) {
      fused.add(got_at(i), want[i]);
      ref32.add(ref_at(i), want[i]);
    }
    EXPECT_LE(fused.max, 1.5 * ref32.max + 1e-5)
        << name << ": further from fp64 (" << fused.max << ") than the fp32 reference ("
        << ref32.max << ")";
    return fused;
  };
  const ErrorSums fused_kv = parity(
      "grad_kv", [&](std::size_t i) { return element_value(got.kv, c.dtype, i); },
      [&](std::size_t i) { return element_value(ref.kv, c.dtype, i); }, kv64, tok_n);
  parity(
      "grad_score", [&](std::size_t i) { return element_value(got.score, c.dtype, i); },
      [&](std::size_t i) { return element_value(ref.score, c.dtype, i); }, score64, tok_n);
  parity(
      "grad_ape", [&](std::size_t i) { return static_cast<double>(det.ape[i]); },
      [&](std::size_t i) { return static_cast<double>(ref.ape[i]); }, ape64, ape_n);
  if (c.tail.norm) {
    parity(
        "grad_w", [&](std::size_t i) { return static_cast<double>(det.w[i]); },
        [&](std::size_t i) { return static_cast<double>(ref.w[i]); }, w64, d);
  }

  // The unfused chain: each stage's gradient rounded, then the pooling's backward from it.
  if (c.dtype == DType::kF32) return;
  const std::vector<std::uint8_t> pooled = tp.pooled();
  const std::size_t bytes = static_cast<std::size_t>(tools::element_size(c.dtype));
  std::vector<std::uint8_t> gx(gy.size());
  for (std::int64_t row = 0; row < p.total_comp; ++row) {
    std::vector<float> g(d), x(d);
    for (std::size_t j = 0; j < d; ++j) {
      const auto i = static_cast<std::size_t>(row) * d + j;
      g[j] = static_cast<float>(element_value(gy, c.dtype, i));
      x[j] = static_cast<float>(element_value(pooled, c.dtype, i));
    }
    const auto r = unfused_row_backward(g, x, tp, tp.block_of(row));
    for (std::size_t j = 0; j < d; ++j) {
      const auto bits =
          c.dtype == DType::kBf16 ? reference::float_to_bf16(r[j]) : reference::float_to_fp16(r[j]);
      std::memcpy(gx.data() + (static_cast<std::size_t>(row) * d + j) * bytes, &bits, bytes);
    }
  }
  reference::HostProblem hp = tp.h;
  hp.config.tail = TailShape{};
  std::vector<std::uint8_t> un_kv(tok_bytes), un_score(tok_bytes);
  std::vector<float> un_ape(ape_n);
  reference::backward_fp32(hp, gx.data(), un_kv.data(), un_score.data(), un_ape.data());
  ErrorSums unfused_kv;
  for (std::size_t i = 0; i < tok_n; ++i) unfused_kv.add(element_value(un_kv, c.dtype, i), kv64[i]);
  EXPECT_LE(fused_kv.sq, unfused_kv.sq)
      << "grad_kv: the fused tail is further from fp64 (" << fused_kv.sq
      << ") than the unfused chain (" << unfused_kv.sq << ")";
}

TEST_P(GpuTail, BackwardMeetsTheChainReferenceAndBeatsTheUnfusedChain) {
  check_backward(GetParam(), false);
}

// Short-window tails with the norm and without the Hadamard transform: the backward's
// row-stats form (the caller keeps the pooled rows) meets the same contract.
TEST_P(GpuTail, RowStatsBackwardMeetsTheChainReferenceAndBeatsTheUnfusedChain) {
  const TailCase& c = GetParam();
  if (!has_row_stats_backward(
          Config{c.ratio, c.head_dim, c.coff, c.dtype, c.layout, false, c.tail}))
    GTEST_SKIP() << "no row-stats form";
  {
    // The forward that keeps the pooled rows: the same y, and every pooled value written
    // (poisoned first) within the fp32 contract of the CPU's.
    TailProblem tp(c, base_seed() + static_cast<std::uint64_t>(c.ratio * 131 + c.head_dim));
    SCOPED_TRACE(tp.p.describe() + " " + name_of(c));
    auto y_of = [&](bool keep) {
      tp.row_stats = keep;
      tp.dev.out.fill(0xff);
      tp.pooled_d.fill(0xff);
      g_runtime->forward(tp.forward_args(), nullptr);
      device::synchronize(nullptr);
      return tools::DeviceInputs::download(tp.dev.out);
    };
    const std::vector<std::uint8_t> plain_y = y_of(false);
    EXPECT_EQ(y_of(true), plain_y) << "y differs where the forward keeps the pooled rows";
    const auto n = static_cast<std::size_t>(tp.p.total_comp * c.head_dim);
    std::vector<std::uint8_t> pooled_gpu(n * 4), pooled_cpu(n * 4);
    tp.pooled_d.download(pooled_gpu.data(), n * 4);
    reference::pooled_fp32(tp.h, reinterpret_cast<float*>(pooled_cpu.data()));
    const std::string broken =
        contract_failure(pooled_gpu, pooled_cpu, DType::kF32, false, "pooled");
    EXPECT_TRUE(broken.empty()) << broken;
  }
  check_backward(c, true);
}

// The device's schedule table with one entry ahead of the others, in g_runtime while it lives.
// NOTE: an entry keyed by dtype and layout outranks an unkeyed one wherever it stands, so a
// leading entry names the call's dtype and layout.
class LeadingScheduleEntry {
 public:
  explicit LeadingScheduleEntry(const std::string& entry)
      : saved_(g_runtime->schedule_table_json(device_arch())) {
    std::string table = saved_;
    const std::string entries = "\"entries\": [";
    const auto at = table.find(entries);
    if (at == std::string::npos) throw std::runtime_error("the device's table has no entries");
    table.insert(at + entries.size(), entry + ",");
    g_runtime->set_schedule_table(table, "test entry");
  }
  ~LeadingScheduleEntry() { g_runtime->set_schedule_table(saved_, "restored"); }
  LeadingScheduleEntry(const LeadingScheduleEntry&) = delete;
  LeadingScheduleEntry& operator=(const LeadingScheduleEntry&) = delete;

 private:
  std::string saved_;
};

// A long-window schedule entry for exactly the case's call, of one bucket of every row count:
// `fields` its fields after "max_rows".
std::string long_window_entry(const TailCase& c, const char* direction, const std::string& fields) {
  return fmt::format(
      R"({{"family": "long_window", "direction": "{}", "coff": {}, "head_dim": [{}, {}],
          "ratio": [{}, {}], "tail": "{}", "dtype": "{}", "layout": "{}",
          "buckets": [{{"max_rows": null, {}}}]}})",
      direction, c.coff, c.head_dim, c.head_dim, c.ratio, c.ratio, tail_name(c.tail),
      dtype_name(c.dtype), layout_name(c.layout), fields);
}

// Long-window tails with the norm and without the Hadamard transform: the backward's row-stats
// form, which a schedule table's backward bucket names, meets the same contract, with windows
// loaded into registers and through the shared-memory ring.
TEST_P(GpuTail, LongWindowRowStatsBackwardMeetsTheChainReferenceAndBeatsTheUnfusedChain) {
  const TailCase& c = GetParam();
  const Config config{c.ratio, c.head_dim, c.coff, c.dtype, c.layout, false, c.tail};
  if (!keeps_pooled_rows(config) || !c.tail.norm || c.tail.hadamard)
    GTEST_SKIP() << "no long-window row-stats form";
  for (const char* bucket : {R"("vec": 1, "cols": 32, "threads": 256, "stages": 1)",
                             R"("vec": 2, "cols": 64, "threads": 512, "stages": 3)"}) {
    SCOPED_TRACE(bucket);
    const LeadingScheduleEntry entry(long_window_entry(
        c, "backward",
        std::string(bucket) + R"(, "serial": false, "fast_exp": true, "rows_per_cta": 0,
                                   "grad_ape": "atomic", "tail_backward": "row_stats")"));
    const std::string chosen =
        g_runtime->select_schedule(config, Direction::kBackward, 64, device_arch()).schedule;
    ASSERT_NE(chosen.find("tail_backward=row_stats"), std::string::npos) << chosen;
    check_backward(c, false);
  }
}

// Long-window tails: the forward's row-kernel form, which a schedule table's forward bucket
// names, meets the same contract, in the chunked and the serial order.
TEST_P(GpuTail, LongWindowRowKernelForwardMeetsTheChainReferenceAndBeatsTheUnfusedChain) {
  const TailCase& c = GetParam();
  if (!keeps_pooled_rows(Config{c.ratio, c.head_dim, c.coff, c.dtype, c.layout, false, c.tail}))
    GTEST_SKIP() << "no long-window row-kernel form";
  for (const char* bucket : {R"("vec": 2, "cols": 64, "threads": 256, "serial": false,
                                 "fast_exp": true)",
                             R"("vec": 2, "cols": 32, "threads": 512, "serial": true,
                                 "fast_exp": false)"}) {
    SCOPED_TRACE(bucket);
    const LeadingScheduleEntry entry(
        long_window_entry(c, "forward", std::string(bucket) + R"(, "tail_forward": "row_kernel")"));
    const Config config{c.ratio, c.head_dim, c.coff, c.dtype, c.layout, false, c.tail};
    const std::string chosen =
        g_runtime->select_schedule(config, Direction::kForward, 64, device_arch()).schedule;
    ASSERT_NE(chosen.find("tail_forward=row_kernel"), std::string::npos) << chosen;
    check_forward(c);
  }
}

// Long-window tails on sm_90 and newer: the forward's cluster form (a row's column slices one
// thread-block cluster), which a schedule table's forward bucket names, meets the same contract,
// in the chunked and the serial order, with and without the caller's pooled rows.
TEST_P(GpuTail, LongWindowClusterForwardMeetsTheChainReferenceAndBeatsTheUnfusedChain) {
  const TailCase& c = GetParam();
  const Config config{c.ratio, c.head_dim, c.coff, c.dtype, c.layout, false, c.tail};
  if (!keeps_pooled_rows(config)) GTEST_SKIP() << "no long-window cluster form";
  if (device::current_device().cc_major < 9) GTEST_SKIP() << "no clusters before sm_90";
  for (const char* bucket : {R"("vec": 2, "cols": 64, "threads": 512, "serial": false,
                                 "fast_exp": true)",
                             R"("vec": 1, "cols": 32, "threads": 256, "serial": true,
                                 "fast_exp": false)"}) {
    SCOPED_TRACE(bucket);
    const LeadingScheduleEntry entry(
        long_window_entry(c, "forward", std::string(bucket) + R"(, "tail_forward": "cluster")"));
    const std::string chosen =
        g_runtime->select_schedule(config, Direction::kForward, 64, device_arch()).schedule;
    const int cols = std::stoi(chosen.substr(chosen.find("cols=") + 5));
    const int slices = (c.head_dim + cols - 1) / cols;
    if (slices < 2 || slices > 8) {
      EXPECT_EQ(chosen.find("tail_forward=cluster"), std::string::npos) << chosen;
      continue;  // fitted to the last-slice form
    }
    ASSERT_NE(chosen.find("tail_forward=cluster"), std::string::npos) << chosen;
    check_forward(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Tails, GpuTail, ::testing::ValuesIn(all_cases()),
                         [](const auto& param) { return name_of(param.param); });

// Row-strided THD tails: kv and score rows 2W elements apart (the halves of one fused projection
// output), the gradients and y / grad_y rows padded past their width. They give the bits of the
// contiguous call (y, rstd, grad_kv, grad_score; grad_ape and grad_w within 1e-3, both forms),
// and the bytes between rows stay untouched (0xff).
TEST_F(Gpu, RowStridedTailsMatchTheContiguousCallBitwise) {
  const std::vector<TailCase> cases = {
      {4, 2, 128, shape(true, 64, true), DType::kBf16, Layout::kThd},
      {4, 2, 512, shape(true, 64, false), DType::kF16, Layout::kThd},
      {2, 2, 128, shape(true, 64, true, false, DType::kBf16), DType::kBf16, Layout::kThd},
      {16, 1, 64, shape(false, 64, true), DType::kF32, Layout::kThd},
      {128, 1, 512, shape(true, 64, false), DType::kBf16, Layout::kThd},
  };
  for (const TailCase& c : cases) {
    const std::uint64_t seed = base_seed() + static_cast<std::uint64_t>(c.ratio * 139 + c.head_dim);
    TailProblem tp(c, seed);
    SCOPED_TRACE(tp.p.describe() + " " + name_of(c) + " seed " + std::to_string(seed));
    const int bytes = tools::element_size(c.dtype);
    const std::int64_t d = c.head_dim, width = c.coff * d, align = 16 / bytes;
    const auto tokens = static_cast<std::int64_t>(tp.dev.kv.size()) / (width * bytes);
    const auto rows = static_cast<std::int64_t>(tp.dev.out.size()) / (d * bytes);
    const std::int64_t in_stride = 2 * width, grad_stride = width + align, out_stride = d + align;
    auto upload = [](const std::vector<std::uint8_t>& h) {
      device::Buffer b(h.size());
      b.upload(h.data(), h.size());
      return b;
    };
    auto spread = [&](const device::Buffer& dense, std::int64_t n, std::int64_t w,
                      std::int64_t stride) {
      return upload(tools::spread(tools::DeviceInputs::download(dense), n, w, stride, bytes));
    };
    auto gather = [&](const device::Buffer& strided, std::int64_t n, std::int64_t w,
                      std::int64_t stride, bool* gaps) {
      return tools::gather(tools::DeviceInputs::download(strided), n, w, stride, bytes, gaps);
    };
    const device::Buffer kv = spread(tp.dev.kv, tokens, width, in_stride);
    const device::Buffer score = spread(tp.dev.score, tokens, width, in_stride);
    const device::Buffer grad_out = spread(tp.dev.grad_out, rows, d, out_stride);
    tp.dev.out.fill(0xff);  // the poisoned outputs' strided images: every byte 0xff
    tp.dev.grad_kv.fill(0xff);
    const device::Buffer out = spread(tp.dev.out, rows, d, out_stride);
    const device::Buffer grad_kv = spread(tp.dev.grad_kv, tokens, width, grad_stride);
    const device::Buffer grad_score = spread(tp.dev.grad_kv, tokens, width, grad_stride);
    device::Buffer grad_ape(tp.dev.grad_ape.size()), grad_w(tp.grad_w_d.size()),
        rstd(tp.rstd_d.size());

    // Forward: contiguous, then strided into poisoned rows.
    tp.rstd_d.fill(0xff);
    g_runtime->forward(tp.forward_args(), nullptr);
    device::synchronize(nullptr);
    const auto y = tools::DeviceInputs::download(tp.dev.out);
    const auto rstd_thd = tools::DeviceInputs::download(tp.rstd_d);
    ForwardArgs f = tp.forward_args();
    f.kv = kv.get();
    f.score = score.get();
    f.kv_stride = f.score_stride = in_stride;
    f.out = out.get();
    f.out_stride = out_stride;
    if (c.tail.norm) {
      rstd.fill(0xff);
      f.rstd = rstd.as<float>();
    }
    g_runtime->forward(f, nullptr);
    device::synchronize(nullptr);
    bool gaps = false;
    EXPECT_EQ(gather(out, rows, d, out_stride, &gaps), y) << "strided y differs";
    EXPECT_TRUE(gaps) << "bytes between y rows were written";
    if (c.tail.norm) {
      EXPECT_EQ(tools::DeviceInputs::download(rstd), rstd_thd) << "rstd differs";
    }

    // Backward, both grad_ape forms (the long-window family reads the pooled rows the strided
    // forward left, the same bits).
    for (std::uint32_t flags : {std::uint32_t{0}, kDeterministic}) {
      SCOPED_TRACE(flags != 0 ? "deterministic" : "default");
      tp.dev.grad_kv.fill(0xff);
      tp.dev.grad_score.fill(0xff);
      g_runtime->backward(tp.backward_args(flags), nullptr);
      device::synchronize(nullptr);
      const auto gkv = tools::DeviceInputs::download(tp.dev.grad_kv);
      const auto gsc = tools::DeviceInputs::download(tp.dev.grad_score);
      std::vector<float> ape(tp.dev.grad_ape.size() / 4),
          w(c.tail.norm ? tp.grad_w_d.size() / 4 : 0);
      tp.dev.grad_ape.download(ape.data(), ape.size() * 4);
      if (c.tail.norm) tp.grad_w_d.download(w.data(), w.size() * 4);

      BackwardArgs b = tp.backward_args(flags);
      b.kv = kv.get();
      b.score = score.get();
      b.kv_stride = b.score_stride = in_stride;
      b.grad_out = grad_out.get();
      b.grad_out_stride = out_stride;
      b.grad_kv = grad_kv.get();
      b.grad_score = grad_score.get();
      b.grad_kv_stride = b.grad_score_stride = grad_stride;
      grad_ape.fill(0xff);
      b.grad_ape = grad_ape.as<float>();
      if (c.tail.norm) {
        grad_w.fill(0xff);
        b.grad_norm_weight = grad_w.as<float>();
      }
      g_runtime->backward(b, nullptr);
      device::synchronize(nullptr);
      bool gaps_kv = false, gaps_score = false;
      EXPECT_EQ(gather(grad_kv, tokens, width, grad_stride, &gaps_kv), gkv) << "grad_kv differs";
      EXPECT_EQ(gather(grad_score, tokens, width, grad_stride, &gaps_score), gsc)
          << "grad_score differs";
      EXPECT_TRUE(gaps_kv && gaps_score) << "bytes between gradient rows were written";
      std::vector<float> ape_s(ape.size()), w_s(w.size());
      grad_ape.download(ape_s.data(), ape_s.size() * 4);
      if (c.tail.norm) grad_w.download(w_s.data(), w_s.size() * 4);
      for (std::size_t i = 0; i < ape.size(); ++i)
        ASSERT_NEAR(ape_s[i], ape[i], 1e-3 * std::max(1.0f, std::fabs(ape[i]))) << "ape " << i;
      for (std::size_t j = 0; j < w.size(); ++j)
        ASSERT_NEAR(w_s[j], w[j], 1e-3 * std::max(1.0f, std::fabs(w[j]))) << "grad_w " << j;
    }
  }
}

// The call's tail options route it: a bad tail is rejected naming the field before any launch,
// and out stays untouched.
TEST_F(Gpu, TailRejectionsLeaveTheOutputUntouched) {
  Config config{4, 128, 2};
  config.tail = shape(true, 64, false);
  const Problem p = make_problem({4, 128, 2}, {256, 100}, 0, 0, base_seed());
  tools::HostInputs host = host_inputs(p);
  host.config = config;
  tools::DeviceInputs dev(host);
  device::Buffer table(4 * 64 * 32);
  table.fill(0);
  dev.out.fill(0xab);
  const auto before = tools::DeviceInputs::download(dev.out);
  auto rejects = [&](const ForwardArgs& a, const std::string& name) {
    try {
      g_runtime->forward(a, nullptr);
      ADD_FAILURE() << "accepted; expected a rejection naming " << name;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
    device::synchronize(nullptr);
    EXPECT_EQ(tools::DeviceInputs::download(dev.out), before) << name;
  };
  ForwardArgs a = dev.forward();
  a.tail.rope_cos = a.tail.rope_sin = table.as<float>();
  a.tail.rope_max_blocks = 32;
  rejects(a, "tail.norm_weight is null");
  a.tail.norm_weight = table.get();
  a.tail.eps = 0.0f;
  rejects(a, "tail.eps");
  a.tail.eps = 1e-6f;
  a.tail.norm_weight = static_cast<const char*>(table.get()) + 4;
  rejects(a, "tail.norm_weight");
  a.tail.norm_weight = table.get();
  a.tail.rope_sin = nullptr;
  rejects(a, "tail.rope_sin");
  a.tail.rope_sin = table.as<float>();
  ForwardArgs no_norm = a;
  no_norm.config.tail.norm = false;
  rejects(no_norm, "tail.norm_weight is set");
  // The backward needs grad_norm_weight with the norm.
  BackwardArgs b = dev.backward();
  b.tail = a.tail;
  dev.grad_kv.fill(0xab);
  const auto grad_before = tools::DeviceInputs::download(dev.grad_kv);
  try {
    g_runtime->backward(b, nullptr);
    ADD_FAILURE() << "a backward without grad_norm_weight was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grad_norm_weight"), std::string::npos) << e.what();
  }
  device::synchronize(nullptr);
  EXPECT_EQ(tools::DeviceInputs::download(dev.grad_kv), grad_before);
  // pooled selects the row-stats form, which a tail with the Hadamard transform has not.
  device::Buffer grad_w(std::size_t{128} * 4),
      pooled(static_cast<std::size_t>(p.total_comp) * 128 * 4);
  b.grad_norm_weight = grad_w.as<float>();
  b.pooled = pooled.as<float>();
  b.config.tail.hadamard = true;
  try {
    g_runtime->backward(b, nullptr);
    ADD_FAILURE() << "pooled with a Hadamard tail in the short-window family was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no row-stats backward"), std::string::npos) << e.what();
  }
  device::synchronize(nullptr);
  EXPECT_EQ(tools::DeviceInputs::download(dev.grad_kv), grad_before);
}

// The long-window family's tail backward reads the forward's pooled rows: without them it is
// rejected before any launch; pooled without a tail too.
TEST_F(Gpu, LongWindowTailRejectionsLeaveTheOutputsUntouched) {
  Config config{32, 128, 1};
  config.tail = shape(true, 0, false);
  const Problem p = make_problem({32, 128, 1}, {256, 100}, 0, 0, base_seed());
  tools::HostInputs host = host_inputs(p);
  host.config = config;
  tools::DeviceInputs dev(host);
  device::Buffer weight(128 * 4), grad_w(128 * 4), pooled(64 * 128 * 4);
  weight.fill(0);
  dev.grad_kv.fill(0xab);
  const auto before = tools::DeviceInputs::download(dev.grad_kv);
  BackwardArgs b = dev.backward();
  b.tail.norm_weight = weight.get();
  b.grad_norm_weight = grad_w.as<float>();
  try {
    g_runtime->backward(b, nullptr);
    ADD_FAILURE() << "a long-window tail backward without pooled was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pooled is null"), std::string::npos) << e.what();
  }
  ForwardArgs f = dev.forward();
  f.config.tail = TailShape{};
  f.pooled = pooled.as<float>();
  dev.out.fill(0xab);
  const auto out_before = tools::DeviceInputs::download(dev.out);
  try {
    g_runtime->forward(f, nullptr);
    ADD_FAILURE() << "pooled without a tail was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pooled is set"), std::string::npos) << e.what();
  }
  device::synchronize(nullptr);
  EXPECT_EQ(tools::DeviceInputs::download(dev.grad_kv), before);
  EXPECT_EQ(tools::DeviceInputs::download(dev.out), out_before);
}

// The long-window tail's row arrivals and grad_ape's claims share the claim-word pool of a
// stream: after many atomic backwards (each leaving its words at a new generation) the tail's
// forward still runs every row's tail once, to the same bits.
TEST_F(Gpu, LongWindowTailSharesClaimWordsWithAtomicBackwards) {
  const std::uint64_t seed = base_seed() + 17;
  TailProblem tail({128, 1, 512, shape(true, 64, false), DType::kBf16, Layout::kThd}, seed);
  TailProblem plain({4, 2, 128, TailShape{}, DType::kBf16, Layout::kThd}, seed + 1);
  SCOPED_TRACE(tail.p.describe());
  const ForwardArgs f = tail.forward_args();
  auto forward = [&] {
    tail.dev.out.fill(0xff);
    g_runtime->forward(f, nullptr);
    device::synchronize(nullptr);
    return tools::DeviceInputs::download(tail.dev.out);
  };
  const std::vector<std::uint8_t> first = forward();
  for (int i = 0; i < 40; ++i) g_runtime->backward(plain.backward_args(0), nullptr);
  device::synchronize(nullptr);
  EXPECT_EQ(forward(), first) << "the tail's forward after 40 atomic backwards on its stream";
  // Every row written: no 0xff poison left (a row whose tail never ran keeps it).
  const std::vector<std::uint8_t> again = forward();
  std::size_t poisoned = 0;
  for (std::size_t i = 0; i + 1 < again.size(); i += 2)
    poisoned += again[i] == 0xff && again[i + 1] == 0xff ? 1 : 0;
  EXPECT_EQ(poisoned, 0u) << "rows the tail never wrote";
}

}  // namespace
}  // namespace csa::test
