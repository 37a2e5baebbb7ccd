// The plain reference family: one thread per output element, the SPEC §2 op order written out
// literally over all window slots (invalid slots as score -inf, kv 0). Independent of the
// fused families' code paths; the GPU tests compare the fused kernels to it bit for bit.
#pragma once
#include "csa_common.cuh"

namespace csa_kernel {

template <int RATIO, int COFF, int HEAD_DIM>
struct ReferenceWindow {
  static constexpr int W = COFF * HEAD_DIM;
  static constexpr int SLOTS = COFF * RATIO;
  int t0;
  bool first;

  // Linear scan over segments, as the eager gather's bucketize does.
  __device__ ReferenceWindow(const int* cu, const int* cuc, int num_segments, int row) {
    t0 = 0;
    first = true;
    if (num_segments <= 0 || row >= cuc[num_segments]) return;  // padding row
    for (int s = 0; s < num_segments; ++s) {
      if (cuc[s] <= row && row < cuc[s + 1]) {
        t0 = cu[s] + (row - cuc[s]) * RATIO;
        first = row == cuc[s];
      }
    }
  }
  __device__ bool valid(int k) const { return COFF == 1 || k >= RATIO || !first; }
  // Flat offset of slot k, column j into kv / score, and the APE element it adds.
  __device__ int offset(int k, int j) const {
    if (COFF == 1) return (t0 + k) * W + j;
    return k < RATIO ? (t0 - RATIO + k) * W + j : (t0 + k - RATIO) * W + HEAD_DIM + j;
  }
  __device__ int ape_index(int k, int j) const {
    if (COFF == 1) return k * W + j;
    return k < RATIO ? k * W + j : (k - RATIO) * W + HEAD_DIM + j;
  }
  __device__ float s(const ForwardParams& p, int k, int j) const {
    return valid(k) ? __fadd_rn(bf16_to_f32(p.score[offset(k, j)]), p.ape[ape_index(k, j)])
                    : neg_inf();
  }
  __device__ float kv(const unsigned short* kvp, int k, int j) const {
    return valid(k) ? bf16_to_f32(kvp[offset(k, j)]) : 0.0f;
  }
};

// Softmax weights of one (row, column) in the reference order.
template <int RATIO, int COFF, int HEAD_DIM>
__device__ void reference_weights(const ReferenceWindow<RATIO, COFF, HEAD_DIM>& w,
                                  const ForwardParams& p, int j, float (&prob)[COFF * RATIO]) {
  constexpr int SLOTS = COFF * RATIO;
  float m = neg_inf();
  for (int k = 0; k < SLOTS; ++k) m = fmaxf(m, w.s(p, k, j));
  float den = 0.0f;
  for (int k = 0; k < SLOTS; ++k) {
    prob[k] = expf(__fsub_rn(w.s(p, k, j), m));
    den = __fadd_rn(den, prob[k]);
  }
  for (int k = 0; k < SLOTS; ++k) prob[k] = __fdiv_rn(prob[k], den);
}

template <int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_forward(const __grid_constant__ ForwardParams p) {
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= static_cast<long long>(p.total_comp) * HEAD_DIM) return;
  const int row = static_cast<int>(gid / HEAD_DIM);
  const int j = static_cast<int>(gid % HEAD_DIM);
  const ReferenceWindow<RATIO, COFF, HEAD_DIM> w(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments,
                                                 row);
  float prob[COFF * RATIO];
  reference_weights(w, p, j, prob);
  float acc = 0.0f;
  for (int k = 0; k < COFF * RATIO; ++k) acc = __fadd_rn(acc, __fmul_rn(w.kv(p.kv, k, j), prob[k]));
  p.out[row * HEAD_DIM + j] = f32_to_bf16(acc);
}

__device__ inline ForwardParams forward_view(const BackwardParams& b) {
  ForwardParams f;
  f.kv = b.kv;
  f.score = b.score;
  f.ape = b.ape;
  f.cu_seqlens = b.cu_seqlens;
  f.cu_seqlens_comp = b.cu_seqlens_comp;
  f.out = nullptr;
  f.total_tokens = b.total_tokens;
  f.num_segments = b.num_segments;
  f.total_comp = b.total_comp;
  f.prefetch_early = 0;
  return f;
}

// ds_k of every slot of one (row, column); returns S.
template <int RATIO, int COFF, int HEAD_DIM>
__device__ void reference_slot_grads(const ReferenceWindow<RATIO, COFF, HEAD_DIM>& w,
                                     const ForwardParams& f, float g, int j,
                                     float (&prob)[COFF * RATIO], float (&ds)[COFF * RATIO]) {
  constexpr int SLOTS = COFF * RATIO;
  reference_weights(w, f, j, prob);
  float S = 0.0f;
  for (int k = 0; k < SLOTS; ++k)
    S = __fadd_rn(S, __fmul_rn(__fmul_rn(g, w.kv(f.kv, k, j)), prob[k]));
  for (int k = 0; k < SLOTS; ++k)
    ds[k] = __fmaf_rn(prob[k], -S, __fmul_rn(__fmul_rn(g, w.kv(f.kv, k, j)), prob[k]));
}

template <int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_backward_rows(const __grid_constant__ BackwardParams p) {
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int rows_valid =
      p.num_segments > 0 ? min(p.cu_seqlens_comp[p.num_segments], p.total_comp) : 0;
  if (gid >= static_cast<long long>(rows_valid) * HEAD_DIM) return;
  const int row = static_cast<int>(gid / HEAD_DIM);
  const int j = static_cast<int>(gid % HEAD_DIM);
  const ForwardParams f = forward_view(p);
  const ReferenceWindow<RATIO, COFF, HEAD_DIM> w(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments,
                                                 row);
  const float g = bf16_to_f32(p.grad_out[row * HEAD_DIM + j]);
  float prob[COFF * RATIO], ds[COFF * RATIO];
  reference_slot_grads(w, f, g, j, prob, ds);
  for (int k = 0; k < COFF * RATIO; ++k) {
    if (!w.valid(k)) continue;
    p.grad_kv[w.offset(k, j)] = f32_to_bf16(__fmul_rn(g, prob[k]));
    p.grad_score[w.offset(k, j)] = f32_to_bf16(ds[k]);
  }
}

// Zeros every never-consumed (token, column), decided from cu_seqlens alone.
template <int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_backward_zeros(const __grid_constant__ BackwardParams p) {
  constexpr int W = COFF * HEAD_DIM;
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= static_cast<long long>(p.total_tokens) * W) return;
  const int t = static_cast<int>(gid / W);
  const int c = static_cast<int>(gid % W);
  bool consumed = false;
  for (int s = 0; s < p.num_segments; ++s) {
    const int a = p.cu_seqlens[s];
    const int b = p.cu_seqlens[s + 1];
    if (t < a || t >= b) continue;
    const int blocks = (b - a) / RATIO;
    const int blk = (t - a) / RATIO;
    // coff 2: first-half columns are consumed by the next block's window.
    consumed = (COFF == 2 && c < HEAD_DIM) ? blk + 1 < blocks : blk < blocks;
  }
  if (!consumed) {
    p.grad_kv[gid] = 0;
    p.grad_score[gid] = 0;
  }
}

// One thread per grad_ape element: the sum over valid rows in ascending order.
template <int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_grad_ape(const __grid_constant__ BackwardParams p) {
  constexpr int W = COFF * HEAD_DIM;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= RATIO * W) return;
  const int a = e / W;
  const int c = e % W;
  const int slot = (COFF == 2 && c >= HEAD_DIM) ? RATIO + a : a;
  const int j = (COFF == 2 && c >= HEAD_DIM) ? c - HEAD_DIM : c;
  const ForwardParams f = forward_view(p);
  const int rows_valid =
      p.num_segments > 0 ? min(p.cu_seqlens_comp[p.num_segments], p.total_comp) : 0;
  float sum = 0.0f;
  for (int row = 0; row < rows_valid; ++row) {
    const ReferenceWindow<RATIO, COFF, HEAD_DIM> w(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments,
                                                   row);
    if (!w.valid(slot)) continue;
    const float g = bf16_to_f32(p.grad_out[row * HEAD_DIM + j]);
    float prob[COFF * RATIO], ds[COFF * RATIO];
    reference_slot_grads(w, f, g, j, prob, ds);
    sum = __fadd_rn(sum, ds[slot]);
  }
  p.grad_ape[e] = p.accumulate ? __fadd_rn(p.grad_ape[e], sum) : sum;
}

}  // namespace csa_kernel
