// Long-window family, lanes form (the shipped one): thread (x, lane) holds the slots
// [lane*C, (lane+1)*C) of its VEC columns in registers (C = ceil(WIN / LANES)); lanes merge
// their softmax partials (max, sum of e, sum of kv*e) through shared memory in fixed lane
// order, or (forward, SERIAL) sum in slot order through shared memory. No staging round trip,
// so occupancy is bounded by registers. This file: the window geometry, the guessed-window
// prefetch and the lane arithmetic both directions share; the kernels are in
// lane_window_forward.cuh and lane_window_backward.cuh.
#pragma once
#include "long_window_common.cuh"
namespace csa_kernel {

template <int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES>
struct LaneWindow {
  static constexpr int W = COFF * HEAD_DIM;
  static constexpr int WIN = COFF * RATIO;
  static constexpr int C = (WIN + LANES - 1) / LANES;
  // Where C divides the ratio, a lane's C slots lie in one half of the window, on consecutive
  // tokens, all valid or all not: one base offset and compile-time steps of W address them.
  static constexpr bool UNIFORM = RATIO % C == 0;
  using Geometry = LongWindow<RATIO, COFF, HEAD_DIM, 32, 32>;  // slot geometry only
};

// The first slot of this lane (UNIFORM windows only): whether the lane's slots are valid and,
// if so, the element offset of slot lane * C in a tensor whose rows are `rows` (slot j of the
// lane is `offset + j * rows.step`).
// NOTE: 64 bits, so that every slot's access is the base plus an immediate (packed THD).
template <int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES>
__device__ __forceinline__ bool lane_slot_base(const RowWindow& w, const TokenRows& rows, int col,
                                               int lane, long long& offset) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  static_assert(LW::UNIFORM, "lane_slot_base needs C to divide the ratio");
  const int k0 = lane * LW::C;
  const bool valid = k0 < LW::WIN && G::valid(k0, w.first);
  offset = valid ? slot_offset<RATIO, COFF, HEAD_DIM>(w, rows, k0, col)
                 : static_cast<long long>(G::half_offset(k0) + col);
  return valid;
}

// Whether a column starts a 128-byte line of its token.
template <class IO>
__device__ __forceinline__ bool starts_line(int col) {
  return col % (128 / static_cast<int>(sizeof(typename IO::T))) == 0;
}

// This thread's slots of `row`'s window at the guessed place (Layout::guess), issued only by
// the thread whose columns start a 128-byte line: the sector there, for the lines its CTA's
// loads, or its ring's copies, will read.
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES, class P>
__device__ __forceinline__ void prefetch_lane_window(const P& p, int row, int col, int lane) {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  const RowWindow w = L::guess(p, row);
  if (w.padding || !starts_line<IO>(col)) return;
  const TokenRows sr = L::rows(p, p.score_stride);
  const TokenRows kr = L::rows(p, p.kv_stride);
#pragma unroll
  for (int j = 0; j < LW::C; ++j) {
    const int k = lane * LW::C + j;
    if (k < LW::WIN && G::valid(k, w.first)) {
      prefetch_l2(IO::in(p.score) + slot_offset<RATIO, COFF, HEAD_DIM>(w, sr, k, col));
      prefetch_l2(IO::in(p.kv) + slot_offset<RATIO, COFF, HEAD_DIM>(w, kr, k, col));
    }
  }
}

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
// The max of N values `stride` apart (exact in any order), the loop unrolled UNROLL deep.
template <int N, int UNROLL>
__device__ __forceinline__ float strided_max(const float* m, int stride) {
  float M = neg_inf();
#pragma unroll UNROLL
  for (int q = 0; q < N; ++q) M = fmaxf(M, m[q * stride]);
  return M;
}

template <int LANES, bool FAST_EXP>
__device__ __forceinline__ float merged_max(const float* m, int stride) {
  return strided_max<LANES, 8>(m, stride);
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

}  // namespace csa_kernel
