// The algorithms of kernels/exact_math.cuh on the host: the same source, with the hardware
// approximations (rcp.approx, rsqrt.approx) modelled as correctly rounded. What this checks is
// the code around them: the rare operands' scaling, the tie correction of subnormal quotients,
// the special values. The reference is the double-precision result rounded to float, which is
// the correctly rounded float result for division and square root (53 >= 2 * 24 + 2). The GPU
// test (test_gpu_exact_math.cpp) sweeps the real instructions against the CUDA intrinsics.
#include <gtest/gtest.h>

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

// NOTE: after every system header: the names below are CUDA's, defined for this file alone.
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))

namespace csa_kernel {

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fsub_rn(float a, float b) {
  return a - b;
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fmaf(a, b, c);
}

}  // namespace csa_kernel

#include "exact_math.cuh"

#undef __device__
#undef __forceinline__
#undef __noinline__

namespace csa_kernel {

// The approximations, modelled as correctly rounded.
float host_approx_reciprocal(float b) {
  return static_cast<float>(1.0 / static_cast<double>(b));
}
float host_approx_rsqrt(float v) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(v)));
}

}  // namespace csa_kernel

namespace csa::test {
namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
bool same(float x, float y) {
  return bits_of(x) == bits_of(y) || (std::isnan(x) && std::isnan(y));
}
float quotient(float a, float b) {
  return static_cast<float>(static_cast<double>(a) / static_cast<double>(b));
}

std::string hex(float f) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", bits_of(f));
  return s;
}

// The divisors of div_rn's domain, [1, 2^24] (NaN too).
std::vector<float> divisors() {
  return {1.0f,        std::nextafter(1.0f, 2.0f),
          1.5f,        3.0f,
          6.0f,        7.0f,
          65.0f,       100.0f,
          511.0f,      4096.0f,
          16777215.0f, 16777216.0f,
          1.1f,        1.9999999f,
          24.5f,       std::nanf("")};
}

// Every subnormal dividend (all subnormal quotients come from below 2^-102) and every 61st
// of the other dividends below 2^-100 (the scaled path), both signs, against the correctly
// rounded quotient.
TEST(ExactMath, DivisionIsCorrectlyRoundedForTinyDividends) {
  for (float b : divisors()) {
    const float r = csa_kernel::refined_reciprocal(b);
    std::size_t bad = 0;
    std::string first;
    const auto check = [&](float a) {
      const float got = csa_kernel::div_rn(a, b, r);
      if ((!same(got, quotient(a, b)) || !same(csa_kernel::div_rn_exact(a, b, r), got)) &&
          bad++ == 0)
        first = hex(a) + " / " + std::to_string(b) + " gave " + hex(got);
    };
    for (std::uint32_t u = 0; u < bits_of(0x1p-126f); ++u) check(from_bits(u));
    for (std::uint32_t u = bits_of(0x1p-126f); u < bits_of(0x1p-100f); u += 61) {
      check(from_bits(u));
      check(-from_bits(u));
    }
    EXPECT_EQ(bad, 0u) << first;
  }
}

TEST(ExactMath, DivisionIsCorrectlyRoundedOnSampledAndSpecialDividends) {
  const std::uint64_t seed = 20261204;
  std::mt19937 rng(seed);
  std::vector<float> a_values = {0.0f,
                                 -0.0f,
                                 INFINITY,
                                 -INFINITY,
                                 std::nanf(""),
                                 1.0f,
                                 0x1p-100f,
                                 std::nextafter(0x1p-100f, 0.0f),
                                 0x1.fffffep127f,
                                 -0x1.fffffep127f,
                                 0x1p-149f};
  for (int i = 0; i < 1 << 20; ++i)
    a_values.push_back(from_bits(static_cast<std::uint32_t>(rng())));
  for (float b : divisors()) {
    const float r = csa_kernel::refined_reciprocal(b);
    for (float a : a_values) {
      ASSERT_TRUE(same(csa_kernel::div_rn(a, b, r), quotient(a, b)))
          << hex(a) << " / " << b << " (seed " << seed << ")";
      ASSERT_TRUE(same(csa_kernel::div_rn_exact(a, b, r), quotient(a, b)))
          << hex(a) << " / " << b << " (seed " << seed << ")";
    }
  }
}

// div_near: the quotient itself from the fast path's range, within an ulp below it, and the
// special values the quotient has.
TEST(ExactMath, NearDivisionStaysWithinAnUlp) {
  const std::uint64_t seed = 20261205;
  std::mt19937 rng(seed);
  for (float b : {1.0f, 3.0f, 96.0f, 4095.0f}) {
    const float r = 1.0f / b;
    for (int i = 0; i < 1 << 18; ++i) {
      const float a = from_bits(static_cast<std::uint32_t>(rng()));
      const float got = csa_kernel::div_near(a, b, r);
      const float want = quotient(a, b);
      if (std::isnan(want) || std::isinf(want) || std::fabs(a) >= 0x1p-100f) {
        ASSERT_TRUE(same(got, want)) << hex(a) << " / " << b << " (seed " << seed << ")";
      } else {
        ASSERT_LE(std::fabs(got - want),
                  std::nextafter(std::fabs(want), INFINITY) - std::fabs(want))
            << hex(a) << " / " << b << " (seed " << seed << ")";
      }
    }
  }
}

// Subnormal quotients exactly halfway between two subnormals after the scaled division's first
// rounding: the tie correction must follow the true quotient.
TEST(ExactMath, SubnormalQuotientsNearTiesRoundOnce) {
  std::size_t checked = 0;
  for (float b : {3.0f, 6.0f, 7.0f, 10.0f, 12.0f, 100.0f, 384.0f}) {
    const float r = csa_kernel::refined_reciprocal(b);
    for (std::uint32_t k = 1; k < 1u << 16; ++k) {
      // a / b near (k + 1/2) * 2^-149: a = b * (k + 1/2) * 2^-149, rounded, and its neighbours.
      const float centre = static_cast<float>(static_cast<double>(b) * (k + 0.5) * 0x1p-149);
      for (float a : {std::nextafter(centre, 0.0f), centre, std::nextafter(centre, 1.0f)}) {
        ++checked;
        ASSERT_TRUE(same(csa_kernel::div_rn(a, b, r), quotient(a, b)))
            << hex(a) << " / " << b << " gave " << hex(csa_kernel::div_rn(a, b, r)) << ", want "
            << hex(quotient(a, b));
      }
    }
  }
  EXPECT_GT(checked, 0u);
}

// Every square-root input class: zero, the subnormals, the scaled range at the low end and the
// fast path's lowest binades (where its residual would underflow), one binade pair of the fast
// path, the top of it, infinity, negative numbers and NaN.
TEST(ExactMath, SquareRootIsCorrectlyRounded) {
  const auto check = [](float v) {
    const float want = v < 0.0f || std::isnan(v)
                           ? std::nanf("")
                           : static_cast<float>(std::sqrt(static_cast<double>(v)));
    return same(csa_kernel::sqrt_rn(v), want) && (v != 0.0f || same(csa_kernel::sqrt_rn(v), v));
  };
  std::size_t bad = 0;
  std::string first;
  const auto sweep = [&](std::uint32_t lo, std::uint32_t hi) {
    for (std::uint32_t u = lo; u < hi; ++u) {
      if (!check(from_bits(u)) && bad++ == 0) first = hex(from_bits(u));
    }
  };
  sweep(0, bits_of(0x1p-98f));          // zero, the subnormals and the fast path's underflow edge
  sweep(bits_of(1.0f), bits_of(4.0f));  // both exponent parities
  sweep(bits_of(0x1p124f) - 4, bits_of(INFINITY) + 1);         // to infinity
  sweep(bits_of(-0.0f), bits_of(-0.0f) + 1 + (1u << 16));      // -0 and negatives
  sweep(bits_of(std::nanf("")), bits_of(std::nanf("")) + 16);  // NaN
  EXPECT_EQ(bad, 0u) << first;
}

TEST(ExactMath, ReciprocalOfARootCoversItsSpecialValues) {
  EXPECT_TRUE(same(csa_kernel::rcp_rn(0.0f), INFINITY));
  EXPECT_TRUE(same(csa_kernel::rcp_rn(-0.0f), -INFINITY));
  EXPECT_TRUE(same(csa_kernel::rcp_rn(INFINITY), 0.0f));
  EXPECT_TRUE(same(csa_kernel::rcp_rn(std::nanf("")), std::nanf("")));
  for (float x : {0x1p-125f, 0x1p-74f, 1e-3f, 1.0f, 3.0f, 0x1p64f, 0x1p125f})
    EXPECT_TRUE(same(csa_kernel::rcp_rn(x), quotient(1.0f, x))) << hex(x);
}

}  // namespace
}  // namespace csa::test
