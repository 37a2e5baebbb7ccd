// Fixed-order sum of the per-row-group grad_ape partials (and the tail's grad_w partials after
// them): bitwise deterministic, and the one place where overwrite or accumulate is decided.
#pragma once
#include "csa_common.cuh"

namespace csa_kernel {

// Block (32, LANES): lane y sums groups y, y+LANES, ... in order; the LANES partial sums are
// then added in lane order.
template <int LANES>
__global__ void __launch_bounds__(32 * LANES)
    ape_reduce(const __grid_constant__ ApeReduceParams p) {
  pdl_enter(p.dependents_first != 0);
  __shared__ float part[LANES][32];
  const int e = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (e < p.elements) {
#pragma unroll 8
    for (int g = threadIdx.y; g < p.groups; g += LANES)
      s = __fadd_rn(s, p.workspace[static_cast<long long>(g) * p.elements + e]);
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || e >= p.elements) return;
  float total = part[0][threadIdx.x];
#pragma unroll
  for (int y = 1; y < LANES; ++y) total = __fadd_rn(total, part[y][threadIdx.x]);
  float* const dst = e < p.ape_elements ? p.grad_ape + e : p.grad_w + (e - p.ape_elements);
  *dst = p.accumulate ? __fadd_rn(*dst, total) : total;
}

// The same fixed-order sum for few groups over many elements (the long-window backward with
// at most 16 row groups, of ratio * W floats each): each thread sums 4 consecutive
// elements (16-byte loads) over groups lane, lane + LANES, ... in order, then the LANES lane
// sums are added in lane order. Block (256 / LANES, LANES): always 256 threads, so a few
// groups need no more CTAs than many. Needs elements % 4 == 0 and 16-byte aligned buffers.
template <int LANES>
__global__ void __launch_bounds__(256) ape_reduce_quads(const __grid_constant__ ApeReduceParams p) {
  pdl_enter(p.dependents_first != 0);
  constexpr int X = 256 / LANES;
  __shared__ float4 part[LANES][X];
  const int quads = p.elements / 4;
  const int q = blockIdx.x * X + threadIdx.x;
  float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (q < quads) {
    const float4* src = reinterpret_cast<const float4*>(p.workspace) + q;
#pragma unroll 8
    for (int g = threadIdx.y; g < p.groups; g += LANES) {
      // NOTE: the partials' writer is this kernel's programmatic predecessor.
      add_rn_into(s, load_written(src + static_cast<long long>(g) * quads));
    }
  }
  if constexpr (LANES > 1) {
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y != 0) return;
#pragma unroll
    for (int y = 1; y < LANES; ++y) add_rn_into(s, part[y][threadIdx.x]);
  }
  if (q >= quads) return;
  float4* dst = reinterpret_cast<float4*>(p.grad_ape) + q;
  if (p.accumulate) {
    float4 a = *dst;  // grad_ape + sum, in that order
    add_rn_into(a, s);
    s = a;
  }
  *dst = s;
}

// Checks the offset arrays on the device; reports the first inconsistency.
// Rules: 1 cu[0] != 0 or cuc[0] != 0; 2 cu decreasing; 3 cu[B] > total_tokens;
// 4 cuc step != floor(seqlen / ratio); 5 cuc[B] > total_comp.
__global__ void check_offsets(const __grid_constant__ OffsetCheckParams p) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int bad = -1;
  int rule = 0;
  if (__ldg(p.cu_seqlens) != 0 || __ldg(p.cu_seqlens_comp) != 0) {
    bad = 0;
    rule = 1;
  }
  for (int s = 0; s < p.num_segments && bad < 0; ++s) {
    const int a = __ldg(p.cu_seqlens + s);
    const int b = __ldg(p.cu_seqlens + s + 1);
    if (b < a) {
      bad = s + 1;
      rule = 2;
    } else if (b > p.total_tokens) {
      bad = s + 1;
      rule = 3;
    } else if (__ldg(p.cu_seqlens_comp + s + 1) - __ldg(p.cu_seqlens_comp + s) !=
               (b - a) / p.ratio) {
      bad = s + 1;
      rule = 4;
    } else if (__ldg(p.cu_seqlens_comp + s + 1) > p.total_comp) {
      bad = s + 1;
      rule = 5;
    }
  }
  p.report[0] = bad;
  p.report[1] = rule;
}

}  // namespace csa_kernel
