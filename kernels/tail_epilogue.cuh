// The tail epilogue: RMSNorm, RoPE and the Hadamard transform of each pooled row in fp32, y
// rounded once, and their backward into the pooled row's gradient (docs/user-guide.md, "The
// tail"). A row's columns are held by NCV = HEAD_DIM / VEC consecutive threads of one CTA (by
// linear thread index `tid`: the forward's row-major thread order with THREADS a multiple of
// NCV, the backward's TX = NCV), so every thread of a row calls it, in the forward threads
// without a row too: the row's sums and the Hadamard butterflies cross threads by shuffles
// within a warp and by shared memory across warps.
#pragma once
#include "csa_io.cuh"

namespace csa_kernel {

// d^-1/2 for a power of two d = 2^k, as the nearest fp32: 2^-k/2, or 2^-(k-1)/2 / sqrt(2).
template <int HEAD_DIM>
__device__ __forceinline__ constexpr float hadamard_scale() {
  int k = 0;
  while ((1 << k) < HEAD_DIM) ++k;
  float s = k % 2 == 0 ? 1.0f : 0.70710678118654752440f;
  for (int i = 0; i < k / 2; ++i) s *= 0.5f;
  return s;
}

// The barrier of one row's warps (NCV threads, whole warps): a named barrier per row where the
// CTA holds at most 15 rows (ids 1..15; 0 is __syncthreads), so that a row waits only for its
// own warps, not for the other rows' loads; else the CTA's barrier.
// NOTE: the CTA's barrier needs every thread of the CTA at it: where it is taken (one row, or
// more than 15), every row must run the same number of barriers.
template <int NCV, int THREADS>
__device__ __forceinline__ void row_barrier(int tid) {
  constexpr int ROWS = THREADS / NCV;
  if constexpr (ROWS == 1 || ROWS > 15) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + tid / NCV), "r"(NCV) : "memory");
  }
}

// The sums of N values per thread over the NCV threads of each row, the same bits in every
// thread of the row (a butterfly, then the row's warps in order). `red`: N floats per warp.
// NOTE: across warps it takes one row barrier; `red` may be written again only after another
// (the backward alternates two by row parity).
template <int NCV, int THREADS, int N>
__device__ __forceinline__ void row_sums(float (&s)[N], float* red, int tid) {
  constexpr int WIDTH = NCV < 32 ? NCV : 32;
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) s[i] = __fadd_rn(s[i], __shfl_xor_sync(0xffffffffu, s[i], o));
  if constexpr (NCV > 32) {
    constexpr int WARPS = NCV / 32;
    if (tid % 32 == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) red[i * (THREADS / 32) + tid / 32] = s[i];
    }
    row_barrier<NCV, THREADS>(tid);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float* mine = red + i * (THREADS / 32) + (tid / NCV) * WARPS;
      s[i] = mine[0];
#pragma unroll
      for (int w = 1; w < WARPS; ++w) s[i] = __fadd_rn(s[i], mine[w]);
    }
  }
}

template <int KIND>
struct TailEpilogue {
  static constexpr bool kNorm = (KIND & kTailNorm) != 0;
  static constexpr bool kWeightF32 = (KIND & kTailNormWeightF32) != 0;
  static constexpr int kRopeDim = tail_rope_dim(KIND);
  static constexpr bool kInterleaved = (KIND & kTailRopeInterleaved) != 0;
  static constexpr bool kHadamard = (KIND & kTailHadamard) != 0;
  // The backward's row-stats form (kTailRowStats): each thread its own columns, from the row
  // scalars of tail_row_stats; else every thread of a row takes part in the row's tail.
  static constexpr bool kRowStats = (KIND & kTailRowStats) != 0;
  // The long-window forward's row-kernel form (kTailRowKernel): the pooling writes the fp32
  // pooled rows, tail_rows_forward the rows' tail.
  static constexpr bool kRowKernel = (KIND & kTailRowKernel) != 0;
  // The long-window forward's cluster form (kTailCluster): a row's slices are one cluster.
  static constexpr bool kCluster = (KIND & kTailCluster) != 0;
  static constexpr bool kCooperative = !kRowStats && !kRowKernel;
  static_assert((kRowStats ? 1 : 0) + (kRowKernel ? 1 : 0) + (kCluster ? 1 : 0) <= 1,
                "one form a policy");
  static_assert(
      !kRowStats || (kNorm && !kHadamard),
      "the row-stats form serves a tail with the norm and without the Hadamard transform");

  // The operands of this thread's columns (the norm weight) and of its row (RoPE's cos and sin
  // at the row's block).
  template <int VEC>
  struct Operands {
    float w[kNorm ? VEC : 1];
    float cos[kRopeDim > 0 ? VEC : 1];
    float sin[kRopeDim > 0 ? VEC : 1];
  };

  // The other column of column c's RoPE pair (c itself outside the rotated columns).
  template <int HEAD_DIM>
  static __device__ __forceinline__ int pair_partner(int c) {
    constexpr int FIRST = HEAD_DIM - kRopeDim;
    constexpr int HALF = kRopeDim / 2;
    if (c < FIRST) return c;
    if constexpr (kInterleaved) {
      return c ^ 1;  // FIRST is even
    } else {
      return c < FIRST + HALF ? c + HALF : c - HALF;
    }
  }

  // RoPE pair index of column c (its table column), or -1 outside the rotated columns.
  template <int HEAD_DIM>
  static __device__ __forceinline__ int pair_of(int c) {
    constexpr int FIRST = HEAD_DIM - kRopeDim;
    constexpr int HALF = kRopeDim / 2;
    if (c < FIRST) return -1;
    if constexpr (kInterleaved) {
      return (c - FIRST) / 2;
    } else {
      return c < FIRST + HALF ? c - FIRST : c - FIRST - HALF;
    }
  }

  // Thread-private shared-memory slots of the operands, [array][VEC][THREADS] (consecutive
  // threads on consecutive banks): the weight (bf16: the 32-bit word holding the element),
  // cos, sin.
  static constexpr int kArrays = (kNorm ? 1 : 0) + (kRopeDim > 0 ? 2 : 0);
  template <int VEC, int THREADS>
  static __device__ __forceinline__ float* staging() {
    __shared__ float slots[(kArrays > 0 ? kArrays : 1) * VEC * THREADS];
    return slots;
  }
  template <int VEC, int THREADS>
  static __device__ __forceinline__ float& slot(int array, int v, int tid) {
    return staging<VEC, THREADS>()[(array * VEC + v) * THREADS + tid];
  }
  static __device__ __forceinline__ void cp_async_4(float* dst, const void* src) {
    const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(saddr), "l"(src) : "memory");
  }

  // Issues the copies of this thread's operands (a row's thread, right after its window is
  // located): their L2 round trip then overlaps the window's DRAM one, and no register holds
  // them meanwhile (in registers they cost the wide kernel 21 of them).
  template <int VEC, int HEAD_DIM, int THREADS, class P>
  static __device__ __forceinline__ void stage_operands(const P& p, int col, int block, int tid) {
    if constexpr (kNorm) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const void* src =
            kWeightF32
                ? static_cast<const void*>(static_cast<const float*>(p.norm_weight) + col + v)
                : static_cast<const void*>(static_cast<const unsigned*>(p.norm_weight) +
                                           ((col + v) >> 1));
        cp_async_4(&slot<VEC, THREADS>(0, v, tid), src);
      }
    }
    if constexpr (kRopeDim > 0) {
      constexpr int COS = kNorm ? 1 : 0;
      const int b = min(block, p.rope_max_blocks - 1);
      const long long base = static_cast<long long>(b) * (kRopeDim / 2);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int i = pair_of<HEAD_DIM>(col + v);
        if (i < 0) continue;
        cp_async_4(&slot<VEC, THREADS>(COS, v, tid), p.rope_cos + base + i);
        cp_async_4(&slot<VEC, THREADS>(COS + 1, v, tid), p.rope_sin + base + i);
      }
    }
    if constexpr (kArrays > 0) asm volatile("cp.async.commit_group;" ::: "memory");
  }

  // The staged operands, once this thread's copies landed. NOTE: threads without a row staged
  // nothing and read stale slots; their rows are never stored and no row's sums mix them in.
  template <int VEC, int THREADS>
  static __device__ __forceinline__ void load_operands(int col, int tid, Operands<VEC>& op) {
    if constexpr (kArrays > 0) asm volatile("cp.async.wait_all;" ::: "memory");
    if constexpr (kNorm) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float staged = slot<VEC, THREADS>(0, v, tid);
        if constexpr (kWeightF32) {
          op.w[v] = staged;
        } else {
          const unsigned word = __float_as_uint(staged);
          op.w[v] = bf16_to_f32(static_cast<unsigned short>(((col + v) & 1) ? word >> 16 : word));
        }
      }
    }
    if constexpr (kRopeDim > 0) {
      constexpr int COS = kNorm ? 1 : 0;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        op.cos[v] = slot<VEC, THREADS>(COS, v, tid);
        op.sin[v] = slot<VEC, THREADS>(COS + 1, v, tid);
      }
    }
  }

  // 1 / sqrt(Σx² / d + eps); Σx² / d is exact as a product where d is a power of two (the tail
  // is under the tolerance contract: elsewhere the division may round its rare operands twice).
  // INLINE_RARE: sqrt_rn's.
  template <int HEAD_DIM, bool INLINE_RARE = false>
  static __device__ __forceinline__ float rstd_of(float sum_sq, float eps) {
    const float mean = (HEAD_DIM & (HEAD_DIM - 1)) == 0
                           ? __fmul_rn(sum_sq, 1.0f / static_cast<float>(HEAD_DIM))
                           : div_near(sum_sq, static_cast<float>(HEAD_DIM), 1.0f / HEAD_DIM);
    return rcp_rn(sqrt_rn<INLINE_RARE>(__fadd_rn(mean, eps)));
  }

  // n = (x · rstd) · w; returns rstd.
  template <int VEC, int HEAD_DIM, int NCV, int THREADS>
  static __device__ __forceinline__ float norm(const ForwardParams& p, const Operands<VEC>& op,
                                               float (&x)[VEC], float* red, int tid) {
    float ss[1] = {0.0f};
#pragma unroll
    for (int v = 0; v < VEC; ++v) ss[0] = __fadd_rn(ss[0], __fmul_rn(x[v], x[v]));
    row_sums<NCV, THREADS>(ss, red, tid);
    const float rstd = rstd_of<HEAD_DIM>(ss[0], p.eps);
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = __fmul_rn(__fmul_rn(x[v], rstd), op.w[v]);
    return rstd;
  }

  // The rotation of one pair's column: `own` its value, `other` the pair's other one, `lower`
  // whether own is the pair's first column. Forward: a' = a·cos − b·sin, b' = a·sin + b·cos;
  // transposed (backward): ga = ga'·cos + gb'·sin, gb = gb'·cos − ga'·sin.
  template <bool TRANSPOSED>
  static __device__ __forceinline__ float rotate(float own, float other, bool lower, float co,
                                                 float si) {
    if constexpr (TRANSPOSED) {
      return lower ? __fadd_rn(__fmul_rn(own, co), __fmul_rn(other, si))
                   : __fsub_rn(__fmul_rn(own, co), __fmul_rn(other, si));
    } else {
      return lower ? __fsub_rn(__fmul_rn(own, co), __fmul_rn(other, si))
                   : __fadd_rn(__fmul_rn(other, si), __fmul_rn(own, co));
    }
  }

  // RoPE on the pairs of the last kRopeDim columns (or its transpose).
  template <bool TRANSPOSED, int VEC, int HEAD_DIM, int NCV, int THREADS>
  static __device__ __forceinline__ void rope(int col, const Operands<VEC>& op, float (&x)[VEC],
                                              float* xs, int tid) {
    constexpr int FIRST = HEAD_DIM - kRopeDim;
    constexpr int HALF = kRopeDim / 2;
    if constexpr (kInterleaved && VEC % 2 == 0) {
      // A pair's two columns are in one thread (col and FIRST are even).
#pragma unroll
      for (int v = 0; v < VEC; v += 2) {
        if (col + v < FIRST) continue;
        const float a = x[v];
        const float b = x[v + 1];
        x[v] = rotate<TRANSPOSED>(a, b, true, op.cos[v], op.sin[v]);
        x[v + 1] = rotate<TRANSPOSED>(b, a, false, op.cos[v], op.sin[v]);
      }
    } else if constexpr (kInterleaved) {
      // VEC 1: the pair's other column is the neighbouring thread's (lane ^ 1).
      const float other = __shfl_xor_sync(0xffffffffu, x[0], 1);
      if (col >= FIRST)
        x[0] = rotate<TRANSPOSED>(x[0], other, (col - FIRST) % 2 == 0, op.cos[0], op.sin[0]);
    } else {
      // Half-split pairs (i, i + HALF) cross threads: exchanged through the CTA's rows.
      // NOTE: the transposed rotation follows the Hadamard transform, whose last stage may have
      // read this buffer: a barrier first.
      if constexpr (TRANSPOSED && kHadamard) row_barrier<NCV, THREADS>(tid);
      float* const row_xs = xs + (tid / NCV) * HEAD_DIM;
#pragma unroll
      for (int v = 0; v < VEC; ++v) row_xs[col + v] = x[v];
      row_barrier<NCV, THREADS>(tid);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int c = col + v;
        if (c < FIRST) continue;
        const bool lower = c < FIRST + HALF;
        x[v] = rotate<TRANSPOSED>(x[v], row_xs[lower ? c + HALF : c - HALF], lower, op.cos[v],
                                  op.sin[v]);
      }
      row_barrier<NCV, THREADS>(tid);  // row_xs is free again
    }
  }

  // The row's exchange buffers of the Hadamard transform's cross-warp stages: two, used in
  // turn, so that a stage (or the next row) writes one while no thread still reads it from the
  // stage before, with one barrier a stage.
  static constexpr int kExchangeBuffers = kHadamard ? 2 : 1;

  // The butterflies of strides 1, 2, 4, ... (a + b, a − b), then the product by d^-1/2; with
  // N > 0 also the row's sums of the N values `s` per thread (row_sums's order and bits),
  // reduced alongside: their shuffles interleaved with the butterflies', their cross-warp step
  // behind the first cross-warp stage's barrier. `xs`: kExchangeBuffers buffers of THREADS * VEC
  // floats, `buffer` the first stage's; `red`: N floats a warp.
  // NOTE: one row barrier a cross-warp stage and none after the last: the caller's next write
  // of a buffer must follow another barrier of the row (the next stage's, the next row's sums,
  // or the caller's own).
  template <int VEC, int HEAD_DIM, int NCV, int THREADS, int N>
  static __device__ __forceinline__ void hadamard(float (&x)[VEC], float (&s)[N > 0 ? N : 1],
                                                  float* xs, float* red, int tid, int buffer) {
    static_assert((HEAD_DIM & (HEAD_DIM - 1)) == 0, "the Hadamard transform needs 2^k columns");
    constexpr int WIDTH = NCV < 32 ? NCV : 32;
#pragma unroll
    for (int h = 1; h < VEC; h <<= 1)
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        if (v & h) continue;
        const float a = x[v];
        const float b = x[v + h];
        x[v] = __fadd_rn(a, b);
        x[v + h] = __fsub_rn(a, b);
      }
    const int lane = tid % NCV;  // the row's thread: columns lane * VEC ...
    // Within the warp: the butterflies' strides upward, the sums' downward (row_sums's order).
#pragma unroll
    for (int m = 1, o = WIDTH / 2; m < WIDTH; m <<= 1, o >>= 1) {
      float other[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) other[v] = __shfl_xor_sync(0xffffffffu, x[v], m);
#pragma unroll
      for (int i = 0; i < N; ++i) s[i] = __fadd_rn(s[i], __shfl_xor_sync(0xffffffffu, s[i], o));
      const bool upper = (lane & m) != 0;
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        x[v] = upper ? __fsub_rn(other[v], x[v]) : __fadd_rn(x[v], other[v]);
    }
    // Across the row's warps: the partner thread is tid ^ m (NCV is 2^k).
#pragma unroll
    for (int m = 32; m < NCV; m <<= 1) {
      float* const stage = xs + (buffer & (kExchangeBuffers - 1)) * (THREADS * VEC);
      buffer ^= 1;
#pragma unroll
      for (int v = 0; v < VEC; ++v) stage[tid * VEC + v] = x[v];
      if (N > 0 && m == 32 && tid % 32 == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) red[i * (THREADS / 32) + tid / 32] = s[i];
      }
      row_barrier<NCV, THREADS>(tid);
      float other[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) other[v] = stage[(tid ^ m) * VEC + v];
      if (N > 0 && m == 32) {
        constexpr int WARPS = NCV / 32;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const float* mine = red + i * (THREADS / 32) + (tid / NCV) * WARPS;
          s[i] = mine[0];
#pragma unroll
          for (int w = 1; w < WARPS; ++w) s[i] = __fadd_rn(s[i], mine[w]);
        }
      }
      const bool upper = (lane & m) != 0;
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        x[v] = upper ? __fsub_rn(other[v], x[v]) : __fadd_rn(x[v], other[v]);
    }
    constexpr float kScale = hadamard_scale<HEAD_DIM>();
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = __fmul_rn(x[v], kScale);
  }

  // The operands of this thread's columns and of its row's block read straight into registers,
  // for kernels whose cp.async groups count something else (the long-window backward's ring).
  template <int VEC, int HEAD_DIM, class P>
  static __device__ __forceinline__ void read_operands(const P& p, int col, int block,
                                                       Operands<VEC>& op) {
    if constexpr (kNorm) {
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        op.w[v] =
            kWeightF32
                ? __ldg(static_cast<const float*>(p.norm_weight) + col + v)
                : bf16_to_f32(__ldg(static_cast<const unsigned short*>(p.norm_weight) + col + v));
    }
    if constexpr (kRopeDim > 0) {
      const long long base =
          static_cast<long long>(min(block, p.rope_max_blocks - 1)) * (kRopeDim / 2);
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int i = pair_of<HEAD_DIM>(col + v);
        op.cos[v] = i < 0 ? 0.0f : __ldg(p.rope_cos + base + i);
        op.sin[v] = i < 0 ? 0.0f : __ldg(p.rope_sin + base + i);
      }
    }
  }

  // Every thread of the CTA: `x` its VEC columns of row `row` from column `col` (operands
  // staged by stage_operands where has_row), stored to `dst` where has_row.
  template <class E, int VEC, int HEAD_DIM, int THREADS>
  static __device__ __forceinline__ void store_row(const ForwardParams& p, typename E::T* dst,
                                                   int row, int col, bool has_row,
                                                   float (&x)[VEC]) {
    Operands<VEC> op;
    load_operands<VEC, THREADS>(col, threadIdx.x, op);
    store_row_with<E, VEC, HEAD_DIM, THREADS>(p, op, dst, row, col, has_row, x, threadIdx.x);
  }

  // store_row with the operands in hand; `tid` the thread's linear index in the CTA.
  template <class E, int VEC, int HEAD_DIM, int THREADS>
  static __device__ __forceinline__ void store_row_with(const ForwardParams& p,
                                                        const Operands<VEC>& op, typename E::T* dst,
                                                        int row, int col, bool has_row,
                                                        float (&x)[VEC], int tid) {
    constexpr int NCV = HEAD_DIM / VEC;
    static_assert(tail_row_threads_ok(NCV) && THREADS % NCV == 0 && THREADS % 32 == 0,
                  "a tail kernel's CTA holds whole rows in whole warps");
    // The CTA's rows, row-major (kExchangeBuffers copies).
    __shared__ __align__(16) float xs[kExchangeBuffers * THREADS * VEC];
    __shared__ float red[THREADS / 32];
    if constexpr (kHadamard) {
      // The stages after the norm's product are linear: the row is weighted, rotated and
      // transformed first and multiplied by rstd last, so that the row's sum of squares is
      // reduced alongside the butterflies rather than before them.
      float ss[1] = {0.0f};
      if constexpr (kNorm) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          ss[0] = __fadd_rn(ss[0], __fmul_rn(x[v], x[v]));
          x[v] = __fmul_rn(x[v], op.w[v]);
        }
      }
      if constexpr (kRopeDim > 0) rope<false, VEC, HEAD_DIM, NCV, THREADS>(col, op, x, xs, tid);
      hadamard<VEC, HEAD_DIM, NCV, THREADS, kNorm ? 1 : 0>(x, ss, xs, red, tid, 0);
      if constexpr (kNorm) {
        const float rstd = rstd_of<HEAD_DIM>(ss[0], p.eps);
        if (has_row && col == 0 && p.rstd != nullptr) p.rstd[row] = rstd;
#pragma unroll
        for (int v = 0; v < VEC; ++v) x[v] = __fmul_rn(x[v], rstd);
      }
    } else {
      if constexpr (kNorm) {
        const float rstd = norm<VEC, HEAD_DIM, NCV, THREADS>(p, op, x, red, tid);
        if (has_row && col == 0 && p.rstd != nullptr) p.rstd[row] = rstd;
      }
      if constexpr (kRopeDim > 0) rope<false, VEC, HEAD_DIM, NCV, THREADS>(col, op, x, xs, tid);
    }
    if (has_row) store_vec<E, VEC>(dst, x);
  }

  // The backward of one row (every thread of the row; operands staged by stage_operands): `g`
  // holds grad_y on entry and the pooled row's gradient on return, `x` is the pooled row; the
  // norm's grad_w term of the row is added into `dw` (gn · x · rstd, this thread's columns).
  // `parity` alternates between consecutive rows of a thread (the row sums' two buffers).
  template <int VEC, int HEAD_DIM, int THREADS>
  static __device__ __forceinline__ void backward_row(const BackwardParams& p, int col, int tid,
                                                      int parity, const float (&x)[VEC],
                                                      float (&g)[VEC], float (&dw)[VEC]) {
    Operands<VEC> op;
    load_operands<VEC, THREADS>(col, tid, op);
    backward_row_with<VEC, HEAD_DIM, THREADS>(p, op, col, tid, parity, x, g, dw);
  }

  // The pooled row's gradient at column c from the gradient gn after RoPE's transpose (the
  // norm's output gradient), the pooled value x and the row's scalars: w · gn · rstd − coef · x,
  // and the column's grad_w term gn · x · rstd added into dw. The op order of every form.
  static __device__ __forceinline__ float norm_gradient(float w, float gn, float x, float rstd,
                                                        float coef, float& dw) {
    dw = __fadd_rn(dw, __fmul_rn(gn, __fmul_rn(x, rstd)));
    return __fsub_rn(__fmul_rn(rstd, __fmul_rn(w, gn)), __fmul_rn(coef, x));
  }

  // The norm's coefficient rstd³ · Σ (w · gn) · x / d from the row's two sums.
  template <int HEAD_DIM>
  static __device__ __forceinline__ float norm_coefficient(float rstd, float weighted_sum) {
    const float cubed = __fmul_rn(__fmul_rn(rstd, rstd), rstd);
    return (HEAD_DIM & (HEAD_DIM - 1)) == 0
               ? __fmul_rn(__fmul_rn(cubed, weighted_sum), 1.0f / HEAD_DIM)
               : div_near(__fmul_rn(cubed, weighted_sum), static_cast<float>(HEAD_DIM),
                          1.0f / HEAD_DIM);
  }

  // RoPE's transpose of this thread's VEC columns of a row's gradient, in place: `grad_y` the
  // row's gradient in memory, for the pairs whose other column another thread holds.
  template <class E, int VEC, int HEAD_DIM>
  static __device__ __forceinline__ void rope_transposed_columns(const typename E::T* grad_y,
                                                                 int col, const Operands<VEC>& op,
                                                                 float (&g)[VEC]) {
    if constexpr (kRopeDim > 0) {
      constexpr int FIRST = HEAD_DIM - kRopeDim;
      constexpr int HALF = kRopeDim / 2;
      float own[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) own[v] = g[v];
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int c = col + v;
        if (c < FIRST) continue;
        float other;
        if constexpr (kInterleaved && VEC % 2 == 0) {
          other = own[v ^ 1];  // the pair's columns are both this thread's (col is even)
        } else {
          float loaded[1];
          load_vec<E, 1>(grad_y + pair_partner<HEAD_DIM>(c), loaded);
          other = loaded[0];
        }
        const bool lower = kInterleaved ? (c - FIRST) % 2 == 0 : c < FIRST + HALF;
        g[v] = rotate<true>(own[v], other, lower, op.cos[v], op.sin[v]);
      }
    }
  }

  // The row-stats form's backward of this thread's VEC columns of one row: `g` holds grad_y on
  // entry and the pooled row's gradient on return, `x` the pooled row's columns, `stats` the
  // row's scalars (rstd, coef) from tail_row_stats; the grad_w terms are added into `dw`.
  template <class E, int VEC, int HEAD_DIM>
  static __device__ __forceinline__ void backward_columns(const typename E::T* grad_y, int col,
                                                          const Operands<VEC>& op, float2 stats,
                                                          const float (&x)[VEC], float (&g)[VEC],
                                                          float (&dw)[VEC]) {
    rope_transposed_columns<E, VEC, HEAD_DIM>(grad_y, col, op, g);
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      g[v] = norm_gradient(op.w[v], g[v], x[v], stats.x, stats.y, dw[v]);
  }

  // backward_row with the operands in hand.
  template <int VEC, int HEAD_DIM, int THREADS>
  static __device__ __forceinline__ void backward_row_with(const BackwardParams& p,
                                                           const Operands<VEC>& op, int col,
                                                           int tid, int parity,
                                                           const float (&x)[VEC], float (&g)[VEC],
                                                           float (&dw)[VEC]) {
    constexpr int NCV = HEAD_DIM / VEC;
    static_assert(tail_row_threads_ok(NCV) && THREADS % NCV == 0 && THREADS % 32 == 0,
                  "a tail kernel's CTA holds whole rows in whole warps");
    __shared__ __align__(16) float xs[kExchangeBuffers * THREADS * VEC];
    __shared__ float red[2][2 * (THREADS / 32)];
    // The Hadamard transform is its own transpose. Its buffers alternate with the rows' parity
    // where it has an odd number of cross-warp stages, so that they alternate stage by stage.
    if constexpr (kHadamard) {
      float none[1];
      int cross_stages = 0;
      for (int m = 32; m < NCV; m <<= 1) ++cross_stages;
      hadamard<VEC, HEAD_DIM, NCV, THREADS, 0>(g, none, xs, nullptr, tid,
                                               cross_stages % 2 == 1 ? parity : 0);
    }
    if constexpr (kRopeDim > 0) rope<true, VEC, HEAD_DIM, NCV, THREADS>(col, op, g, xs, tid);
    if constexpr (kNorm) {
      // gx = rstd · w · gn − x · rstd³ · (Σ w · gn · x) / d
      float sums[2] = {0.0f, 0.0f};  // Σx², Σ (w · gn) · x
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        sums[0] = __fadd_rn(sums[0], __fmul_rn(x[v], x[v]));
        sums[1] = __fadd_rn(sums[1], __fmul_rn(__fmul_rn(op.w[v], g[v]), x[v]));
      }
      row_sums<NCV, THREADS>(sums, red[parity], tid);
      const float rstd = rstd_of<HEAD_DIM>(sums[0], p.eps);
      const float coef = norm_coefficient<HEAD_DIM>(rstd, sums[1]);
#pragma unroll
      for (int v = 0; v < VEC; ++v) g[v] = norm_gradient(op.w[v], g[v], x[v], rstd, coef, dw[v]);
    }
  }
};

}  // namespace csa_kernel
