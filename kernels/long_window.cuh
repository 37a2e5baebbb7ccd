// Long-window family (large ratio): the window of one (row, column slice) is staged in shared
// memory and reduced by all threads of the CTA. Each column's slots are split over CHUNKS
// lanes of threads (slot k belongs to lane k mod CHUNKS).
//   SERIAL = true : the sums that decide the result (den, out, S) run serially over the slots
//                   in ascending order, as in the fp32-intermediate reference: out, grad_kv and
//                   grad_score are bitwise equal to it (max and expf are order-independent).
//   SERIAL = false: each lane sums its slots, the CHUNKS partials merge in fixed lane order
//                   (deterministic, within the tolerance contract of SPEC §2 item 3).
// FAST_EXP replaces expf by a 2-instruction ex2.approx form (tolerance contract only).
#pragma once
#include "csa_common.cuh"

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

// Slot geometry of the window (SPEC §1) and the shared-memory layout of one CTA.
template <int RATIO, int COFF, int HEAD_DIM, int COLS, int THREADS>
struct LongWindow {
  static constexpr int W = COFF * HEAD_DIM;
  static constexpr int WIN = COFF * RATIO;
  static constexpr int CHUNKS = THREADS / COLS;
  static constexpr int PER_LANE = (WIN + CHUNKS - 1) / CHUNKS;
  static_assert(THREADS % COLS == 0, "COLS must divide THREADS");
  static_assert(CHUNKS >= 1, "at least one lane per column");

  // Token of slot k relative to the row's own block start t0.
  static __device__ __forceinline__ int token(int t0, int k) { return t0 + k - (COFF - 1) * RATIO; }
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

  // Layout (in 4-byte words): e[WIN][COLS] | red[3][CHUNKS][COLS] | col[4][COLS] | kv (bf16).
  float* e;
  float* red;
  float* col;
  unsigned short* kv;
  static constexpr int kWords = WIN * COLS + 3 * CHUNKS * COLS + 4 * COLS;
  static constexpr int kBytes = kWords * 4 + WIN * COLS * 2;
  __device__ explicit LongWindow(float* smem)
      : e(smem),
        red(smem + WIN * COLS),
        col(smem + WIN * COLS + 3 * CHUNKS * COLS),
        kv(reinterpret_cast<unsigned short*>(smem + kWords)) {}
  __device__ float& E(int k, int c) { return e[k * COLS + c]; }
  __device__ float& Red(int which, int lane, int c) {
    return red[(which * CHUNKS + lane) * COLS + c];
  }
  __device__ float& Col(int which, int c) { return col[which * COLS + c]; }
  __device__ float KV(int k, int c) const { return bf16_to_f32(kv[k * COLS + c]); }
};

// VEC adjacent bf16 values as raw bits, one access.
template <int VEC>
struct RawBf16;
template <>
struct RawBf16<1> {
  using type = unsigned short;
};
template <>
struct RawBf16<2> {
  using type = unsigned;
};
template <>
struct RawBf16<4> {
  using type = uint2;
};
template <>
struct RawBf16<8> {
  using type = uint4;
};

template <int VEC>
__device__ __forceinline__ void raw_to_f32(const typename RawBf16<VEC>::type& raw,
                                           float (&v)[VEC]) {
  const unsigned short* h = reinterpret_cast<const unsigned short*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = bf16_to_f32(h[i]);
}

// Stage s_k = score_k + ape_k and kv_k of one row's window for the CTA's COLS columns, VEC
// columns per access. Invalid slots become (-inf, 0); columns past head_dim (0, 0).
// NOTE: loads are issued in batches before any shared-memory store, so each thread keeps
// BATCH window slots in flight (one DRAM round trip per batch, not per slot).
template <int RATIO, int COFF, int HEAD_DIM, int VEC, int COLS, int THREADS, int MAX_BATCH>
__device__ __forceinline__ void stage_window(LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS>& sm,
                                             const csa_u16* score, const csa_u16* kv,
                                             const float* ape, const RowWindow& w, int col0) {
  using L = LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS>;
  using Raw = typename RawBf16<VEC>::type;
  constexpr int NCV = COLS / VEC;
  constexpr int ITEMS = L::WIN * NCV;
  constexpr int ITERS = (ITEMS + THREADS - 1) / THREADS;
  constexpr int BATCH = ITERS < MAX_BATCH ? ITERS : MAX_BATCH;
  static_assert(COLS % VEC == 0, "VEC must divide COLS");
  for (int j0 = 0; j0 < ITERS; j0 += BATCH) {
    Raw sc[BATCH], x[BATCH];
    float a[BATCH][VEC];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = threadIdx.x + (j0 + b) * THREADS;
      const int k = i / NCV;
      const int col = col0 + (i - k * NCV) * VEC;
      if (i < ITEMS && col < HEAD_DIM && L::valid(k, w.first)) {
        const int off = L::token(w.t0, k) * L::W + L::half_offset(k) + col;
        sc[b] = __ldg(reinterpret_cast<const Raw*>(score + off));
        x[b] = __ldg(reinterpret_cast<const Raw*>(kv + off));
        load_f32<VEC>(ape + L::ape_index(k, col), a[b]);
      } else {
        sc[b] = Raw{};
        x[b] = Raw{};
#pragma unroll
        for (int v = 0; v < VEC; ++v) a[b][v] = (i < ITEMS && col < HEAD_DIM) ? neg_inf() : 0.0f;
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int i = threadIdx.x + (j0 + b) * THREADS;
      if (i >= ITEMS) continue;
      const int k = i / NCV;
      const int c = (i - k * NCV) * VEC;
      float s[VEC];
      raw_to_f32<VEC>(sc[b], s);
      // Invalid slots: -inf + 0 (bits 0) = -inf; past head_dim: 0 + 0.
#pragma unroll
      for (int v = 0; v < VEC; ++v) sm.E(k, c + v) = __fadd_rn(s[v], a[b][v]);
      *reinterpret_cast<Raw*>(sm.kv + k * COLS + c) = x[b];
    }
  }
}

// m = max_k s_k per column (exact in any order), then e_k = exp(s_k - m) in place. Returns
// this lane's partial sum of e over its slots (ascending).
template <bool FAST_EXP, typename L>
__device__ __forceinline__ float window_exps(L& sm, int lane, int c) {
  float m = neg_inf();
  for (int k = lane; k < L::WIN; k += L::CHUNKS) m = fmaxf(m, sm.E(k, c));
  sm.Red(0, lane, c) = m;
  __syncthreads();
  m = neg_inf();
#pragma unroll 4
  for (int q = 0; q < L::CHUNKS; ++q) m = fmaxf(m, sm.Red(0, q, c));
  float den = 0.0f;
  for (int k = lane; k < L::WIN; k += L::CHUNKS) {
    const float e = softmax_exp<FAST_EXP>(__fsub_rn(sm.E(k, c), m));
    sm.E(k, c) = e;
    den = __fadd_rn(den, e);
  }
  return den;
}

// Sum over all slots of column c, serially in slot order, of e[k][c].
template <typename L>
__device__ __forceinline__ float serial_sum(L& sm, int c) {
  float acc = 0.0f;
#pragma unroll 8
  for (int k = 0; k < L::WIN; ++k) acc = __fadd_rn(acc, sm.E(k, c));
  return acc;
}

// Merge the CHUNKS lane partials of table `which` in lane order.
template <typename L>
__device__ __forceinline__ float merge_lanes(L& sm, int which, int c) {
  float acc = 0.0f;
#pragma unroll 4
  for (int q = 0; q < L::CHUNKS; ++q) acc = __fadd_rn(acc, sm.Red(which, q, c));
  return acc;
}

template <int RATIO, int COFF, int HEAD_DIM, int VEC, int COLS, int THREADS, bool SERIAL,
          bool FAST_EXP>
__global__ void __launch_bounds__(THREADS)
    long_window_forward(const __grid_constant__ ForwardParams p) {
  using L = LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS>;
  extern __shared__ __align__(16) float smem[];
  L sm(smem);
  const int row = blockIdx.x;
  const int col0 = blockIdx.y * COLS;
  const int c = threadIdx.x % COLS;
  const int lane = threadIdx.x / COLS;
  const RowWindow w =
      locate_row<RATIO>(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments, p.total_tokens, row);
  stage_window<RATIO, COFF, HEAD_DIM, VEC, COLS, THREADS, 8>(sm, p.score, p.kv, p.ape, w, col0);
  __syncthreads();
  const float den_part = window_exps<FAST_EXP>(sm, lane, c);
  const bool store = lane == 0 && col0 + c < HEAD_DIM;
  if constexpr (SERIAL) {
    __syncthreads();
    if (lane == 0) sm.Col(0, c) = serial_sum(sm, c);
    __syncthreads();
    const float den = sm.Col(0, c);
    for (int k = lane; k < L::WIN; k += L::CHUNKS)
      sm.E(k, c) = __fmul_rn(sm.KV(k, c), __fdiv_rn(sm.E(k, c), den));
    __syncthreads();
    if (store) p.out[row * HEAD_DIM + col0 + c] = f32_to_bf16(serial_sum(sm, c));
  } else {
    float acc = 0.0f;
    for (int k = lane; k < L::WIN; k += L::CHUNKS)
      acc = __fadd_rn(acc, __fmul_rn(sm.KV(k, c), sm.E(k, c)));
    sm.Red(1, lane, c) = den_part;
    sm.Red(2, lane, c) = acc;
    __syncthreads();
    if (store) {
      const float den = merge_lanes(sm, 1, c);
      p.out[row * HEAD_DIM + col0 + c] = f32_to_bf16(__fdiv_rn(merge_lanes(sm, 2, c), den));
    }
  }
}

// Exact zeros on `count` tokens from `first_token`, columns [col0, col0 + COLS) of the halves
// selected (first half only when `first_half_only`).
template <int COFF, int HEAD_DIM, int COLS, int THREADS>
__device__ __forceinline__ void zero_tokens(const BackwardParams& p, int first_token, int count,
                                            int col0, bool first_half_only) {
  constexpr int W = COFF * HEAD_DIM;
  constexpr int HALVES = COFF;
  const int halves = first_half_only ? 1 : HALVES;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int i = tid; i < count * halves * COLS; i += THREADS) {
    const int c = i % COLS;
    const int h = (i / COLS) % halves;
    const int t = first_token + i / (COLS * halves);
    if (col0 + c >= HEAD_DIM) continue;
    const int off = t * W + h * HEAD_DIM + col0 + c;
    p.grad_kv[off] = 0;
    p.grad_score[off] = 0;
  }
}

// Zero-writes owned by no row, for the CTA's columns: segments shorter than ratio and the
// token capacity past cu[B], spread over the row groups (gridDim.x).
template <int RATIO, int COFF, int HEAD_DIM, int COLS, int THREADS>
__device__ __forceinline__ void zero_unowned(const BackwardParams& p, int col0) {
  const int groups = gridDim.x;
  for (int s = blockIdx.x; s < p.num_segments; s += groups) {
    if (__ldg(p.cu_seqlens_comp + s + 1) > __ldg(p.cu_seqlens_comp + s)) continue;
    const int t_begin = clamp_i32(__ldg(p.cu_seqlens + s), 0, p.total_tokens);
    const int t_end =
        clamp_i32(__ldg(p.cu_seqlens + s + 1), t_begin, min(p.total_tokens, t_begin + RATIO - 1));
    zero_tokens<COFF, HEAD_DIM, COLS, THREADS>(p, t_begin, t_end - t_begin, col0, false);
  }
  const int used =
      p.num_segments > 0 ? clamp_i32(__ldg(p.cu_seqlens + p.num_segments), 0, p.total_tokens) : 0;
  // NOTE: 64-bit products: groups * per_group may pass 2^31.
  const long long capacity = p.total_tokens - used;
  const long long per_group = (capacity + groups - 1) / groups;
  const int t_begin = used + static_cast<int>(min(capacity, blockIdx.x * per_group));
  const int t_end = used + static_cast<int>(min(capacity, (blockIdx.x + 1) * per_group));
  if (t_end > t_begin)
    zero_tokens<COFF, HEAD_DIM, COLS, THREADS>(p, t_begin, t_end - t_begin, col0, false);
}

template <int RATIO, int COFF, int HEAD_DIM, int VEC, int COLS, int THREADS, bool SERIAL,
          bool FAST_EXP>
__global__ void __launch_bounds__(THREADS)
    long_window_backward(const __grid_constant__ BackwardParams p) {
  using L = LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS>;
  extern __shared__ __align__(16) float smem[];
  L sm(smem);
  const int col0 = blockIdx.y * COLS;
  const int c = threadIdx.x % COLS;
  const int lane = threadIdx.x / COLS;
  const int col = col0 + c;
  const bool active = col < HEAD_DIM;
  const int rows_valid = valid_row_count(p.cu_seqlens_comp, p.num_segments, p.total_comp);

  float dape[L::PER_LANE];
#pragma unroll
  for (int j = 0; j < L::PER_LANE; ++j) dape[j] = 0.0f;

  const long long row_begin = static_cast<long long>(blockIdx.x) * p.rows_per_cta;
  const int row_end = static_cast<int>(
      row_begin + p.rows_per_cta < rows_valid ? row_begin + p.rows_per_cta : rows_valid);
  for (int row = static_cast<int>(row_begin); row < row_end; ++row) {
    const RowWindow w =
        locate_row<RATIO>(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments, p.total_tokens, row);
    // Fewer slots in flight than the forward: the backward also holds grad_ape partials.
    stage_window<RATIO, COFF, HEAD_DIM, VEC, COLS, THREADS, 4>(sm, p.score, p.kv, p.ape, w, col0);
    if (lane == 0) sm.Col(1, c) = active ? bf16_to_f32(p.grad_out[row * HEAD_DIM + col]) : 0.0f;
    __syncthreads();
    const float den_part = window_exps<FAST_EXP>(sm, lane, c);
    if constexpr (!SERIAL) sm.Red(1, lane, c) = den_part;
    __syncthreads();
    if (lane == 0) sm.Col(0, c) = SERIAL ? serial_sum(sm, c) : merge_lanes(sm, 1, c);
    __syncthreads();
    const float den = sm.Col(0, c);
    const float g = sm.Col(1, c);
    // p_k replaces e_k; S = sum_k round(round(g * kv_k) * p_k).
    float s_part = 0.0f;
    for (int k = lane; k < L::WIN; k += L::CHUNKS) {
      const float pk = __fdiv_rn(sm.E(k, c), den);
      sm.E(k, c) = pk;
      s_part = __fadd_rn(s_part, __fmul_rn(__fmul_rn(g, sm.KV(k, c)), pk));
    }
    if constexpr (!SERIAL) sm.Red(2, lane, c) = s_part;
    __syncthreads();
    if (lane == 0) {
      float S = 0.0f;
      if constexpr (SERIAL) {
#pragma unroll 8
        for (int k = 0; k < L::WIN; ++k)
          S = __fadd_rn(S, __fmul_rn(__fmul_rn(g, sm.KV(k, c)), sm.E(k, c)));
      } else {
        S = merge_lanes(sm, 2, c);
      }
      sm.Col(2, c) = S;
    }
    __syncthreads();
    const float S = sm.Col(2, c);
    if (active) {
#pragma unroll
      for (int j = 0; j < L::PER_LANE; ++j) {
        const int k = lane + j * L::CHUNKS;
        if (k >= L::WIN || !L::valid(k, w.first)) continue;
        const float pk = sm.E(k, c);
        const float pd = __fmul_rn(__fmul_rn(g, sm.KV(k, c)), pk);
        const float ds = __fmaf_rn(pk, -S, pd);
        const int off = L::token(w.t0, k) * L::W + L::half_offset(k) + col;
        p.grad_kv[off] = f32_to_bf16(__fmul_rn(g, pk));
        p.grad_score[off] = f32_to_bf16(ds);
        dape[j] = __fadd_rn(dape[j], ds);
      }
    }
    if (w.last) {
      // The segment's last block: its own tokens' first-half columns (coff 2) are never
      // consumed, nor is the tail (< ratio tokens) after it.
      if (COFF == 2) zero_tokens<COFF, HEAD_DIM, COLS, THREADS>(p, w.t0, RATIO, col0, true);
      const int tail_end = min(w.seg_end, w.t0 + 2 * RATIO - 1);
      if (tail_end > w.t0 + RATIO)
        zero_tokens<COFF, HEAD_DIM, COLS, THREADS>(p, w.t0 + RATIO, tail_end - w.t0 - RATIO, col0,
                                                   false);
    }
    __syncthreads();  // the tiles are restaged by the next row
  }

  zero_unowned<RATIO, COFF, HEAD_DIM, COLS, THREADS>(p, col0);

  // grad_ape: this row group's partial for the CTA's columns, summed later in fixed order.
  if (!active) return;
  float* dst = p.workspace + static_cast<long long>(blockIdx.x) * (RATIO * L::W);
#pragma unroll
  for (int j = 0; j < L::PER_LANE; ++j) {
    const int k = lane + j * L::CHUNKS;
    if (k < L::WIN) dst[L::ape_index(k, col)] = dape[j];
  }
}

}  // namespace csa_kernel

// ---------------------------------------------------------------------------------------------
// Register form: thread (x, lane) holds the slots [lane*C, (lane+1)*C) of its VEC columns in
// registers (C = ceil(WIN / LANES)); lanes merge their softmax partials (max, sum of e, sum of
// kv*e) through shared memory in fixed lane order. No staging round trip through shared
// memory, so occupancy is bounded by registers only. Tolerance contract (SPEC §2 item 3).
// ---------------------------------------------------------------------------------------------
namespace csa_kernel {

template <int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES>
struct LaneWindow {
  static constexpr int W = COFF * HEAD_DIM;
  static constexpr int WIN = COFF * RATIO;
  static constexpr int C = (WIN + LANES - 1) / LANES;
  using Geometry = LongWindow<RATIO, COFF, HEAD_DIM, 32, 32>;  // slot geometry only
};

// Loads this thread's slots: s = score + ape (invalid: -inf), kv (invalid: 0).
template <int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES>
__device__ __forceinline__ void load_lane_window(
    const csa_u16* score, const csa_u16* kv, const float* ape, const RowWindow& w, int col,
    int lane, float (&s)[LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>::C][VEC],
    float (&x)[LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>::C][VEC]) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  using Raw = typename RawBf16<VEC>::type;
  Raw rs[LW::C], rx[LW::C];
  float a[LW::C][VEC];
#pragma unroll
  for (int j = 0; j < LW::C; ++j) {
    const int k = lane * LW::C + j;
    if (k < LW::WIN && G::valid(k, w.first)) {
      const int off = G::token(w.t0, k) * LW::W + G::half_offset(k) + col;
      rs[j] = __ldg(reinterpret_cast<const Raw*>(score + off));
      rx[j] = __ldg(reinterpret_cast<const Raw*>(kv + off));
      load_f32<VEC>(ape + G::ape_index(k, col), a[j]);
    } else {
      rs[j] = Raw{};
      rx[j] = Raw{};
#pragma unroll
      for (int v = 0; v < VEC; ++v) a[j][v] = neg_inf();
    }
  }
#pragma unroll
  for (int j = 0; j < LW::C; ++j) {
    raw_to_f32<VEC>(rx[j], x[j]);
    float sc[VEC];
    raw_to_f32<VEC>(rs[j], sc);
#pragma unroll
    for (int v = 0; v < VEC; ++v) s[j][v] = __fadd_rn(sc[v], a[j][v]);
  }
}

// The backward's loads of one row's window: raw bf16 issued together, then turned into s and
// kv. ape is row-independent and held in registers for the whole CTA.
template <int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES>
struct LaneLoads {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  using Raw = typename RawBf16<VEC>::type;
  Raw score[LW::C], kv[LW::C], grad_out;

  __device__ __forceinline__ void issue(const BackwardParams& p, const RowWindow& w, int row,
                                        int col, int lane, bool active) {
    grad_out =
        active ? __ldg(reinterpret_cast<const Raw*>(p.grad_out + row * HEAD_DIM + col)) : Raw{};
#pragma unroll
    for (int j = 0; j < LW::C; ++j) {
      const int k = lane * LW::C + j;
      if (active && k < LW::WIN && G::valid(k, w.first)) {
        const int off = G::token(w.t0, k) * LW::W + G::half_offset(k) + col;
        score[j] = __ldg(reinterpret_cast<const Raw*>(p.score + off));
        kv[j] = __ldg(reinterpret_cast<const Raw*>(p.kv + off));
      } else {
        score[j] = Raw{};
        kv[j] = Raw{};
      }
    }
  }

  // s = score + ape (invalid slots: -inf), kv (invalid: 0).
  __device__ __forceinline__ void finish(const float (&ape)[LW::C][VEC], const RowWindow& w,
                                         int lane, float (&s)[LW::C][VEC], float (&x)[LW::C][VEC],
                                         float (&g)[VEC]) const {
    raw_to_f32<VEC>(grad_out, g);
#pragma unroll
    for (int j = 0; j < LW::C; ++j) {
      const int k = lane * LW::C + j;
      const bool valid = k < LW::WIN && G::valid(k, w.first);
      float sc[VEC];
      raw_to_f32<VEC>(score[j], sc);
      raw_to_f32<VEC>(kv[j], x[j]);
#pragma unroll
      for (int v = 0; v < VEC; ++v) s[j][v] = valid ? __fadd_rn(sc[v], ape[j][v]) : neg_inf();
    }
  }
};

// Lane max, then e in place and the lane's sum of e.
template <int C, int VEC, bool FAST_EXP>
__device__ __forceinline__ void lane_exps(float (&s)[C][VEC], float (&m)[VEC], float (&den)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    m[v] = neg_inf();
    den[v] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < C; ++j)
#pragma unroll
    for (int v = 0; v < VEC; ++v) m[v] = fmaxf(m[v], s[j][v]);
#pragma unroll
  for (int j = 0; j < C; ++j)
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      // A lane with no valid slot has m = -inf: its e stay 0 (exp(-inf)), never NaN.
      s[j][v] = m[v] == neg_inf() ? 0.0f : softmax_exp<FAST_EXP>(__fsub_rn(s[j][v], m[v]));
      den[v] = __fadd_rn(den[v], s[j][v]);
    }
}

// Fixed-order merge of the lanes' (m, den) of one column: the window max and, per lane, the
// factor exp(m_q - M) that rescales its partial sums.
template <int LANES, bool FAST_EXP>
__device__ __forceinline__ float merged_max(const float* m, int stride) {
  float M = neg_inf();
#pragma unroll 8
  for (int q = 0; q < LANES; ++q) M = fmaxf(M, m[q * stride]);
  return M;
}

template <int LANES, bool FAST_EXP>
__device__ __forceinline__ float merged_sum(const float* m, const float* part, int stride,
                                            float M) {
  float sum = 0.0f;
#pragma unroll 8
  for (int q = 0; q < LANES; ++q) {
    const float mq = m[q * stride];
    if (mq == neg_inf()) continue;  // empty lane: contributes nothing
    sum = __fadd_rn(sum, __fmul_rn(part[q * stride], softmax_exp<FAST_EXP>(__fsub_rn(mq, M))));
  }
  return sum;
}

// SERIAL: every lane takes the window max M (exact in any order), e_k = expf(s_k - M) goes to
// shared memory, and one thread per column sums den, then out = sum_k round(kv_k * p_k),
// serially in slot order: out is bitwise equal to the fp32-intermediate reference. Otherwise
// each lane keeps (lane max, sum e, sum kv*e) and the lanes merge in fixed order.
template <int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int LANES, bool SERIAL, bool FAST_EXP>
__global__ void __launch_bounds__(TX* LANES, 1)
    lane_window_forward(const __grid_constant__ ForwardParams p) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  static_assert(LANES >= VEC, "lanes 0..VEC-1 finish the columns");
  static_assert(!(SERIAL && FAST_EXP), "the serial order is the bitwise contract: exact expf");
  constexpr int NCV = HEAD_DIM / VEC;
  constexpr int COLS = TX * VEC;
  constexpr int E_ROWS = SERIAL ? LW::WIN : 1;
  __shared__ float sm_m[LANES][COLS], sm_den[LANES][COLS], sm_acc[LANES][COLS];
  __shared__ float sm_e[E_ROWS][COLS];
  const int row = blockIdx.x;
  const int cv = blockIdx.y * TX + threadIdx.x;
  const int lane = threadIdx.y;
  const bool active = cv < NCV;
  const int col = cv * VEC;
  const RowWindow w =
      locate_row<RATIO>(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments, p.total_tokens, row);
  float s[LW::C][VEC], x[LW::C][VEC];
  if (active) {
    load_lane_window<RATIO, COFF, HEAD_DIM, VEC, LANES>(p.score, p.kv, p.ape, w, col, lane, s, x);
  } else {
#pragma unroll
    for (int j = 0; j < LW::C; ++j)
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        s[j][v] = neg_inf();
        x[j][v] = 0.0f;
      }
  }
  if constexpr (SERIAL) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float m = neg_inf();
#pragma unroll
      for (int j = 0; j < LW::C; ++j) m = fmaxf(m, s[j][v]);
      sm_m[lane][threadIdx.x * VEC + v] = m;
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      const float M = merged_max<LANES, FAST_EXP>(&sm_m[0][c], COLS);
#pragma unroll
      for (int j = 0; j < LW::C; ++j) {
        const int k = lane * LW::C + j;
        if (k < LW::WIN) sm_e[k][c] = expf(__fsub_rn(s[j][v], M));
      }
    }
    __syncthreads();
    if (lane < VEC) {
      const int c = threadIdx.x * VEC + lane;
      float den = 0.0f;
#pragma unroll 8
      for (int k = 0; k < LW::WIN; ++k) den = __fadd_rn(den, sm_e[k][c]);
      sm_den[0][c] = den;
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      const float den = sm_den[0][c];
#pragma unroll
      for (int j = 0; j < LW::C; ++j) {
        const int k = lane * LW::C + j;
        if (k < LW::WIN) sm_e[k][c] = __fmul_rn(x[j][v], __fdiv_rn(sm_e[k][c], den));
      }
    }
    __syncthreads();
    if (lane >= VEC || !active) return;
    const int c = threadIdx.x * VEC + lane;
    float out = 0.0f;
#pragma unroll 8
    for (int k = 0; k < LW::WIN; ++k) out = __fadd_rn(out, sm_e[k][c]);
    p.out[row * HEAD_DIM + col + lane] = f32_to_bf16(out);
  } else {
    float m[VEC], den[VEC], acc[VEC];
    lane_exps<LW::C, VEC, FAST_EXP>(s, m, den);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      acc[v] = 0.0f;
#pragma unroll
      for (int j = 0; j < LW::C; ++j) acc[v] = __fadd_rn(acc[v], __fmul_rn(x[j][v], s[j][v]));
      const int c = threadIdx.x * VEC + v;
      sm_m[lane][c] = m[v];
      sm_den[lane][c] = den[v];
      sm_acc[lane][c] = acc[v];
    }
    __syncthreads();
    // Lane q < VEC finishes column threadIdx.x * VEC + q.
    if (lane >= VEC || !active) return;
    const int c = threadIdx.x * VEC + lane;
    const float M = merged_max<LANES, FAST_EXP>(&sm_m[0][c], COLS);
    const float total_den = merged_sum<LANES, FAST_EXP>(&sm_m[0][c], &sm_den[0][c], COLS, M);
    const float total_acc = merged_sum<LANES, FAST_EXP>(&sm_m[0][c], &sm_acc[0][c], COLS, M);
    // Correctly rounded while den and the quotient stay normal (den >= 1: the window max's e
    // is 1); no slow-path call (tolerance contract).
    p.out[row * HEAD_DIM + col + lane] =
        f32_to_bf16(div_rn_fast(total_acc, total_den, refined_reciprocal(total_den)));
  }
}

template <int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int LANES, bool FAST_EXP>
__global__ void __launch_bounds__(TX* LANES, TX* LANES <= 256 ? 2 : 1)
    lane_window_backward(const __grid_constant__ BackwardParams p) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  constexpr int NCV = HEAD_DIM / VEC;
  constexpr int COLS = TX * VEC;
  constexpr int THREADS = TX * LANES;
  // Double-buffered by row parity: two barriers per row.
  __shared__ float sm_m[2][LANES][COLS], sm_den[2][LANES][COLS], sm_s[2][LANES][COLS];
  const int lane = threadIdx.y;
  const int cv = blockIdx.y * TX + threadIdx.x;
  const bool active = cv < NCV;
  const int col = cv * VEC;
  const int col0 = blockIdx.y * COLS;
  const int rows_valid = valid_row_count(p.cu_seqlens_comp, p.num_segments, p.total_comp);

  float dape[LW::C][VEC];
#pragma unroll
  for (int j = 0; j < LW::C; ++j)
#pragma unroll
    for (int v = 0; v < VEC; ++v) dape[j][v] = 0.0f;

  // ape of this thread's slots: the same for every row.
  float ape[LW::C][VEC];
#pragma unroll
  for (int j = 0; j < LW::C; ++j) {
    const int k = lane * LW::C + j;
    if (active && k < LW::WIN) {
      load_f32<VEC>(p.ape + G::ape_index(k, col), ape[j]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) ape[j][v] = 0.0f;
    }
  }

  const long long row_begin = static_cast<long long>(blockIdx.x) * p.rows_per_cta;
  const int row_end = static_cast<int>(
      row_begin + p.rows_per_cta < rows_valid ? row_begin + p.rows_per_cta : rows_valid);
  int buf = 0;
  for (int row = static_cast<int>(row_begin); row < row_end; ++row, buf ^= 1) {
    const RowWindow w =
        locate_row<RATIO>(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments, p.total_tokens, row);
    // NOTE: prefetching the next row's window here measured no faster on the H200 and needs
    // twice the registers; the CTAs resident per SM hide the load latency instead.
    LaneLoads<RATIO, COFF, HEAD_DIM, VEC, LANES> loads;
    loads.issue(p, w, row, col, lane, active);
    float s[LW::C][VEC], x[LW::C][VEC], g[VEC];
    loads.finish(ape, w, lane, s, x, g);
    float m[VEC], den[VEC];
    lane_exps<LW::C, VEC, FAST_EXP>(s, m, den);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      sm_m[buf][lane][threadIdx.x * VEC + v] = m[v];
      sm_den[buf][lane][threadIdx.x * VEC + v] = den[v];
    }
    __syncthreads();
    // Every thread merges the same lanes in the same order: identical M and den everywhere.
    float scale[VEC], S_part[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      const float M = merged_max<LANES, FAST_EXP>(&sm_m[buf][0][c], COLS);
      const float total =
          merged_sum<LANES, FAST_EXP>(&sm_m[buf][0][c], &sm_den[buf][0][c], COLS, M);
      // p = e * exp(m_q - M) / den; an empty lane has e = 0 everywhere. The reciprocal is
      // Newton-refined, not IEEE: this form is under the tolerance contract, and it keeps the
      // division's slow-path call (and the register spills around it) out of the kernel.
      scale[v] = m[v] == neg_inf() ? 0.0f
                                   : __fmul_rn(softmax_exp<FAST_EXP>(__fsub_rn(m[v], M)),
                                               refined_reciprocal(total));
      S_part[v] = 0.0f;
#pragma unroll
      for (int j = 0; j < LW::C; ++j) {
        s[j][v] = __fmul_rn(s[j][v], scale[v]);  // p_k
        S_part[v] = __fadd_rn(S_part[v], __fmul_rn(__fmul_rn(g[v], x[j][v]), s[j][v]));
      }
      sm_s[buf][lane][c] = S_part[v];
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      float S = 0.0f;
#pragma unroll 8
      for (int q = 0; q < LANES; ++q) S = __fadd_rn(S, sm_s[buf][q][c]);
      S_part[v] = S;
    }
    if (active) {
#pragma unroll
      for (int j = 0; j < LW::C; ++j) {
        const int k = lane * LW::C + j;
        if (k >= LW::WIN || !G::valid(k, w.first)) continue;
        float gkv[VEC], gs[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float pd = __fmul_rn(__fmul_rn(g[v], x[j][v]), s[j][v]);
          gs[v] = __fmaf_rn(s[j][v], -S_part[v], pd);
          gkv[v] = __fmul_rn(g[v], s[j][v]);
          dape[j][v] = __fadd_rn(dape[j][v], gs[v]);
        }
        const int off = G::token(w.t0, k) * LW::W + G::half_offset(k) + col;
        store_bf16<VEC>(p.grad_kv + off, gkv);
        store_bf16<VEC>(p.grad_score + off, gs);
      }
    }
    if (w.last) {
      if (COFF == 2) zero_tokens<COFF, HEAD_DIM, COLS, THREADS>(p, w.t0, RATIO, col0, true);
      const int tail_end = min(w.seg_end, w.t0 + 2 * RATIO - 1);
      if (tail_end > w.t0 + RATIO)
        zero_tokens<COFF, HEAD_DIM, COLS, THREADS>(p, w.t0 + RATIO, tail_end - w.t0 - RATIO, col0,
                                                   false);
    }
  }
  zero_unowned<RATIO, COFF, HEAD_DIM, COLS, THREADS>(p, col0);

  if (!active) return;
  float* dst = p.workspace + static_cast<long long>(blockIdx.x) * (RATIO * LW::W);
#pragma unroll
  for (int j = 0; j < LW::C; ++j) {
    const int k = lane * LW::C + j;
    if (k >= LW::WIN) continue;
#pragma unroll
    for (int v = 0; v < VEC; ++v) dst[G::ape_index(k, col + v)] = dape[j][v];
  }
}

}  // namespace csa_kernel
