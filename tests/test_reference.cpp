// The CPU references: hand-computed tiny cases and the fp32 reference against the fp64 oracle.
#include <gtest/gtest.h>

#include "test_util.hpp"

namespace csa::test {
namespace {

using reference::bf16_to_float;
using reference::float_to_bf16;

Problem tiny(const Config& c, std::vector<std::int32_t> lens, std::vector<float> kv,
             std::int64_t extra_rows = 0) {
  Problem p = make_problem(c, lens, 0, extra_rows, 1);
  for (std::size_t i = 0; i < p.kv.size(); ++i) p.kv[i] = float_to_bf16(kv[i]);
  std::fill(p.score.begin(), p.score.end(), float_to_bf16(0.0f));  // uniform softmax: exact weights
  std::fill(p.ape.begin(), p.ape.end(), 0.0f);
  return p;
}

TEST(Bf16, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);  // halfway, rounds to even
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);  // halfway, rounds to even (up)
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(0xc000), -2.0f);
}

TEST(ReferenceTiny, OwnBlockWindowCoff1) {
  // ratio 2, head_dim 1, one segment of 5 tokens: rows 0..1, token 4 is a tail.
  Problem p = tiny({2, 1, 1}, {5}, {1, 2, 3, 4, 5});
  std::vector<std::uint16_t> out(2);
  reference::forward_fp32(p.host(), out.data());
  EXPECT_EQ(bf16_to_float(out[0]), 1.5f);
  EXPECT_EQ(bf16_to_float(out[1]), 3.5f);

  p.grad_out = {float_to_bf16(2.0f), float_to_bf16(-1.0f)};
  std::vector<std::uint16_t> gkv(5, 0xffff), gs(5, 0xffff);
  std::vector<float> gape(2, 7.0f);
  reference::backward_fp32(p.host(), p.grad_out.data(), gkv.data(), gs.data(), gape.data());
  // p = 0.5: grad_kv = g/2; grad_score = p*(g*kv - S), S = g*(kv0+kv1)/2.
  EXPECT_EQ(bf16_to_float(gkv[0]), 1.0f);
  EXPECT_EQ(bf16_to_float(gkv[3]), -0.5f);
  EXPECT_EQ(bf16_to_float(gs[0]), 0.5f * (2.0f * 1 - 3.0f));
  EXPECT_EQ(bf16_to_float(gs[1]), 0.5f * (2.0f * 2 - 3.0f));
  EXPECT_EQ(bf16_to_float(gs[2]), 0.5f * (-3.0f + 3.5f));
  EXPECT_EQ(gkv[4], 0);  // tail token
  EXPECT_EQ(gs[4], 0);
  EXPECT_EQ(gape[0], -0.5f + 0.25f);  // slot 0 summed over both rows (7.0 overwritten)
  EXPECT_EQ(gape[1], 0.5f - 0.25f);
}

TEST(ReferenceTiny, OverlapWindowCoff2FirstBlockRuleAndPadding) {
  // ratio 2, head_dim 1 (W = 2), one segment of 4 tokens, 2 padding rows.
  // kv[t] = {first half, second half}.
  Problem p = tiny({2, 1, 2}, {4}, {10, 1, 20, 2, 30, 3, 40, 4}, 2);
  std::vector<std::uint16_t> out(4);
  reference::forward_fp32(p.host(), out.data());
  EXPECT_EQ(bf16_to_float(out[0]), 1.5f);  // block 0: own half only
  EXPECT_EQ(bf16_to_float(out[1]),
            (10 + 20 + 3 + 4) / 4.f);  // previous first halves + own second halves
  EXPECT_EQ(out[2], out[0]);           // padding rows = block 0 from token 0
  EXPECT_EQ(out[3], out[0]);

  p.grad_out = {float_to_bf16(1.0f), float_to_bf16(1.0f), float_to_bf16(5.0f), float_to_bf16(5.0f)};
  std::vector<std::uint16_t> gkv(8, 0xffff), gs(8, 0xffff);
  std::vector<float> gape(4);
  reference::backward_fp32(p.host(), p.grad_out.data(), gkv.data(), gs.data(), gape.data());
  EXPECT_EQ(bf16_to_float(gkv[1]), 0.5f);   // token 0 second half: block 0, p = 1/2
  EXPECT_EQ(bf16_to_float(gkv[0]), 0.25f);  // token 0 first half: block 1's previous slot, p = 1/4
  EXPECT_EQ(bf16_to_float(gkv[5]), 0.25f);  // token 2 second half: block 1
  EXPECT_EQ(gkv[4], 0);                     // token 2 first half: last block, never consumed
  EXPECT_EQ(gkv[6], 0);
  EXPECT_EQ(gs[4], 0);
  // Padding-row gradients (5.0) are ignored: only rows 0 and 1 contribute.
  EXPECT_EQ(bf16_to_float(gs[1]), 0.5f * (1.0f - 1.5f));
}

TEST(ReferenceTiny, ShortSegmentsGetNoRowsAndZeroGradients) {
  Problem p = make_problem({4, 8, 2}, {3, 9, 2}, 5, 1, 11);
  std::vector<std::uint16_t> gkv(static_cast<std::size_t>(p.token_elems()), 0xffff), gs(gkv);
  std::vector<float> gape(static_cast<std::size_t>(p.ape_elems()));
  reference::backward_fp32(p.host(), p.grad_out.data(), gkv.data(), gs.data(), gape.data());
  const auto mask = consumed_mask(p);
  for (std::size_t i = 0; i < mask.size(); ++i) {
    if (!mask[i]) {
      ASSERT_EQ(gkv[i], 0) << i;
      ASSERT_EQ(gs[i], 0) << i;
    } else {
      ASSERT_NE(gkv[i], 0xffff) << i;
    }
  }
}

TEST(ReferenceTiny, AccumulateAddsIntoGradApe) {
  Problem p = make_problem({2, 4, 2}, {16}, 0, 0, 3);
  std::vector<std::uint16_t> gkv(static_cast<std::size_t>(p.token_elems())), gs(gkv);
  std::vector<float> fresh(static_cast<std::size_t>(p.ape_elems()), 123.0f),
      acc(fresh.size(), 2.0f);
  reference::backward_fp32(p.host(), p.grad_out.data(), gkv.data(), gs.data(), fresh.data());
  reference::backward_fp32(p.host(), p.grad_out.data(), gkv.data(), gs.data(), acc.data(), true);
  for (std::size_t i = 0; i < fresh.size(); ++i) EXPECT_EQ(acc[i], 2.0f + fresh[i]);
}

class ReferenceVsOracle : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(ReferenceVsOracle, Fp32ReferenceTracksFp64) {
  const auto [ratio, coff, head_dim] = GetParam();
  Problem p = make_problem({ratio, head_dim, coff}, {37, 0, 64, 5, 19}, 7, 3,
                           base_seed() + ratio * 100 + coff);
  SCOPED_TRACE(p.describe());
  std::vector<std::uint16_t> out(static_cast<std::size_t>(p.comp_elems()));
  std::vector<double> oracle(out.size());
  reference::forward_fp32(p.host(), out.data());
  reference::forward_fp64(p.host(), oracle.data());
  for (std::size_t i = 0; i < out.size(); ++i) {
    // One bf16 rounding (2^-9 relative) plus fp32 arithmetic.
    ASSERT_LE(std::fabs(bf16_to_float(out[i]) - oracle[i]),
              std::ldexp(std::fabs(oracle[i]), -8) + 1e-6)
        << i;
  }
  const auto n = static_cast<std::size_t>(p.token_elems());
  std::vector<std::uint16_t> gkv(n), gs(n);
  std::vector<float> gape(static_cast<std::size_t>(p.ape_elems()));
  std::vector<double> gkv64(n), gs64(n), gape64(gape.size());
  reference::backward_fp32(p.host(), p.grad_out.data(), gkv.data(), gs.data(), gape.data());
  reference::backward_fp64(p.host(), p.grad_out.data(), gkv64.data(), gs64.data(), gape64.data());
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_LE(std::fabs(bf16_to_float(gkv[i]) - gkv64[i]),
              std::ldexp(std::fabs(gkv64[i]), -8) + 1e-6)
        << i;
    ASSERT_LE(std::fabs(bf16_to_float(gs[i]) - gs64[i]), std::ldexp(std::fabs(gs64[i]), -8) + 1e-5)
        << i;
  }
  for (std::size_t i = 0; i < gape.size(); ++i) ASSERT_NEAR(gape[i], gape64[i], 1e-4) << i;
}

INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceVsOracle,
                         ::testing::Combine(::testing::Values(1, 2, 4, 16), ::testing::Values(1, 2),
                                            ::testing::Values(3, 8)));

}  // namespace
}  // namespace csa::test
