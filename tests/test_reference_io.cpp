// The CPU references for every element type and layout: fp16 conversion, SBHD equal to the THD
// reference of the same data laid out contiguously, and fp16 / fp32 computing the same window
// arithmetic as bf16 (hand-computed rows).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "contract.hpp"
#include "layout_data.hpp"
#include "test_util.hpp"

namespace csa::test {
namespace {

using tools::encode;
using tools::to_sbhd;

using reference::float_to_fp16;
using reference::fp16_to_float;

// The per-type contract the GPU tests and the tuner apply, on hand-made tensors.
TEST(Contract, EachTypeAllowsItsShareOfDifferingElementsAndNoNaNMismatch) {
  using tools::contract_failure;
  const auto bf16 = [](const std::vector<float>& v) {
    std::vector<std::uint16_t> h;
    for (float x : v) h.push_back(reference::float_to_bf16(x));
    return h;
  };
  std::vector<float> base(4000, 0.5f);
  const auto ref = bf16(base);
  auto near = base;
  for (int i = 0; i < 4; ++i) near[static_cast<std::size_t>(i)] = 0.50390625f;  // one bf16 step
  for (DType t : {DType::kBf16, DType::kF16}) {
    const auto r = encode(ref, t);
    const auto g = encode(bf16(near), t);
    EXPECT_EQ(contract_failure(r, r, t, true, "out"), "");
    EXPECT_NE(contract_failure(g, r, t, true, "out"), "");   // bitwise: none may differ
    EXPECT_EQ(contract_failure(g, r, t, false, "out"), "");  // 4 of 4000: within 0.1 % and 1 %
  }
  // bf16: 0.1 % of 4000 is 4; at half the margin (the tuner's) 2.
  EXPECT_NE(contract_failure(encode(bf16(near), DType::kBf16), encode(ref, DType::kBf16),
                             DType::kBf16, false, "out", 0.5),
            "");
  // fp16 allows 1 %: 40 elements.
  auto many = base;
  for (int i = 0; i < 40; ++i) many[static_cast<std::size_t>(i)] = 0.50390625f;
  EXPECT_EQ(contract_failure(encode(bf16(many), DType::kF16), encode(ref, DType::kF16), DType::kF16,
                             false, "out"),
            "");
  EXPECT_NE(contract_failure(encode(bf16(many), DType::kBf16), encode(ref, DType::kBf16),
                             DType::kBf16, false, "out"),
            "");
  // fp32: every element within 2^-16 relative, however many differ.
  const auto f32 = [](const std::vector<float>& v) {
    std::vector<std::uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  };
  auto close = base;
  for (auto& x : close) x *= 1.0f + 0x1p-20f;
  EXPECT_EQ(contract_failure(f32(close), f32(base), DType::kF32, false, "out"), "");
  close[7] = 0.5f * (1.0f + 0x1p-14f);
  EXPECT_NE(contract_failure(f32(close), f32(base), DType::kF32, false, "out"), "");
  // A NaN where the reference has none fails every contract, and names the tensor.
  auto nan = base;
  nan[3] = std::nanf("");
  const std::string why = contract_failure(f32(nan), f32(base), DType::kF32, false, "grad_kv");
  EXPECT_NE(why.find("grad_kv: 1 NaN"), std::string::npos) << why;
}

TEST(Fp16, RoundsToNearestEvenSaturatesToInfAndKeepsSubnormals) {
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_fp16(1.0f + 0x1p-11f), 0x3c00);      // halfway, rounds to even
  EXPECT_EQ(float_to_fp16(1.0f + 3 * 0x1p-11f), 0x3c02);  // halfway, rounds to even (up)
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);             // largest finite
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);             // rounds to inf
  EXPECT_EQ(float_to_fp16(0x1p-24f), 0x0001);             // smallest subnormal
  EXPECT_EQ(float_to_fp16(0x1p-25f), 0x0000);             // halfway to 0: even
  EXPECT_EQ(float_to_fp16(3 * 0x1p-25f), 0x0002);         // halfway: even (up)
  EXPECT_EQ(float_to_fp16(0x1p-14f), 0x0400);             // smallest normal
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(std::nanf("")))));
  for (std::uint32_t h = 0; h < 0x7c00; ++h)  // every finite positive value round-trips
    ASSERT_EQ(float_to_fp16(fp16_to_float(static_cast<std::uint16_t>(h))), h) << h;
  EXPECT_EQ(fp16_to_float(0x7c00), std::numeric_limits<float>::infinity());
}

struct Case {
  Config config;
  std::int64_t seq;
  std::int64_t batch;
};

class ReferenceLayouts : public ::testing::TestWithParam<std::tuple<DType, Case>> {};

TEST_P(ReferenceLayouts, SbhdEqualsThdOfTheSameColumnsAndEveryTypeIsSelfConsistent) {
  const auto [dtype, cs] = GetParam();
  Config c = cs.config;
  c.dtype = dtype;
  const std::uint64_t seed = base_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<std::int32_t> lens(static_cast<std::size_t>(cs.batch),
                                       static_cast<std::int32_t>(cs.seq));
  const Problem p = make_problem(c, lens, 0, 0, seed);
  const int bytes = dtype == DType::kF32 ? 4 : 2;
  const std::int64_t rows = (cs.seq / c.ratio);
  const auto kv = encode(p.kv, dtype), score = encode(p.score, dtype);
  const auto grad_out = encode(p.grad_out, dtype);

  reference::HostProblem thd = p.host();
  thd.kv = kv.data();
  thd.score = score.data();
  std::vector<std::uint8_t> out(static_cast<std::size_t>(p.comp_elems() * bytes));
  std::vector<std::uint8_t> gkv(kv.size()), gs(kv.size());
  std::vector<float> gape(p.ape.size());
  reference::forward_fp32(thd, out.data());
  reference::backward_fp32(thd, grad_out.data(), gkv.data(), gs.data(), gape.data());

  const auto kv_s = to_sbhd(kv, cs.seq, cs.batch, p.width(), bytes);
  const auto score_s = to_sbhd(score, cs.seq, cs.batch, p.width(), bytes);
  const auto grad_out_s = to_sbhd(grad_out, rows, cs.batch, c.head_dim, bytes);
  reference::HostProblem sbhd = thd;
  sbhd.config.layout = Layout::kSbhd;
  sbhd.kv = kv_s.data();
  sbhd.score = score_s.data();
  sbhd.cu_seqlens = nullptr;
  sbhd.cu_seqlens_comp = nullptr;
  sbhd.seq_len = cs.seq;
  std::vector<std::uint8_t> out_s(out.size(), 0xff), gkv_s(gkv.size(), 0xff), gs_s(gs.size(), 0xff);
  std::vector<float> gape_s(gape.size(), std::nanf(""));
  reference::forward_fp32(sbhd, out_s.data());
  reference::backward_fp32(sbhd, grad_out_s.data(), gkv_s.data(), gs_s.data(), gape_s.data());

  EXPECT_EQ(out_s, to_sbhd(out, rows, cs.batch, c.head_dim, bytes));
  EXPECT_EQ(gkv_s, to_sbhd(gkv, cs.seq, cs.batch, p.width(), bytes));
  EXPECT_EQ(gs_s, to_sbhd(gs, cs.seq, cs.batch, p.width(), bytes));
  // grad_ape sums the same terms in another row order (SBHD rows are block-major).
  for (std::size_t i = 0; i < gape.size(); ++i) EXPECT_NEAR(gape_s[i], gape[i], 1e-4) << i;

  // Every type against the fp64 oracle of its own inputs: within one rounding of the type.
  std::vector<double> out64(static_cast<std::size_t>(p.comp_elems()));
  reference::forward_fp64(thd, out64.data());
  const double unit = dtype == DType::kF32 ? 0x1p-20 : dtype == DType::kF16 ? 0x1p-9 : 0x1p-6;
  for (std::size_t i = 0; i < out64.size(); ++i) {
    float v;
    if (dtype == DType::kF32) {
      std::memcpy(&v, out.data() + 4 * i, 4);
    } else {
      std::uint16_t h;
      std::memcpy(&h, out.data() + 2 * i, 2);
      v = dtype == DType::kF16 ? fp16_to_float(h) : reference::bf16_to_float(h);
    }
    ASSERT_LE(std::fabs(v - out64[i]), unit * std::max(1.0, std::fabs(out64[i]))) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    TypesAndShapes, ReferenceLayouts,
    ::testing::Combine(::testing::Values(DType::kBf16, DType::kF16, DType::kF32),
                       ::testing::Values(Case{{4, 8, 2}, 37, 3},   // tail of 1, coff 2
                                         Case{{2, 5, 1}, 11, 2},   // odd head_dim
                                         Case{{5, 4, 2}, 3, 2},    // S < ratio: no rows
                                         Case{{3, 6, 2}, 12, 1}))  // B = 1, no tail
);

TEST(ReferenceTypes, TinyRowsComputeTheSameWindowInEveryType) {
  // ratio 2, head_dim 1, coff 1, one segment of 5 tokens, uniform softmax (exact weights).
  for (const DType dtype : {DType::kF16, DType::kF32}) {
    Config c{2, 1, 1};
    c.dtype = dtype;
    const std::vector<float> kvf = {1, 2, 3, 4, 5};
    std::vector<std::uint16_t> kv16(5), zero16(5, 0);
    for (int i = 0; i < 5; ++i)
      kv16[static_cast<std::size_t>(i)] = reference::float_to_bf16(kvf[i]);
    const auto kv = encode(kv16, dtype);
    const auto score = encode(zero16, dtype);
    const std::vector<float> ape(2, 0.0f);
    const std::vector<std::int32_t> cu = {0, 5}, cuc = {0, 2};
    reference::HostProblem h;
    h.kv = kv.data();
    h.score = score.data();
    h.ape = ape.data();
    h.cu_seqlens = cu.data();
    h.cu_seqlens_comp = cuc.data();
    h.total_tokens = 5;
    h.num_segments = 1;
    h.total_comp = 2;
    h.config = c;
    std::vector<std::uint8_t> out(2 * (dtype == DType::kF32 ? 4 : 2));
    reference::forward_fp32(h, out.data());
    float o[2];
    for (int i = 0; i < 2; ++i) {
      if (dtype == DType::kF32) {
        std::memcpy(&o[i], out.data() + 4 * i, 4);
      } else {
        std::uint16_t b;
        std::memcpy(&b, out.data() + 2 * i, 2);
        o[i] = fp16_to_float(b);
      }
    }
    EXPECT_EQ(o[0], 1.5f) << dtype_name(dtype);
    EXPECT_EQ(o[1], 3.5f) << dtype_name(dtype);
  }
}

}  // namespace
}  // namespace csa::test
