// The fused tail's forward on the GPU (pool + RMSNorm + RoPE (+ Hadamard), y rounded once):
// the production tails and ratio 2, over ragged THD packs with capacity padding and over SBHD,
// in every element type, against the CPU fp32 chain reference (the tolerance contract), the
// fp64 oracle (at least as close as the fp32 reference, and closer than the unfused chain a
// trainer runs today, which rounds after the pooling and after each stage), with rstd, every
// output NaN-poisoned first, and runs repeated bitwise.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>

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
  if (c.tail.hadamard) {
    for (int h = 1; h < d; h *= 2)
      for (int i = 0; i < d; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    for (auto& v : x) v = round(v * scale);
  }
  return std::vector<double>(x.begin(), x.end());
}

class GpuTail : public Gpu, public ::testing::WithParamInterface<TailCase> {};

TEST_P(GpuTail, ForwardMeetsTheChainReferenceAndBeatsTheUnfusedChain) {
  const TailCase& c = GetParam();
  const std::uint64_t seed = base_seed() + static_cast<std::uint64_t>(c.ratio * 131 + c.head_dim);
  const bool sbhd = c.layout == Layout::kSbhd;
  Config config{c.ratio, c.head_dim, c.coff, c.dtype, c.layout, false, c.tail};
  // THD: a ragged pack with an empty and a short segment, spare token capacity and padding
  // rows; SBHD: three columns of 37 blocks and a tail.
  const std::vector<std::int32_t> lens =
      sbhd ? std::vector<std::int32_t>(3, 37 * c.ratio + c.ratio - 1)
           : std::vector<std::int32_t>{1023, 0, 2 * c.ratio - 1, 509, c.ratio - 1, 130};
  Config plain = config;
  plain.layout = Layout::kThd;
  plain.dtype = DType::kBf16;
  plain.tail = TailShape{};
  const Problem p = make_problem(plain, lens, sbhd ? 0 : kExtraTokens, sbhd ? 0 : kExtraRows, seed);
  SCOPED_TRACE(p.describe() + " " + name_of(c));
  tools::HostInputs host = host_inputs(p);
  host.config = config;
  const tools::TailInputs t = tools::make_tail_inputs(config, host, seed);
  tools::DeviceInputs dev(host);
  device::Buffer weight(std::max<std::size_t>(t.weight.size(), 16));
  device::Buffer cos_d(std::max<std::size_t>(t.cos.size() * 4, 16));
  device::Buffer sin_d(std::max<std::size_t>(t.sin.size() * 4, 16));
  weight.upload(t.weight.data(), t.weight.size());
  cos_d.upload(t.cos.data(), t.cos.size() * 4);
  sin_d.upload(t.sin.data(), t.sin.size() * 4);
  device::Buffer rstd_d(static_cast<std::size_t>(std::max<std::int64_t>(p.total_comp, 4)) * 4);

  ForwardArgs a = dev.forward();
  if (c.tail.norm) {
    a.tail.norm_weight = weight.get();
    a.tail.eps = 1e-6f;
    a.rstd = rstd_d.as<float>();
  }
  if (c.tail.rope()) {
    a.tail.rope_cos = cos_d.as<float>();
    a.tail.rope_sin = sin_d.as<float>();
    a.tail.rope_max_blocks = t.max_blocks;
  }
  const std::size_t out_bytes = dev.out.size();
  auto run = [&] {
    dev.out.fill(0xff);
    rstd_d.fill(0xff);
    g_runtime->forward(a, nullptr);
    device::synchronize(nullptr);
    return tools::DeviceInputs::download(dev.out);
  };
  const std::vector<std::uint8_t> got = run();
  std::vector<float> rstd(static_cast<std::size_t>(p.total_comp));
  if (c.tail.norm) rstd_d.download(rstd.data(), rstd.size() * 4);
  EXPECT_EQ(run(), got) << "not bitwise run to run";

  // The CPU references over the same bytes, in the call's type and layout.
  const tools::LaidInputs laid = tools::lay_out(host, c.dtype, c.layout);
  reference::HostProblem h;
  h.kv = laid.kv.data();
  h.score = laid.score.data();
  h.ape = p.ape.data();
  h.cu_seqlens = sbhd ? nullptr : p.cu.data();
  h.cu_seqlens_comp = sbhd ? nullptr : p.cuc.data();
  h.total_tokens = p.total_tokens;
  h.num_segments = p.segments();
  h.total_comp = p.total_comp;
  h.config = config;
  h.seq_len = laid.seq_len;
  Tail ht;
  if (c.tail.norm) {
    ht.norm_weight = t.weight.data();
    ht.eps = 1e-6f;
  }
  if (c.tail.rope()) {
    ht.rope_cos = t.cos.data();
    ht.rope_sin = t.sin.data();
    ht.rope_max_blocks = t.max_blocks;
  }
  std::vector<std::uint8_t> ref(out_bytes);
  std::vector<float> ref_rstd(static_cast<std::size_t>(p.total_comp));
  reference::tail_forward_fp32(h, ht, ref.data(), c.tail.norm ? ref_rstd.data() : nullptr);
  std::vector<double> y64(static_cast<std::size_t>(p.comp_elems()));
  reference::tail_forward_fp64(h, ht, y64.data());
  const std::string broken = contract_failure(got, ref, c.dtype, false, "y");
  EXPECT_TRUE(broken.empty()) << broken;
  if (c.tail.norm) {
    for (std::size_t r = 0; r < rstd.size(); ++r)
      ASSERT_LE(rel_err(rstd[r], ref_rstd[r]), 1e-5) << "rstd row " << r;
  }

  // fp64 parity and the unfused chain: pooled rows rounded to the type, then each stage.
  reference::HostProblem hp = h;
  hp.config.tail = TailShape{};
  std::vector<std::uint8_t> pooled(out_bytes);
  reference::forward_fp32(hp, pooled.data());
  auto round = [&](float v) {
    switch (c.dtype) {
      case DType::kBf16:
        return reference::bf16_to_float(reference::float_to_bf16(v));
      case DType::kF16:
        return reference::fp16_to_float(reference::float_to_fp16(v));
      default:
        return v;
    }
  };
  const int d = c.head_dim;
  double fused_sq = 0, unfused_sq = 0, fused_max = 0, ref_max = 0;
  for (std::int64_t row = 0; row < p.total_comp; ++row) {
    std::vector<float> x(static_cast<std::size_t>(d));
    for (int j = 0; j < d; ++j)
      x[j] =
          static_cast<float>(element_value(pooled, c.dtype, static_cast<std::size_t>(row * d + j)));
    std::int64_t block = 0;
    if (sbhd) {
      block = row / p.segments();
    } else {
      std::size_t s = 0;
      while (s + 1 < p.cuc.size() && p.cuc[s + 1] <= row) ++s;
      block = s + 1 < p.cuc.size() ? row - p.cuc[s] : 0;
    }
    const auto chain = unfused_row(x, c, t, block, round);
    for (int j = 0; j < d; ++j) {
      const auto i = static_cast<std::size_t>(row * d + j);
      const double want = y64[i];
      const double f = element_value(got, c.dtype, i);
      fused_sq += (f - want) * (f - want);
      unfused_sq +=
          (chain[static_cast<std::size_t>(j)] - want) * (chain[static_cast<std::size_t>(j)] - want);
      fused_max = std::max(fused_max, rel_err(f, want));
      ref_max = std::max(ref_max, rel_err(element_value(ref, c.dtype, i), want));
    }
  }
  EXPECT_LE(fused_max, 1.5 * ref_max + 1e-6)
      << "the fused tail is further from fp64 than the fp32 chain reference";
  if (c.dtype != DType::kF32) {
    EXPECT_LE(fused_sq, unfused_sq)
        << "the fused tail is further from fp64 (squared error " << fused_sq
        << ") than the unfused chain (" << unfused_sq << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Tails, GpuTail, ::testing::ValuesIn(all_cases()),
                         [](const auto& param) { return name_of(param.param); });

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
  BackwardArgs b = dev.backward();
  try {
    g_runtime->backward(b, nullptr);
    ADD_FAILURE() << "the tail's backward was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kUnsupported) << e.what();
  }
}

}  // namespace
}  // namespace csa::test
