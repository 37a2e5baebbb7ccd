// The tail epilogue: RMSNorm, RoPE and the Hadamard transform of each pooled row in fp32, y
// rounded once (docs/user-guide.md, "The tail"). A row's columns are held by NCV = HEAD_DIM /
// VEC consecutive threads of one CTA (the forward's row-major thread order with THREADS a
// multiple of NCV), so every thread of the CTA calls it, threads without a row too: the row's
// sum of squares and the Hadamard butterflies cross threads by shuffles within a warp and by
// shared memory across warps.
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
template <int NCV, int THREADS>
__device__ __forceinline__ void row_barrier() {
  constexpr int ROWS = THREADS / NCV;
  if constexpr (ROWS == 1 || ROWS > 15) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + static_cast<int>(threadIdx.x) / NCV), "r"(NCV)
                 : "memory");
  }
}

// The sum of one value per thread over the NCV threads of each row, the same bits in every
// thread of the row (a butterfly, then the row's warps in order). `red`: a float per warp.
// NOTE: across warps it takes one row barrier; `red` may be reused only after another.
template <int NCV, int THREADS>
__device__ __forceinline__ float row_sum(float s, float* red) {
  constexpr int WIDTH = NCV < 32 ? NCV : 32;
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  if constexpr (NCV > 32) {
    constexpr int WARPS = NCV / 32;
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
    row_barrier<NCV, THREADS>();
    const float* mine = red + (threadIdx.x / NCV) * WARPS;
    s = mine[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) s = __fadd_rn(s, mine[w]);
  }
  return s;
}

template <int KIND>
struct TailEpilogue {
  static constexpr bool kCooperative = true;
  static constexpr bool kNorm = (KIND & kTailNorm) != 0;
  static constexpr bool kWeightF32 = (KIND & kTailNormWeightF32) != 0;
  static constexpr int kRopeDim = tail_rope_dim(KIND);
  static constexpr bool kInterleaved = (KIND & kTailRopeInterleaved) != 0;
  static constexpr bool kHadamard = (KIND & kTailHadamard) != 0;

  // The operands of this thread's columns (the norm weight) and of its row (RoPE's cos and sin
  // at the row's block).
  template <int VEC>
  struct Operands {
    float w[kNorm ? VEC : 1];
    float cos[kRopeDim > 0 ? VEC : 1];
    float sin[kRopeDim > 0 ? VEC : 1];
  };

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
  static __device__ __forceinline__ float& slot(int array, int v) {
    return staging<VEC, THREADS>()[(array * VEC + v) * THREADS + threadIdx.x];
  }
  static __device__ __forceinline__ void cp_async_4(float* dst, const void* src) {
    const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(saddr), "l"(src) : "memory");
  }

  // Issues the copies of this thread's operands (a row's thread, right after its window is
  // located): their L2 round trip then overlaps the window's DRAM one, and no register holds
  // them meanwhile (in registers they cost the wide kernel 21 of them).
  template <int VEC, int HEAD_DIM, int THREADS>
  static __device__ __forceinline__ void stage_operands(const ForwardParams& p, int col,
                                                        int block) {
    if constexpr (kNorm) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const void* src =
            kWeightF32
                ? static_cast<const void*>(static_cast<const float*>(p.norm_weight) + col + v)
                : static_cast<const void*>(static_cast<const unsigned*>(p.norm_weight) +
                                           ((col + v) >> 1));
        cp_async_4(&slot<VEC, THREADS>(0, v), src);
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
        cp_async_4(&slot<VEC, THREADS>(COS, v), p.rope_cos + base + i);
        cp_async_4(&slot<VEC, THREADS>(COS + 1, v), p.rope_sin + base + i);
      }
    }
    if constexpr (kArrays > 0) asm volatile("cp.async.commit_group;" ::: "memory");
  }

  // The staged operands, once this thread's copies landed. NOTE: threads without a row staged
  // nothing and read stale slots; their rows are never stored and no row's sums mix them in.
  template <int VEC, int THREADS>
  static __device__ __forceinline__ void load_operands(int col, Operands<VEC>& op) {
    if constexpr (kArrays > 0) asm volatile("cp.async.wait_all;" ::: "memory");
    if constexpr (kNorm) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float staged = slot<VEC, THREADS>(0, v);
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
        op.cos[v] = slot<VEC, THREADS>(COS, v);
        op.sin[v] = slot<VEC, THREADS>(COS + 1, v);
      }
    }
  }

  // n = (x · rstd) · w with rstd = 1 / sqrt(Σx² / d + eps); returns rstd.
  template <int VEC, int HEAD_DIM, int NCV, int THREADS>
  static __device__ __forceinline__ float norm(const ForwardParams& p, const Operands<VEC>& op,
                                               float (&x)[VEC], float* red) {
    float ss = 0.0f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) ss = __fadd_rn(ss, __fmul_rn(x[v], x[v]));
    ss = row_sum<NCV, THREADS>(ss, red);
    // Σx² / d: exact as a product where d is a power of two.
    const float mean = (HEAD_DIM & (HEAD_DIM - 1)) == 0
                           ? __fmul_rn(ss, 1.0f / static_cast<float>(HEAD_DIM))
                           : __fdiv_rn(ss, static_cast<float>(HEAD_DIM));
    const float rstd = __frcp_rn(__fsqrt_rn(__fadd_rn(mean, p.eps)));
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = __fmul_rn(__fmul_rn(x[v], rstd), op.w[v]);
    return rstd;
  }

  // a' = a·cos − b·sin, b' = a·sin + b·cos on the pairs of the last kRopeDim columns.
  template <int VEC, int HEAD_DIM, int NCV, int THREADS>
  static __device__ __forceinline__ void rope(int col, const Operands<VEC>& op, float (&x)[VEC],
                                              float* xs) {
    constexpr int FIRST = HEAD_DIM - kRopeDim;
    constexpr int HALF = kRopeDim / 2;
    if constexpr (kInterleaved && VEC % 2 == 0) {
      // A pair's two columns are in one thread (col and FIRST are even).
#pragma unroll
      for (int v = 0; v < VEC; v += 2) {
        if (col + v < FIRST) continue;
        const float a = x[v];
        const float b = x[v + 1];
        x[v] = __fsub_rn(__fmul_rn(a, op.cos[v]), __fmul_rn(b, op.sin[v]));
        x[v + 1] = __fadd_rn(__fmul_rn(a, op.sin[v]), __fmul_rn(b, op.cos[v]));
      }
    } else if constexpr (kInterleaved) {
      // VEC 1: the pair's other column is the neighbouring thread's (lane ^ 1).
      const float other = __shfl_xor_sync(0xffffffffu, x[0], 1);
      if (col >= FIRST) {
        x[0] = (col - FIRST) % 2 == 0
                   ? __fsub_rn(__fmul_rn(x[0], op.cos[0]), __fmul_rn(other, op.sin[0]))
                   : __fadd_rn(__fmul_rn(other, op.sin[0]), __fmul_rn(x[0], op.cos[0]));
      }
    } else {
      // Half-split pairs (i, i + HALF) cross threads: exchanged through the CTA's rows.
      float* const row_xs = xs + (threadIdx.x / NCV) * HEAD_DIM;
#pragma unroll
      for (int v = 0; v < VEC; ++v) row_xs[col + v] = x[v];
      row_barrier<NCV, THREADS>();
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int c = col + v;
        if (c < FIRST) continue;
        const bool lower = c < FIRST + HALF;
        const float other = row_xs[lower ? c + HALF : c - HALF];
        x[v] = lower ? __fsub_rn(__fmul_rn(x[v], op.cos[v]), __fmul_rn(other, op.sin[v]))
                     : __fadd_rn(__fmul_rn(other, op.sin[v]), __fmul_rn(x[v], op.cos[v]));
      }
      row_barrier<NCV, THREADS>();  // row_xs is free again
    }
  }

  // The butterflies of strides 1, 2, 4, ... (a + b, a − b), then the product by d^-1/2.
  template <int VEC, int HEAD_DIM, int NCV, int THREADS>
  static __device__ __forceinline__ void hadamard(float (&x)[VEC], float* xs) {
    static_assert((HEAD_DIM & (HEAD_DIM - 1)) == 0, "the Hadamard transform needs 2^k columns");
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
    const int lane = static_cast<int>(threadIdx.x) % NCV;  // the row's thread: columns lane*VEC..
#pragma unroll
    for (int m = 1; m < NCV; m <<= 1) {
      const bool upper = (lane & m) != 0;
      float other[VEC];
      if (m < 32) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) other[v] = __shfl_xor_sync(0xffffffffu, x[v], m);
      } else {
        // The partner thread is in another warp of the row: threadIdx.x ^ m (NCV is 2^k).
#pragma unroll
        for (int v = 0; v < VEC; ++v) xs[threadIdx.x * VEC + v] = x[v];
        row_barrier<NCV, THREADS>();
#pragma unroll
        for (int v = 0; v < VEC; ++v) other[v] = xs[(threadIdx.x ^ m) * VEC + v];
        row_barrier<NCV, THREADS>();
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        x[v] = upper ? __fsub_rn(other[v], x[v]) : __fadd_rn(x[v], other[v]);
    }
    constexpr float kScale = hadamard_scale<HEAD_DIM>();
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = __fmul_rn(x[v], kScale);
  }

  // Every thread of the CTA: `x` its VEC columns of row `row` from column `col` (operands
  // staged by stage_operands where has_row), stored to `dst` where has_row.
  template <class E, int VEC, int HEAD_DIM, int THREADS>
  static __device__ __forceinline__ void store_row(const ForwardParams& p, typename E::T* dst,
                                                   int row, int col, bool has_row,
                                                   float (&x)[VEC]) {
    constexpr int NCV = HEAD_DIM / VEC;
    static_assert(tail_row_threads_ok(NCV) && THREADS % NCV == 0 && THREADS % 32 == 0,
                  "a tail kernel's CTA holds whole rows in whole warps");
    __shared__ __align__(16) float xs[THREADS * VEC];  // the CTA's rows, row-major
    __shared__ float red[THREADS / 32];
    Operands<VEC> op;
    load_operands<VEC, THREADS>(col, op);
    if constexpr (kNorm) {
      const float rstd = norm<VEC, HEAD_DIM, NCV, THREADS>(p, op, x, red);
      if (has_row && col == 0 && p.rstd != nullptr) p.rstd[row] = rstd;
    }
    if constexpr (kRopeDim > 0) rope<VEC, HEAD_DIM, NCV, THREADS>(col, op, x, xs);
    if constexpr (kHadamard) hadamard<VEC, HEAD_DIM, NCV, THREADS>(x, xs);
    if (has_row) store_vec<E, VEC>(dst, x);
  }
};

}  // namespace csa_kernel
