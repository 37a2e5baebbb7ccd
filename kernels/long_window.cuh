// Long-window family, staged form: the window of one (row, column slice) is staged in shared
// memory and reduced by all threads of the CTA. Each column's slots are split over CHUNKS
// lanes of threads (slot k belongs to lane k mod CHUNKS).
//   SERIAL = true : the sums that decide the result (den, out, S) run serially over the slots
//                   in ascending order, as in the fp32-intermediate reference: out, grad_kv and
//                   grad_score are bitwise equal to it (max and expf are order-independent).
//   SERIAL = false: each lane sums its slots, the CHUNKS partials merge in fixed lane order
//                   (deterministic, within the tolerance contract of SPEC §2 item 3).
// FAST_EXP replaces expf by a 2-instruction ex2.approx form (tolerance contract only).
#pragma once
#include "long_window_common.cuh"

namespace csa_kernel {

// Stage s_k = score_k + ape_k and kv_k of one row's window for the CTA's COLS columns, VEC
// columns per access. Invalid slots become (-inf, 0); columns past head_dim (0, 0).
// NOTE: loads are issued in batches before any shared-memory store, so each thread keeps
// BATCH window slots in flight (one DRAM round trip per batch, not per slot).
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int COLS, int THREADS,
          int MAX_BATCH, class P>
__device__ __forceinline__ void stage_window(
    LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS, typename IO::E>& sm, const P& p,
    const RowWindow& w, int col0) {
  using L = LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS, typename IO::E>;
  using Lay = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  using Raw = RawVec<typename IO::E, VEC>;
  const TokenRows sr = Lay::rows(p, p.score_stride);
  const TokenRows kr = Lay::rows(p, p.kv_stride);
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
        sc[b] = load_raw<typename IO::E, VEC>(IO::in(p.score) +
                                              slot_offset<RATIO, COFF, HEAD_DIM>(w, sr, k, col));
        x[b] = load_raw<typename IO::E, VEC>(IO::in(p.kv) +
                                             slot_offset<RATIO, COFF, HEAD_DIM>(w, kr, k, col));
        load_f32<VEC>(p.ape + L::ape_index(k, col), a[b]);
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
      raw_to_f32<typename IO::E, VEC>(sc[b], s);
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

template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int COLS, int THREADS, bool SERIAL,
          bool FAST_EXP>
__global__ void __launch_bounds__(THREADS)
    long_window_forward(const __grid_constant__ ForwardParams p) {
  pdl_enter();
  using L = LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS, typename IO::E>;
  using Lay = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  extern __shared__ __align__(16) float smem[];
  L sm(smem);
  const ForwardTile<(HEAD_DIM + COLS - 1) / COLS> tile;
  const int row = tile.row;
  const int col0 = tile.slice * COLS;
  const int c = threadIdx.x % COLS;
  const int lane = threadIdx.x / COLS;
  const RowWindow w = Lay::locate(p, row);
  stage_window<IO, RATIO, COFF, HEAD_DIM, VEC, COLS, THREADS, 8>(sm, p, w, col0);
  typename IO::T* const out = IO::out(p.out) + row * Lay::out_stride(p, p.out_stride) + col0 + c;
  __syncthreads();
  const float den_part = window_exps<FAST_EXP>(sm, lane, c);
  const bool store = lane == 0 && col0 + c < HEAD_DIM;
  if constexpr (SERIAL) {
    __syncthreads();
    if (lane == 0) sm.Col(0, c) = serial_sum(sm, c);
    __syncthreads();
    const float den = sm.Col(0, c);
    const float inv = refined_reciprocal(den);
    for (int k = lane; k < L::WIN; k += L::CHUNKS)
      sm.E(k, c) = __fmul_rn(sm.KV(k, c), div_rn(sm.E(k, c), den, inv));
    __syncthreads();
    if (store) {
      const float v[1] = {serial_sum(sm, c)};
      IO::Store::template store<typename IO::E, 1>(out, row, col0 + c, v);
    }
  } else {
    float acc = 0.0f;
    for (int k = lane; k < L::WIN; k += L::CHUNKS)
      acc = __fadd_rn(acc, __fmul_rn(sm.KV(k, c), sm.E(k, c)));
    sm.Red(1, lane, c) = den_part;
    sm.Red(2, lane, c) = acc;
    __syncthreads();
    if (store) {
      const float den = merge_lanes(sm, 1, c);
      const float v[1] = {div_rn(merge_lanes(sm, 2, c), den, refined_reciprocal(den))};
      IO::Store::template store<typename IO::E, 1>(out, row, col0 + c, v);
    }
  }
}

template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int COLS, int THREADS, bool SERIAL,
          bool FAST_EXP>
__global__ void __launch_bounds__(THREADS)
    long_window_backward(const __grid_constant__ BackwardParams p) {
  pdl_enter();
  using L = LongWindow<RATIO, COFF, HEAD_DIM, COLS, THREADS, typename IO::E>;
  using Lay = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  using E = typename IO::E;
  const TokenRows gkr = Lay::rows(p, p.grad_kv_stride);
  const TokenRows gsr = Lay::rows(p, p.grad_score_stride);
  extern __shared__ __align__(16) float smem[];
  L sm(smem);
  const int col0 = blockIdx.y * COLS;
  const int c = threadIdx.x % COLS;
  const int lane = threadIdx.x / COLS;
  const int col = col0 + c;
  const bool active = col < HEAD_DIM;
  const int rows_valid = Lay::rows_valid(p);

  float dape[L::PER_LANE];
#pragma unroll
  for (int j = 0; j < L::PER_LANE; ++j) dape[j] = 0.0f;

  const long long row_begin = static_cast<long long>(blockIdx.x) * p.rows_per_cta;
  const int row_end = static_cast<int>(
      row_begin + p.rows_per_cta < rows_valid ? row_begin + p.rows_per_cta : rows_valid);
  for (int row = static_cast<int>(row_begin); row < row_end; ++row) {
    const RowWindow w = Lay::locate(p, row);
    // Fewer slots in flight than the forward: the backward also holds grad_ape partials.
    stage_window<IO, RATIO, COFF, HEAD_DIM, VEC, COLS, THREADS, 4>(sm, p, w, col0);
    if (lane == 0)
      sm.Col(1, c) =
          active ? E::to_f32(IO::in(p.grad_out)[row * Lay::out_stride(p, p.grad_out_stride) + col])
                 : 0.0f;
    __syncthreads();
    const float den_part = window_exps<FAST_EXP>(sm, lane, c);
    if constexpr (!SERIAL) sm.Red(1, lane, c) = den_part;
    __syncthreads();
    if (lane == 0) sm.Col(0, c) = SERIAL ? serial_sum(sm, c) : merge_lanes(sm, 1, c);
    __syncthreads();
    const float den = sm.Col(0, c);
    const float g = sm.Col(1, c);
    const float inv = refined_reciprocal(den);
    // p_k replaces e_k; S = sum_k round(round(g * kv_k) * p_k).
    float s_part = 0.0f;
    for (int k = lane; k < L::WIN; k += L::CHUNKS) {
      const float pk = div_rn(sm.E(k, c), den, inv);
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
        IO::out(p.grad_kv)[slot_offset<RATIO, COFF, HEAD_DIM>(w, gkr, k, col)] =
            E::from_f32(__fmul_rn(g, pk));
        IO::out(p.grad_score)[slot_offset<RATIO, COFF, HEAD_DIM>(w, gsr, k, col)] = E::from_f32(ds);
        dape[j] = __fadd_rn(dape[j], ds);
      }
    }
    zero_after_last_block<IO, RATIO, COFF, HEAD_DIM, COLS, THREADS>(p, w, col0);
    __syncthreads();  // the tiles are restaged by the next row
  }

  zero_unowned<IO, RATIO, COFF, HEAD_DIM, COLS, THREADS>(p, col0);

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
