// Long-window family, lanes form: the forward kernel (one row and one column slice per CTA).
#pragma once
#include "lane_window.cuh"
#include "long_window_tail.cuh"
namespace csa_kernel {

// Loads this thread's slots: s = score + ape (invalid: -inf), kv (invalid: 0).
// UNIFORM windows (lane_slot_base) load each slot at one 64-bit base per array plus an offset
// of j token steps (compile-time in packed THD), so the loads issue back to back instead of
// each behind its own 64-bit address arithmetic (docs/notes/measurements.md).
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES>
__device__ __forceinline__ void load_lane_window(
    const ForwardParams& p, const RowWindow& w, int col, int lane,
    float (&s)[LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>::C][VEC],
    float (&x)[LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>::C][VEC]) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  using E = typename IO::E;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  using Raw = RawVec<E, VEC>;
  const TokenRows sr = L::rows(p, p.score_stride);
  const TokenRows kr = L::rows(p, p.kv_stride);
  const typename IO::T* const score = IO::in(p.score);
  const typename IO::T* const kv = IO::in(p.kv);
  Raw rs[LW::C], rx[LW::C];
  float a[LW::C][VEC];
  if constexpr (LW::UNIFORM) {
    long long soff = 0, koff = 0;
    const bool valid = lane_slot_base<RATIO, COFF, HEAD_DIM, VEC, LANES>(w, sr, col, lane, soff);
    lane_slot_base<RATIO, COFF, HEAD_DIM, VEC, LANES>(w, kr, col, lane, koff);
    const int k0 = lane * LW::C;
    const typename IO::T* const score0 = score + soff;
    const typename IO::T* const kv0 = kv + koff;
    const float* const ape0 = p.ape + (valid ? G::ape_index(k0, col) : 0);
#pragma unroll
    for (int j = 0; j < LW::C; ++j) {
      if (valid) {
        rs[j] = load_raw<E, VEC>(score0 + sr.steps(j));
        rx[j] = load_raw<E, VEC>(kv0 + kr.steps(j));
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
        rs[j] = load_raw<E, VEC>(score + slot_offset<RATIO, COFF, HEAD_DIM>(w, sr, k, col));
        rx[j] = load_raw<E, VEC>(kv + slot_offset<RATIO, COFF, HEAD_DIM>(w, kr, k, col));
        load_f32<VEC>(p.ape + G::ape_index(k, col), a[j]);
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
    raw_to_f32<E, VEC>(rx[j], x[j]);
    float sc[VEC];
    raw_to_f32<E, VEC>(rs[j], sc);
#pragma unroll
    for (int v = 0; v < VEC; ++v) s[j][v] = __fadd_rn(sc[v], a[j][v]);
  }
}

// The serial forward keeps a column's window in one shared-memory row, padded by 4 floats so
// that the column rows' 16-byte reads spread over the banks, and sums it in slot order with
// 16-byte reads issued ahead of the additions (the sum is one chain of dependent adds).
constexpr int kSerialPad = 4;

template <int WIN>
__device__ __forceinline__ float serial_sum(const float* row) {
  float sum = 0.0f;
  if constexpr (WIN % 4 == 0) {
    const float4* quads = reinterpret_cast<const float4*>(row);
#pragma unroll
    for (int i = 0; i < WIN / 4; ++i) {
      const float4 q = quads[i];
      sum = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(sum, q.x), q.y), q.z), q.w);
    }
  } else {
#pragma unroll 16
    for (int k = 0; k < WIN; ++k) sum = __fadd_rn(sum, row[k]);
  }
  return sum;
}

// This thread's slots [k0, k0 + C) of value v into its column's row (slots past WIN dropped).
template <int C, int WIN, int VEC>
__device__ __forceinline__ void store_serial_slots(float* dst, const float (&vals)[C][VEC], int v,
                                                   int k0) {
  if constexpr (C % 4 == 0 && WIN % C == 0) {
    if (k0 >= WIN) return;  // a lane wholly past the window
#pragma unroll
    for (int j = 0; j < C; j += 4)
      *reinterpret_cast<float4*>(dst + j) =
          make_float4(vals[j][v], vals[j + 1][v], vals[j + 2][v], vals[j + 3][v]);
  } else {
#pragma unroll
    for (int j = 0; j < C; ++j)
      if (k0 + j < WIN) dst[j] = vals[j][v];
  }
}

// Lanes of one column within a warp (threads TX apart): their maxima meet by shuffles, so the
// CTA's threads read LANES / LANES_PER_WARP maxima from shared memory, not LANES (at 16
// columns and 32 lanes those reads were a third of the kernel's shared-memory wavefronts).
template <int TX, int LANES>
__host__ __device__ constexpr int serial_lanes_per_warp() {
  return TX < 32 && 32 % TX == 0 && LANES % (32 / TX) == 0 ? 32 / TX : 1;
}

// e / den, correctly rounded (bitwise __fdiv_rn) from inv = RN(1 / den), without a reciprocal
// per element: q1 is a faithful quotient after one correction, and Markstein's theorem makes
// the second correction RN(e / den) (remainders exact by FMA). Valid while nothing
// underflows: den in [1, window] (the max's e is 1) and e >= 2^-100; anything else (tiny e,
// NaN) takes div_rn_exact, exact there too. At 128,2,128 the per-element division was half of
// the serial forward's MUFU work (the other half is expf).
__device__ __forceinline__ float serial_quotient(float e, float den, float inv) {
  if (!(e >= 0x1p-100f) || !(den >= 1.0f && den <= 0x1p24f)) return div_rn_exact(e, den, inv);
  const float q0 = __fmul_rn(e, inv);
  const float q1 = __fmaf_rn(__fmaf_rn(-q0, den, e), inv, q0);
  return __fmaf_rn(__fmaf_rn(-q1, den, e), inv, q1);
}

// SERIAL: the lanes' maxima give the window max M (exact in any order), every thread forms
// e_k = expf(s_k - M) for its slots and stores them in its column's shared-memory row, one
// thread per column sums den in slot order, every thread forms round(kv_k * (e_k / den)) in
// place, and one thread per column sums those in slot order: out is bitwise equal to the
// fp32-intermediate reference (the row layout, shuffled maxima and one reciprocal per column
// keep that fast). Otherwise each lane keeps (lane max, sum e, sum kv*e) and the lanes merge
// in fixed order.
// Launch bounds: a chunked coff-1 CTA of up to 256 threads holding at most 16 window values a
// thread in vectors of 2 or more asks for 5 CTAs per SM (48 registers, no spill): one more
// window in flight per SM than the 56 registers it took otherwise. More values a thread, or
// the scalar columns of an odd head_dim, spill at 48 registers; coff-2 windows of that size
// (ratio <= 64) were not measured. Others keep the compiler's choice (3 CTAs for the 32-value
// windows of the 64-column buckets measured the same as without). fp32 with runtime strides
// (twice the raw bits a value, plus the strides) spilled 40 B at 48 registers on sm_80, so it
// keeps the compiler's choice too, as do tail kernels.
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES, bool SERIAL>
__host__ __device__ constexpr int forward_min_ctas(int threads) {
  constexpr int values = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>::C * VEC;
  if (SERIAL || COFF != 1 || VEC < 2 || threads > 256) return 1;
  // The tail's finishing row takes more registers than 48 (fp32 spilled 44 B there on sm_80).
  if (IO::Store::kCooperative) return 1;
  if (IO::kElement == kElementF32 && IO::kLayout != kLayoutThdPacked) return 1;
  return values <= 16 ? 5 : 1;
}

// The tail over a row whose slice's pooled value of column `col` this thread holds (where
// `finishes`): the cluster form's, else the last slice's to arrive (long_window_tail.cuh).
template <class Tail, int SLICES, int COLS, bool CLUSTER>
__device__ __forceinline__ void finish_tail(const ForwardParams& p, int row, int block, int slice,
                                            bool finishes, int col, float value) {
  if constexpr (CLUSTER) {
    Tail::template forward_cluster<SLICES, COLS>(p, row, block, slice, finishes, col - slice * COLS,
                                                 value);
  } else {
    Tail::template forward<SLICES>(p, row, block, finishes, col, value);
  }
}

template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int LANES, bool SERIAL,
          bool FAST_EXP>
__global__ void __launch_bounds__(
    TX* LANES, forward_min_ctas<IO, RATIO, COFF, HEAD_DIM, VEC, LANES, SERIAL>(TX* LANES))
    lane_window_forward(const __grid_constant__ ForwardParams p) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  static_assert(LANES >= VEC, "lanes 0..VEC-1 finish the columns");
  static_assert(!(SERIAL && FAST_EXP), "the serial order is the bitwise contract: exact expf");
  constexpr int NCV = HEAD_DIM / VEC;
  constexpr int COLS = TX * VEC;
  constexpr int SLICES = (NCV + TX - 1) / TX;
  // The tail: the row's last slice runs it over the whole row (long_window_tail.cuh), or in
  // the cluster form the first, from the slices' shared memory; in the row-kernel form
  // (IO::Store::kRowKernel) each slice writes its fp32 pooled values and tail_rows_forward runs the
  // tail after this kernel.
  constexpr bool kTail = IO::Store::kCooperative;
  constexpr bool kRowKernel = IO::Store::kRowKernel;
  using Tail = LongTail<IO, RATIO, COFF, HEAD_DIM, TX * LANES>;
  __shared__ float sm_m[LANES][COLS], sm_den[LANES][COLS], sm_acc[LANES][COLS];
  // SERIAL: one column's window of e (then of products) per row, padded (kSerialPad).
  __shared__ __align__(16) float sm_e[SERIAL ? COLS : 1][SERIAL ? LW::WIN + kSerialPad : 1];
  const ForwardTile<SLICES> tile;
  const int row = tile.row;
  const int cv = tile.slice * TX + threadIdx.x;
  const int lane = threadIdx.y;
  const bool active = cv < NCV;
  const int col = cv * VEC;
  // Small grids only (the host's choice, ForwardParams::prefetch_early: at most 3 waves of
  // CTAs): the guessed window's prefetch, one thread per 128-byte line, before the
  // programmatic wait, so that its DRAM round trip overlaps the previous kernel's tail. On
  // larger grids it slowed the kernel, and prefetching in the first wave only lost the small
  // grids' gain.
  if (p.prefetch_early && active)
    prefetch_lane_window<IO, RATIO, COFF, HEAD_DIM, VEC, LANES>(p, row, col, lane);
  pdl_enter();
  const RowWindow w = L::locate(p, row);
  float s[LW::C][VEC], x[LW::C][VEC];
  if (active) {
    load_lane_window<IO, RATIO, COFF, HEAD_DIM, VEC, LANES>(p, w, col, lane, s, x);
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
    constexpr int LPW = serial_lanes_per_warp<TX, LANES>();
    // e stays in s: each thread forms its own slots' products after den is known.
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float m = neg_inf();
#pragma unroll
      for (int j = 0; j < LW::C; ++j) m = fmaxf(m, s[j][v]);
      if constexpr (LPW > 1) {
#pragma unroll
        for (int offset = TX; offset < 32; offset *= 2)
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      }
      if (lane % LPW == 0) sm_m[lane / LPW][threadIdx.x * VEC + v] = m;
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      // Every load first (full unroll).
      const float M = strided_max<LANES / LPW, LANES / LPW>(&sm_m[0][c], COLS);
#pragma unroll
      for (int j = 0; j < LW::C; ++j) s[j][v] = expf(__fsub_rn(s[j][v], M));
      store_serial_slots<LW::C, LW::WIN>(&sm_e[c][lane * LW::C], s, v, lane * LW::C);
    }
    __syncthreads();
    if (lane < VEC)
      sm_den[0][threadIdx.x * VEC + lane] = serial_sum<LW::WIN>(&sm_e[threadIdx.x * VEC + lane][0]);
    __syncthreads();
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      const float den = sm_den[0][c];
      const float inv = __frcp_rn(den);
#pragma unroll
      for (int j = 0; j < LW::C; ++j)
        s[j][v] = __fmul_rn(x[j][v], serial_quotient(s[j][v], den, inv));
      store_serial_slots<LW::C, LW::WIN>(&sm_e[c][lane * LW::C], s, v, lane * LW::C);
    }
    __syncthreads();
    if constexpr (kTail) {
      const bool finishes = lane < VEC && active;
      finish_tail<Tail, SLICES, COLS, IO::Store::kCluster>(
          p, row, w.block, tile.slice, finishes, col + lane,
          finishes ? serial_sum<LW::WIN>(&sm_e[threadIdx.x * VEC + lane][0]) : 0.0f);
    } else {
      if (lane >= VEC || !active) return;
      const float out[1] = {serial_sum<LW::WIN>(&sm_e[threadIdx.x * VEC + lane][0])};
      if constexpr (kRowKernel) {
        p.pooled[static_cast<long long>(row) * HEAD_DIM + col + lane] = out[0];
      } else {
        IO::Store::template store<typename IO::E, 1>(
            IO::out(p.out) + row * L::out_stride(p, p.out_stride) + col + lane, row, col + lane,
            out);
      }
    }
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
    const bool finishes = lane < VEC && active;
    if (!kTail && !finishes) return;
    float out[1] = {0.0f};
    if (finishes) {
      const int c = threadIdx.x * VEC + lane;
      const float M = merged_max<LANES, FAST_EXP>(&sm_m[0][c], COLS);
      const float total_den = merged_sum<LANES, FAST_EXP>(&sm_m[0][c], &sm_den[0][c], COLS, M);
      const float total_acc = merged_sum<LANES, FAST_EXP>(&sm_m[0][c], &sm_acc[0][c], COLS, M);
      // Correctly rounded while den and the quotient stay normal (den >= 1: the window max's e
      // is 1); no slow-path call (tolerance contract).
      out[0] = div_rn_fast(total_acc, total_den, refined_reciprocal(total_den));
    }
    if constexpr (kTail) {
      finish_tail<Tail, SLICES, COLS, IO::Store::kCluster>(p, row, w.block, tile.slice, finishes,
                                                           col + lane, out[0]);
    } else if constexpr (kRowKernel) {
      p.pooled[static_cast<long long>(row) * HEAD_DIM + col + lane] = out[0];
    } else {
      IO::Store::template store<typename IO::E, 1>(
          IO::out(p.out) + row * L::out_stride(p, p.out_stride) + col + lane, row, col + lane, out);
    }
  }
}

}  // namespace csa_kernel
