// Correctly rounded fp32 division, square root and reciprocal without the slow paths that
// div.rn / sqrt.rn / rcp.rn call for rare operands: ptxas often keeps the caller's registers in
// local memory around such a call, although it almost never runs. The common operands take
// the compiler's own fast path, inline; the rare ones (tiny, subnormal and huge operands, zero,
// infinities) take exact power-of-two scaling, with the one double-rounding case fixed, in
// small out-of-line leaf functions that need no stack frame. Bitwise equal to __fdiv_rn,
// __fsqrt_rn and __frcp_rn on the domains stated, which the GPU tests sweep exhaustively.
// Self-contained: NVRTC needs no CUDA include directory. The CPU tests compile it for the host
// too (tests/test_exact_math.cpp), with the hardware approximations modelled as correctly
// rounded, to check the algorithms around them.
#pragma once

namespace csa_kernel {

#ifndef __CUDA_ARCH__
// The host's stand-ins for the hardware approximations, defined by the test that includes this.
float host_approx_reciprocal(float b);
float host_approx_rsqrt(float v);
#endif

// rcp.approx.ftz.f32: 1 / b within one ulp (subnormals flushed).
__device__ __forceinline__ float approx_reciprocal(float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return r;
#else
  return host_approx_reciprocal(b);
#endif
}

// rsqrt.approx.ftz.f32: 1 / sqrt(v) within a relative 2^-22.9 (subnormals flushed).
__device__ __forceinline__ float approx_rsqrt(float v) {
#ifdef __CUDA_ARCH__
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v));
  return y;
#else
  return host_approx_rsqrt(v);
#endif
}

__device__ __forceinline__ float positive_inf() {
  return __int_as_float(0x7f800000);
}

// RN(1 / b) for b in [2^-125, 2^125]: the hardware approximation and one Newton step (exact
// FMA residual), the compiler's rcp.rn fast path.
__device__ __forceinline__ float refined_reciprocal(float b) {
  const float r = approx_reciprocal(b);
  return __fmaf_rn(__fmaf_rn(-b, r, 1.0f), r, r);
}

// RN(a / b) from r = refined_reciprocal(b): quotient and one correction by the exact FMA
// remainder, the compiler's div.rn fast path. Correct while a, b and the quotient stay normal
// and the remainder cannot underflow: b in [1, 2^24] and |a| in [2^-100, FLT_MAX]
// (div_rn_fast_exact).
__device__ __forceinline__ float div_rn_fast(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(-b, q, a), r, q);
}

__device__ __forceinline__ bool div_rn_fast_exact(float a) {
  const float x = fabsf(a);
  return x >= 0x1p-100f && x <= 0x1.fffffep127f;
}

// RN(a / b) for any a and b in [1, 2^24] (or NaN), without a branch: bitwise __fdiv_rn
// there. `r` is refined_reciprocal(b). A softmax denominator (its largest term is 1) and a
// head dimension are such divisors. |a| < 2^-100 (zero and subnormals too) is scaled by 2^64:
// that quotient is normal and correctly rounded, and scaling it back is exact unless the
// result is subnormal. There it rounds a second time, which differs from one rounding only
// when qs * 2^-64 lies exactly halfway between two subnormals while the true quotient does not
// (its remainder is nonzero): then the true quotient's side of qs decides.
// NOTE: out of line on purpose. Inlined into a kernel's rare branch, its temporaries raise the
// kernel's register allocation (ptxas then spilled in cold code rather than give up a CTA an
// SM); called, it is a leaf that needs no stack frame, and the caller's values stay where
// they are.
__device__ __noinline__ float div_rn_exact(float a, float b, float r) {
  const float x = fabsf(a);
  const bool tiny = x < 0x1p-100f;
  const float xs = __fmul_rn(x, tiny ? 0x1p64f : 1.0f);
  const float qs = div_rn_fast(xs, b, r);
  const float rem = __fmaf_rn(-b, qs, xs);
  const float q = __fmul_rn(qs, tiny ? 0x1p-64f : 1.0f);
  const float off = __fsub_rn(qs, __fmul_rn(q, tiny ? 0x1p64f : 1.0f));  // exact; 0 unless tiny
  const bool tie = fabsf(off) == 0x1p-86f && rem != 0.0f;
  const float rounded = tie ? __fmul_rn(__fadd_rn(qs, copysignf(0x1p-86f, rem)), 0x1p-64f) : q;
  // inf / b = inf (NaN where b is); the fast path's remainder would be NaN.
  return copysignf(x == positive_inf() ? __fmul_rn(x, r) : rounded, a);
}

// The same, through the fast path alone where it is exact (the common case).
__device__ __forceinline__ float div_rn(float a, float b, float r) {
  return div_rn_fast_exact(a) ? div_rn_fast(a, b, r) : div_rn_exact(a, b, r);
}

// a / b for b in [1, 2^24] (or NaN) without a call, for stages under a tolerance contract:
// correctly rounded where the fast path is (|a| in [2^-100, FLT_MAX]), else a * r, within an
// ulp of the quotient (and zero, infinity or NaN where the quotient is).
__device__ __forceinline__ float div_near(float a, float b, float r) {
  return div_rn_fast_exact(a) ? div_rn_fast(a, b, r) : __fmul_rn(a, r);
}

// RN(sqrt(v)) for every v: bitwise __fsqrt_rn. The fast path is the hardware reciprocal
// square root and one correction by the exact FMA residual v - s * s. That residual is about
// v * 2^-24 and must not underflow, so the fast path starts at 2^-100; zero, smaller and huge v
// are scaled by an even power of two into its range (exactly, and back exactly: the root of a
// normal number is normal).
__device__ __forceinline__ float sqrt_rn_normal(float v) {
  const float y = approx_rsqrt(v);
  const float s = __fmul_rn(v, y);
  return __fmaf_rn(__fmaf_rn(-s, s, v), __fmul_rn(0.5f, y), s);
}

// The rare inputs.
__device__ __forceinline__ float sqrt_rn_rare(float v) {
  if (v > 0.0f && v < 0x1p-100f) return __fmul_rn(sqrt_rn_normal(__fmul_rn(v, 0x1p64f)), 0x1p-32f);
  if (v > 0x1p124f && v <= 0x1.fffffep127f)
    return __fmul_rn(sqrt_rn_normal(__fmul_rn(v, 0x1p-64f)), 0x1p32f);
  if (v == 0.0f || v == positive_inf()) return v;  // sqrt(+-0) = +-0, sqrt(inf) = inf
  return __int_as_float(0x7fffffff);               // v < 0 or NaN
}

// The rare inputs out of line, for the reason div_rn_exact is.
__device__ __noinline__ float sqrt_rn_scaled(float v) {
  return sqrt_rn_rare(v);
}

// INLINE_RARE: the rare path inline, for a small kernel in which the call took a stack frame
// (tail_row_stats).
template <bool INLINE_RARE = false>
__device__ __forceinline__ float sqrt_rn(float v) {
  if (v >= 0x1p-100f && v <= 0x1p124f) return sqrt_rn_normal(v);
  return INLINE_RARE ? sqrt_rn_rare(v) : sqrt_rn_scaled(v);
}

// RN(1 / x) for |x| in [2^-125, 2^125] (the reciprocal stays normal), zero, infinity or NaN:
// bitwise __frcp_rn there. A square root of [0, FLT_MAX] is such an x.
__device__ __forceinline__ float rcp_rn(float x) {
  if (x == 0.0f) return copysignf(positive_inf(), x);
  if (fabsf(x) == positive_inf()) return copysignf(0.0f, x);
  return refined_reciprocal(x);
}

}  // namespace csa_kernel
