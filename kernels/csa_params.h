// The by-value kernel arguments, shared by the host (C++) and the kernels (NVRTC).
// NOTE: the layout must be identical on both sides: only 8-byte pointers and 4-byte ints,
// ordered so that no padding differs between compilers.
#pragma once

#ifdef __CUDACC_RTC__
typedef int csa_i32;
typedef unsigned short csa_u16;
#else
#include <cstdint>
typedef std::int32_t csa_i32;
typedef std::uint16_t csa_u16;
#endif

namespace csa_kernel {

struct ForwardParams {
  const csa_u16* kv;
  const csa_u16* score;
  const float* ape;
  const csa_i32* cu_seqlens;
  const csa_i32* cu_seqlens_comp;
  csa_u16* out;
  csa_i32 total_tokens;
  csa_i32 num_segments;
  csa_i32 total_comp;
  csa_i32 prefetch_early;  // lane-window forward: prefetch the window before the wait (host)
};

struct BackwardParams {
  const csa_u16* kv;
  const csa_u16* score;
  const float* ape;
  const csa_i32* cu_seqlens;
  const csa_i32* cu_seqlens_comp;
  const csa_u16* grad_out;
  csa_u16* grad_kv;
  csa_u16* grad_score;
  float* grad_ape;  // atomic mode: the adds go straight into it
  // Fixed-order mode: one (ratio, W) partial per row group. Atomic mode: null (grad_ape zeroed
  // by the host, or accumulated into), or claim words (8 bytes, one per column block, zero
  // when allocated and left so by every launch), with which the kernel zeroes grad_ape itself
  // first (claim_zero_if_first).
  float* workspace;
  csa_i32 total_tokens;
  csa_i32 num_segments;
  csa_i32 total_comp;
  csa_i32 rows_per_cta;
  csa_i32 accumulate;  // reference family: add into grad_ape instead of overwriting
};

struct ApeReduceParams {
  const float* workspace;
  float* grad_ape;
  csa_i32 elements;  // ratio * W
  csa_i32 groups;    // row groups written by the backward kernel
  csa_i32 accumulate;
  csa_i32 dependents_first;  // the grid is one wave: see pdl_enter()
};

struct OffsetCheckParams {
  const csa_i32* cu_seqlens;
  const csa_i32* cu_seqlens_comp;
  csa_i32* report;  // [0]: first bad index or -1, [1]: rule id
  csa_i32 num_segments;
  csa_i32 total_tokens;
  csa_i32 total_comp;
  csa_i32 ratio;
};

}  // namespace csa_kernel
