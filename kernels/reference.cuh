// The plain reference family: one thread per output element, the SPEC §2 op order written out
// literally over all window slots (invalid slots as score -inf, kv 0). Independent of the
// fused families' code paths (its own segment search and addressing); the GPU tests compare
// the fused kernels to it bit for bit.
#pragma once
#include "csa_io.cuh"

namespace csa_kernel {

// Rows of the layout: THD row cu[s] + t, SBHD row t * B + s, for token t of segment s; `stride`
// elements apart (the packed layout: the tensor's width).
template <class IO>
struct ReferenceRows {
  template <class P>
  static __device__ long long row(const P& p, int segment, int token) {
    if (IO::kLayout == kLayoutSbhd) return static_cast<long long>(token) * p.num_segments + segment;
    return static_cast<long long>(p.cu_seqlens[segment]) + token;
  }
  static __device__ long long stride(int stride, int width) {
    return IO::kLayout == kLayoutThdPacked ? width : stride;
  }
};

template <class IO, int RATIO, int COFF, int HEAD_DIM>
struct ReferenceWindow {
  static constexpr int W = COFF * HEAD_DIM;
  static constexpr int SLOTS = COFF * RATIO;
  int segment;
  int block;  // of the row in its segment
  bool first;
  bool padding;

  // Linear scan over segments, as the eager gather's bucketize does.
  template <class P>
  __device__ ReferenceWindow(const P& p, int row) {
    segment = 0;
    block = 0;
    first = true;
    padding = true;
    if (IO::kLayout == kLayoutSbhd) {
      segment = row % p.num_segments;
      block = row / p.num_segments;
      first = block == 0;
      padding = false;
      return;
    }
    if (p.num_segments <= 0 || row >= p.cu_seqlens_comp[p.num_segments]) return;  // padding row
    for (int s = 0; s < p.num_segments; ++s) {
      if (p.cu_seqlens_comp[s] <= row && row < p.cu_seqlens_comp[s + 1]) {
        segment = s;
        block = row - p.cu_seqlens_comp[s];
        first = block == 0;
        padding = false;
      }
    }
  }
  __device__ bool valid(int k) const { return COFF == 1 || k >= RATIO || !first; }
  // Token of slot k in the segment, the column of its half, and the APE element it adds.
  __device__ int token(int k) const { return block * RATIO + k - (COFF - 1) * RATIO; }
  __device__ int column(int k, int j) const { return (COFF == 2 && k >= RATIO) ? HEAD_DIM + j : j; }
  __device__ int ape_index(int k, int j) const { return (k % RATIO) * W + column(k, j); }
  // Element offset of slot k, column j in a tensor of row stride `stride`. Padding rows read
  // block 0 of a segment starting at token 0 (row 0 of the layout).
  template <class P>
  __device__ long long offset(const P& p, long long stride, int k, int j) const {
    const long long row = padding ? token(k) : ReferenceRows<IO>::row(p, segment, token(k));
    return row * stride + column(k, j);
  }
  template <class P>
  __device__ float s(const P& p, int k, int j) const {
    if (!valid(k)) return neg_inf();
    const long long st = ReferenceRows<IO>::stride(p.score_stride, W);
    return __fadd_rn(IO::E::to_f32(IO::in(p.score)[offset(p, st, k, j)]), p.ape[ape_index(k, j)]);
  }
  template <class P>
  __device__ float kv(const P& p, int k, int j) const {
    if (!valid(k)) return 0.0f;
    const long long st = ReferenceRows<IO>::stride(p.kv_stride, W);
    return IO::E::to_f32(IO::in(p.kv)[offset(p, st, k, j)]);
  }
};

// Softmax weights of one (row, column) in the reference order.
template <class IO, int RATIO, int COFF, int HEAD_DIM, class P>
__device__ void reference_weights(const ReferenceWindow<IO, RATIO, COFF, HEAD_DIM>& w, const P& p,
                                  int j, float (&prob)[COFF * RATIO]) {
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

template <class IO, int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_forward(const __grid_constant__ ForwardParams p) {
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= static_cast<long long>(p.total_comp) * HEAD_DIM) return;
  const int row = static_cast<int>(gid / HEAD_DIM);
  const int j = static_cast<int>(gid % HEAD_DIM);
  const ReferenceWindow<IO, RATIO, COFF, HEAD_DIM> w(p, row);
  float prob[COFF * RATIO];
  reference_weights(w, p, j, prob);
  float acc = 0.0f;
  for (int k = 0; k < COFF * RATIO; ++k) acc = __fadd_rn(acc, __fmul_rn(w.kv(p, k, j), prob[k]));
  const long long os = ReferenceRows<IO>::stride(p.out_stride, HEAD_DIM);
  IO::out(p.out)[row * os + j] = IO::E::from_f32(acc);
}

template <class IO, class P>
__device__ int reference_rows_valid(const P& p) {
  if (IO::kLayout == kLayoutSbhd) return p.total_comp;
  return p.num_segments > 0 ? min(p.cu_seqlens_comp[p.num_segments], p.total_comp) : 0;
}

// ds_k of every slot of one (row, column); returns S.
template <class IO, int RATIO, int COFF, int HEAD_DIM>
__device__ void reference_slot_grads(const ReferenceWindow<IO, RATIO, COFF, HEAD_DIM>& w,
                                     const BackwardParams& p, float g, int j,
                                     float (&prob)[COFF * RATIO], float (&ds)[COFF * RATIO]) {
  constexpr int SLOTS = COFF * RATIO;
  reference_weights(w, p, j, prob);
  float S = 0.0f;
  for (int k = 0; k < SLOTS; ++k) S = __fadd_rn(S, __fmul_rn(__fmul_rn(g, w.kv(p, k, j)), prob[k]));
  for (int k = 0; k < SLOTS; ++k)
    ds[k] = __fmaf_rn(prob[k], -S, __fmul_rn(__fmul_rn(g, w.kv(p, k, j)), prob[k]));
}

template <class IO, int HEAD_DIM>
__device__ float reference_grad_out(const BackwardParams& p, int row, int j) {
  const long long gs = ReferenceRows<IO>::stride(p.grad_out_stride, HEAD_DIM);
  return IO::E::to_f32(IO::in(p.grad_out)[row * gs + j]);
}

template <class IO, int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_backward_rows(const __grid_constant__ BackwardParams p) {
  constexpr int W = COFF * HEAD_DIM;
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= static_cast<long long>(reference_rows_valid<IO>(p)) * HEAD_DIM) return;
  const int row = static_cast<int>(gid / HEAD_DIM);
  const int j = static_cast<int>(gid % HEAD_DIM);
  const ReferenceWindow<IO, RATIO, COFF, HEAD_DIM> w(p, row);
  const float g = reference_grad_out<IO, HEAD_DIM>(p, row, j);
  float prob[COFF * RATIO], ds[COFF * RATIO];
  reference_slot_grads(w, p, g, j, prob, ds);
  const long long gks = ReferenceRows<IO>::stride(p.grad_kv_stride, W);
  const long long gss = ReferenceRows<IO>::stride(p.grad_score_stride, W);
  for (int k = 0; k < COFF * RATIO; ++k) {
    if (!w.valid(k)) continue;
    IO::out(p.grad_kv)[w.offset(p, gks, k, j)] = IO::E::from_f32(__fmul_rn(g, prob[k]));
    IO::out(p.grad_score)[w.offset(p, gss, k, j)] = IO::E::from_f32(ds[k]);
  }
}

// Zeros every never-consumed (token, column), decided from the segments alone.
template <class IO, int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_backward_zeros(const __grid_constant__ BackwardParams p) {
  constexpr int W = COFF * HEAD_DIM;
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid >= static_cast<long long>(p.total_tokens) * W) return;
  const int r = static_cast<int>(gid / W);  // the layout's row
  const int c = static_cast<int>(gid % W);
  bool consumed = false;
  int seg_tokens = 0, t = 0;
  bool found = false;
  if (IO::kLayout == kLayoutSbhd) {
    seg_tokens = p.seq_len;
    t = r / p.num_segments;
    found = true;
  } else {
    for (int s = 0; s < p.num_segments; ++s) {
      const int a = p.cu_seqlens[s];
      const int b = p.cu_seqlens[s + 1];
      if (r < a || r >= b) continue;
      seg_tokens = b - a;
      t = r - a;
      found = true;
    }
  }
  if (found) {
    const int blocks = seg_tokens / RATIO;
    const int blk = t / RATIO;
    // coff 2: first-half columns are consumed by the next block's window.
    consumed = (COFF == 2 && c < HEAD_DIM) ? blk + 1 < blocks : blk < blocks;
  }
  if (!consumed) {
    const long long gks = ReferenceRows<IO>::stride(p.grad_kv_stride, W);
    const long long gss = ReferenceRows<IO>::stride(p.grad_score_stride, W);
    IO::out(p.grad_kv)[r * gks + c] = IO::E::from_f32(0.0f);
    IO::out(p.grad_score)[r * gss + c] = IO::E::from_f32(0.0f);
  }
}

// One thread per grad_ape element: the sum over valid rows in ascending order.
template <class IO, int RATIO, int COFF, int HEAD_DIM>
__global__ void reference_grad_ape(const __grid_constant__ BackwardParams p) {
  constexpr int W = COFF * HEAD_DIM;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= RATIO * W) return;
  const int a = e / W;
  const int c = e % W;
  const int slot = (COFF == 2 && c >= HEAD_DIM) ? RATIO + a : a;
  const int j = (COFF == 2 && c >= HEAD_DIM) ? c - HEAD_DIM : c;
  const int rows_valid = reference_rows_valid<IO>(p);
  float sum = 0.0f;
  for (int row = 0; row < rows_valid; ++row) {
    const ReferenceWindow<IO, RATIO, COFF, HEAD_DIM> w(p, row);
    if (!w.valid(slot)) continue;
    const float g = reference_grad_out<IO, HEAD_DIM>(p, row, j);
    float prob[COFF * RATIO], ds[COFF * RATIO];
    reference_slot_grads(w, p, g, j, prob, ds);
    sum = __fadd_rn(sum, ds[slot]);
  }
  p.grad_ape[e] = p.accumulate ? __fadd_rn(p.grad_ape[e], sum) : sum;
}

}  // namespace csa_kernel
