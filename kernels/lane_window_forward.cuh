// Long-window family, lanes form: the forward kernel (one row and one column slice per CTA).
#pragma once
#include "lane_window.cuh"
namespace csa_kernel {

// Loads this thread's slots: s = score + ape (invalid: -inf), kv (invalid: 0).
// UNIFORM windows (lane_slot_base) load each slot at one 64-bit base per array plus a
// compile-time offset (j * W), so the loads issue back to back instead of each behind its
// own 64-bit address arithmetic (sm_90 SASS of the 128,2,512
// chunked kernel: 960 instructions, the window's 52 loads within 132 of them, against 1256
// and 437 per slot). H200, kernel us: 128,1,512,1x131072 90.9 -> 79.9, 128,2,512,1x131072
// 190.3 -> 152.3, 128,1,128,1x65536 14.3 -> 11.3; only the 32-row 128,1,512,1x4096 was
// slower (4.67 -> 5.1 with the same schedule; docs/performance.md).
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
  if constexpr (LW::UNIFORM) {
    long long offset0 = 0;
    const bool valid = lane_slot_base<RATIO, COFF, HEAD_DIM, VEC, LANES>(w, col, lane, offset0);
    const int k0 = lane * LW::C;
    const Raw* const score0 = reinterpret_cast<const Raw*>(score + offset0);
    const Raw* const kv0 = reinterpret_cast<const Raw*>(kv + offset0);
    const float* const ape0 = ape + (valid ? G::ape_index(k0, col) : 0);
    constexpr int kStride = LW::W / VEC;  // one token, in Raw elements
#pragma unroll
    for (int j = 0; j < LW::C; ++j) {
      if (valid) {
        rs[j] = __ldg(score0 + j * kStride);
        rx[j] = __ldg(kv0 + j * kStride);
        load_f32<VEC>(ape0 + j * LW::W, a[j]);
      } else {
        rs[j] = Raw{};
        rx[j] = Raw{};
#pragma unroll
        for (int v = 0; v < VEC; ++v) a[j][v] = neg_inf();
      }
    }
  } else {
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

// SERIAL: every lane takes the window max M (exact in any order), e_k = expf(s_k - M) goes to
// shared memory, and one thread per column sums den, then out = sum_k round(kv_k * p_k),
// serially in slot order: out is bitwise equal to the fp32-intermediate reference. Otherwise
// each lane keeps (lane max, sum e, sum kv*e) and the lanes merge in fixed order.
// Launch bounds: a chunked coff-1 CTA of up to 256 threads holding at most 16 window values a
// thread in vectors of 2 or more asks for 5 CTAs per SM (48 registers, no spill): one more
// window in flight per SM than the 56 registers it took otherwise (H200, kernel us:
// 128,1,512,1x131072 92.4 -> 90.6, 128,1,512,1x65536 48.2 -> 46.8, 128,1,128,1x131072 25.0 ->
// 24.6). More values a thread, or the scalar columns of an odd head_dim, spill at 48
// registers; coff-2 windows of that size (ratio <= 64) were not measured. Others keep the
// compiler's choice: 3 CTAs for the 32-value windows of the 64-column buckets (80 registers,
// from 96) measured the same as without, with the slot-offset loads (H200, within 1 %).
template <int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES, bool SERIAL>
__host__ __device__ constexpr int forward_min_ctas(int threads) {
  constexpr int values = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>::C * VEC;
  if (SERIAL || COFF != 1 || VEC < 2 || threads > 256) return 1;
  return values <= 16 ? 5 : 1;
}

template <int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int LANES, bool SERIAL, bool FAST_EXP>
__global__ void __launch_bounds__(
    TX* LANES, forward_min_ctas<RATIO, COFF, HEAD_DIM, VEC, LANES, SERIAL>(TX* LANES))
    lane_window_forward(const __grid_constant__ ForwardParams p) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  static_assert(LANES >= VEC, "lanes 0..VEC-1 finish the columns");
  static_assert(!(SERIAL && FAST_EXP), "the serial order is the bitwise contract: exact expf");
  constexpr int NCV = HEAD_DIM / VEC;
  constexpr int COLS = TX * VEC;
  constexpr int E_ROWS = SERIAL ? LW::WIN : 1;
  __shared__ float sm_m[LANES][COLS], sm_den[LANES][COLS], sm_acc[LANES][COLS];
  __shared__ float sm_e[E_ROWS][COLS];
  const ForwardTile<(NCV + TX - 1) / TX> tile;
  const int row = tile.row;
  const int cv = tile.slice * TX + threadIdx.x;
  const int lane = threadIdx.y;
  const bool active = cv < NCV;
  const int col = cv * VEC;
  // Small grids only (the host's choice, ForwardParams::prefetch_early: at most 3 waves of
  // CTAs): the guessed window's prefetch, one thread per 128-byte line, before the
  // programmatic wait, so that its DRAM round trip overlaps the previous kernel's tail. H200,
  // kernel us: 128,2,512,1x4096 7.85 -> 7.39, 128,1,128,1x8192 7.07 -> 6.61, 128,1,128,1x4096
  // 4.69 -> 4.33. Every CTA prefetching on every grid lost 5-10 % from 5 waves on; only the
  // first wave prefetching lost the small grids' gain.
  if (p.prefetch_early && active)
    prefetch_lane_window<RATIO, COFF, HEAD_DIM, VEC, LANES>(p.score, p.kv, row, p.total_tokens, col,
                                                            lane);
  pdl_enter();
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

}  // namespace csa_kernel
