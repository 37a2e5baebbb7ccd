// CPU references. NOTE: this file is compiled with -ffp-contract=off so that every product and
// sum is rounded on its own, exactly as SPEC §2 orders them.
#include "csa/reference.hpp"

#include "reference/pooling.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace csa::reference {

float bf16_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::uint16_t float_to_bf16(float value) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

float fp16_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const int exponent = (bits >> 10) & 0x1f;
  const std::uint32_t mantissa = bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero and subnormals
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  }
  std::uint32_t u;
  std::memcpy(&u, &magnitude, sizeof u);
  u |= sign;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::uint16_t float_to_fp16(float value) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(value);
  if (std::isnan(value)) return static_cast<std::uint16_t>(sign | 0x7e00u);
  if (a >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 0x1p-14f) {
    // Subnormal range: multiples of 2^-24, rounded to nearest even by the FPU's rint.
    const auto m = static_cast<std::uint32_t>(std::nearbyint(a * 0x1p24f));
    return static_cast<std::uint16_t>(sign | m);
  }
  std::uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  // Keep 10 mantissa bits, round to nearest even on the 13 dropped ones.
  const std::uint32_t rounded = bits + 0xfffu + ((bits >> 13) & 1u);
  const std::uint32_t exponent = (rounded >> 23) - 127 + 15;
  return static_cast<std::uint16_t>(sign | (exponent << 10) | ((rounded >> 13) & 0x3ffu));
}

using namespace detail;

void forward_fp32(const HostProblem& problem, void* out) {
  forward_impl<float>(
      problem, [&](std::int64_t i, float v) { store_element(out, problem.config.dtype, i, v); });
}

void forward_fp64(const HostProblem& problem, double* out) {
  forward_impl<double>(problem, [&](std::int64_t i, double v) { out[i] = v; });
}

void backward_fp32(const HostProblem& problem, const void* grad_out, void* grad_kv,
                   void* grad_score, float* grad_ape, bool accumulate) {
  const std::int64_t n = problem.total_tokens * width_of(problem);
  const DType dtype = problem.config.dtype;
  for (std::int64_t i = 0; i < n; ++i) {
    store_element(grad_kv, dtype, i, 0.0f);
    store_element(grad_score, dtype, i, 0.0f);
  }
  // Row-ascending sums per APE element, kept apart so `accumulate` adds one total.
  std::vector<float> ape(static_cast<std::size_t>(problem.config.ratio * width_of(problem)), 0.0f);
  backward_impl<float>(problem, grad_out, [&](const Slot& sl, float ds, float gkv) {
    store_element(grad_kv, dtype, sl.offset, gkv);
    store_element(grad_score, dtype, sl.offset, ds);
    ape[sl.ape] += ds;
  });
  for (std::size_t i = 0; i < ape.size(); ++i)
    grad_ape[i] = accumulate ? grad_ape[i] + ape[i] : ape[i];
}

void backward_fp64(const HostProblem& problem, const void* grad_out, double* grad_kv,
                   double* grad_score, double* grad_ape) {
  const std::int64_t n = problem.total_tokens * width_of(problem);
  std::fill(grad_kv, grad_kv + n, 0.0);
  std::fill(grad_score, grad_score + n, 0.0);
  std::fill(grad_ape, grad_ape + problem.config.ratio * width_of(problem), 0.0);
  backward_impl<double>(problem, grad_out, [&](const Slot& sl, double ds, double gkv) {
    grad_kv[sl.offset] = gkv;
    grad_score[sl.offset] = ds;
    grad_ape[sl.ape] += ds;
  });
}

}  // namespace csa::reference
