// Long-window family, shared pieces: the exp forms, the window's slot geometry and the
// staged form's shared-memory layout, raw bf16 vectors, and the backward's zero-writes.
#pragma once
#include "csa_io.cuh"

namespace csa_kernel {

// exp(x) = 2^(x * log2 e) with log2 e split in two fp32 parts (hi + lo), so the product keeps
// nearly fp32 accuracy before the hardware ex2. exp(-inf) = +0 and NaN propagates.
__device__ __forceinline__ float exp_fast(float x) {
  const float y = __fmaf_rn(x, 1.925963033500011e-08f, __fmul_rn(x, 1.4426950216293335f));
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
}

template <bool FAST>
__device__ __forceinline__ float softmax_exp(float x) {
  if constexpr (FAST) {
    return exp_fast(x);
  } else {
    return expf(x);
  }
}

// Slot geometry of the window (SPEC §1) and the shared-memory layout of one CTA (kv staged
// as elements of KvE).
template <int RATIO, int COFF, int HEAD_DIM, int COLS, int THREADS,
          class KvE = Element<kElementBf16>>
struct LongWindow {
  static constexpr int W = COFF * HEAD_DIM;
  static constexpr int WIN = COFF * RATIO;
  static constexpr int CHUNKS = THREADS / COLS;
  static constexpr int PER_LANE = (WIN + CHUNKS - 1) / CHUNKS;
  static_assert(THREADS % COLS == 0, "COLS must divide THREADS");
  static_assert(CHUNKS >= 1, "at least one lane per column");

  // First column of slot k's half inside a token's W columns.
  static __device__ __forceinline__ int half_offset(int k) {
    return (COFF == 2 && k >= RATIO) ? HEAD_DIM : 0;
  }
  static __device__ __forceinline__ int ape_index(int k, int col) {
    return (k % RATIO) * W + half_offset(k) + col;
  }
  static __device__ __forceinline__ bool valid(int k, bool first) {
    return !(COFF == 2 && first && k < RATIO);
  }

  // Layout (in 4-byte words): e[WIN][COLS] | red[3][CHUNKS][COLS] | col[4][COLS] | kv.
  using KvT = typename KvE::T;
  float* e;
  float* red;
  float* col;
  KvT* kv;
  static constexpr int kWords = WIN * COLS + 3 * CHUNKS * COLS + 4 * COLS;
  static constexpr int kBytes = kWords * 4 + WIN * COLS * static_cast<int>(sizeof(KvT));
  static_assert(kBytes == staged_window_bytes(sizeof(KvT) == 4 ? kElementF32 : kElementBf16, WIN,
                                              CHUNKS, COLS),
                "the host sizes the staged form's shared memory with staged_window_bytes");
  __device__ explicit LongWindow(float* smem)
      : e(smem),
        red(smem + WIN * COLS),
        col(smem + WIN * COLS + 3 * CHUNKS * COLS),
        kv(reinterpret_cast<KvT*>(smem + kWords)) {}
  __device__ float& E(int k, int c) { return e[k * COLS + c]; }
  __device__ float& Red(int which, int lane, int c) {
    return red[(which * CHUNKS + lane) * COLS + c];
  }
  __device__ float& Col(int which, int c) { return col[which * COLS + c]; }
  __device__ float KV(int k, int c) const { return KvE::to_f32(kv[k * COLS + c]); }
};

// Token of slot k relative to the row's own block start, in the segment's token order.
template <int RATIO, int COFF>
__device__ __forceinline__ int slot_token(int k) {
  return k - (COFF - 1) * RATIO;
}

// Element offset, in one tensor whose rows are `rows`, of slot k's VEC columns from `col`.
template <int RATIO, int COFF, int HEAD_DIM>
__device__ __forceinline__ long long slot_offset(const RowWindow& w, const TokenRows& rows, int k,
                                                 int col) {
  const int half = (COFF == 2 && k >= RATIO) ? HEAD_DIM : 0;
  return rows.at(w.t0) + rows.steps(slot_token<RATIO, COFF>(k)) + half + col;
}

// The forward's flat grid: CTA b takes column slice b % SLICES of row b / SLICES, so the CTAs
// resident together read adjacent slices of the same tokens (whole lines, open DRAM pages)
// rather than one narrow slice of many rows' windows.
// NOTE: rows * SLICES < 2^31 because rows * head_dim < 2^31 (host validation).
template <int SLICES>
struct ForwardTile {
  int row;
  int slice;
  __device__ __forceinline__ ForwardTile()
      : row(static_cast<int>(blockIdx.x / SLICES)), slice(static_cast<int>(blockIdx.x % SLICES)) {}
};

// 16-byte asynchronous copies global -> shared (sm_80+), bypassing L1. When `!valid` the 16
// bytes are zero-filled and nothing is read (`src` must still be a mapped address).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(saddr), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Exact zeros on `count` tokens of one segment from the layout's row `first_row` (tokens
// `step` rows apart), columns [col0, col0 + COLS) of the halves selected (first half only
// when `first_half_only`).
template <class IO, int COFF, int HEAD_DIM, int COLS, int THREADS>
__device__ __forceinline__ void zero_tokens(const BackwardParams& p, const TokenRows& gk,
                                            const TokenRows& gs, long long first_row, int step,
                                            int count, int col0, bool first_half_only) {
  constexpr int HALVES = COFF;
  const int halves = first_half_only ? 1 : HALVES;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  typename IO::T* const grad_kv = IO::out(p.grad_kv);
  typename IO::T* const grad_score = IO::out(p.grad_score);
  for (int i = tid; i < count * halves * COLS; i += THREADS) {
    const int c = i % COLS;
    const int h = (i / COLS) % halves;
    if (col0 + c >= HEAD_DIM) continue;
    // NOTE: 32-bit: a token row's elements end below 2^31 (validation bounds every tensor's
    // span), and 64-bit offsets here spilled the 64-register ring backwards.
    const int row = static_cast<int>(first_row) + (i / (COLS * halves)) * step;
    const int col = h * HEAD_DIM + col0 + c;
    grad_kv[row * static_cast<int>(gk.stride) + col] = 0;
    grad_score[row * static_cast<int>(gs.stride) + col] = 0;
  }
}

// After a segment's last block (w.last), for the CTA's columns: exact zeros on what no row
// consumes, the block's own first-half columns (coff 2) and the tail of fewer than ratio
// tokens after it.
template <class IO, int RATIO, int COFF, int HEAD_DIM, int COLS, int THREADS>
__device__ __forceinline__ void zero_after_last_block(const BackwardParams& p, const RowWindow& w,
                                                      int col0) {
  if (!w.last) return;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  const TokenRows gk = L::rows(p, p.grad_kv_stride);
  const TokenRows gs = L::rows(p, p.grad_score_stride);
  const int step = L::token_step(p);
  if (COFF == 2)
    zero_tokens<IO, COFF, HEAD_DIM, COLS, THREADS>(p, gk, gs, w.t0, step, RATIO, col0, true);
  if (w.tail > 0)
    zero_tokens<IO, COFF, HEAD_DIM, COLS, THREADS>(
        p, gk, gs, w.t0 + static_cast<long long>(RATIO) * step, step, w.tail, col0, false);
}

// Zero-writes owned by no row, for the CTA's columns: segments shorter than ratio (THD) and
// the token rows past the used ones (Layout::used_tokens), spread over the row groups
// (gridDim.x).
template <class IO, int RATIO, int COFF, int HEAD_DIM, int COLS, int THREADS>
__device__ __forceinline__ void zero_unowned(const BackwardParams& p, int col0) {
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  const TokenRows gk = L::rows(p, p.grad_kv_stride);
  const TokenRows gs = L::rows(p, p.grad_score_stride);
  const int groups = gridDim.x;
  if constexpr (L::kOffsets) {
    for (int s = blockIdx.x; s < p.num_segments; s += groups) {
      if (__ldg(p.cu_seqlens_comp + s + 1) > __ldg(p.cu_seqlens_comp + s)) continue;
      const int t_begin = clamp_i32(__ldg(p.cu_seqlens + s), 0, p.total_tokens);
      const int t_end =
          clamp_i32(__ldg(p.cu_seqlens + s + 1), t_begin, min(p.total_tokens, t_begin + RATIO - 1));
      zero_tokens<IO, COFF, HEAD_DIM, COLS, THREADS>(p, gk, gs, t_begin, 1, t_end - t_begin, col0,
                                                     false);
    }
  }
  const int used = L::used_tokens(p);
  // NOTE: 64-bit products: groups * per_group may pass 2^31.
  const long long capacity = p.total_tokens - used;
  const long long per_group = (capacity + groups - 1) / groups;
  const int t_begin = used + static_cast<int>(min(capacity, blockIdx.x * per_group));
  const int t_end = used + static_cast<int>(min(capacity, (blockIdx.x + 1) * per_group));
  if (t_end > t_begin)
    zero_tokens<IO, COFF, HEAD_DIM, COLS, THREADS>(p, gk, gs, t_begin, 1, t_end - t_begin, col0,
                                                   false);
}

}  // namespace csa_kernel
