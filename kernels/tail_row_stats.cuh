// The tail backward's row-stats form, its first kernel: one warp per pooled row reads the
// forward's fp32 pooled row and grad_y whole and writes the norm's two row scalars (rstd and
// its coefficient, kTailRowStatsFloats a row), so that the backward kernel after it holds
// column blocks of rows, as the plain kernel does, instead of whole rows (tail_epilogue.cuh).
#pragma once
#include "csa_io.cuh"

namespace csa_kernel {

template <class IO, int RATIO, int COFF, int HEAD_DIM, int THREADS>
__global__ void __launch_bounds__(THREADS)
    tail_row_stats(const __grid_constant__ BackwardParams p) {
  static_assert(THREADS % 32 == 0, "a warp per row");
  using Tail = typename IO::Store;
  using E = typename IO::E;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  static_assert(Tail::kNorm && !Tail::kHadamard, "the row-stats form: the norm, no Hadamard");
  static_assert(kTailRowStatsFloats == 2, "rstd and the coefficient");
  // Dependents after the wait: the backward kernel then reads its inputs before its own wait
  // (pdl_wait), which only these rows' scalars need.
  pdl_enter();
  // Columns (lane + 32 i) · VEC ...: two a lane where whole pairs of them tile the row.
  constexpr int VEC = HEAD_DIM % 64 == 0 ? 2 : 1;
  constexpr int SPAN = 32 * VEC;
  constexpr int PER_LANE = (HEAD_DIM + SPAN - 1) / SPAN;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int row = static_cast<int>(blockIdx.x * (THREADS / 32) + threadIdx.x / 32);
  if (row >= p.total_comp) return;
  const RowWindow w = L::locate(p, row);
  if (w.padding) return;  // gradients ignored: the backward skips the row
  const typename IO::T* const grad_y =
      IO::in(p.grad_out) + row * L::out_stride(p, p.grad_out_stride);
  const float* const pooled = p.pooled + static_cast<long long>(row) * HEAD_DIM;
  float sums[2] = {0.0f, 0.0f};  // Σx², Σ (w · gn) · x: each lane over its columns in order
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int c = lane * VEC + SPAN * i;
    if (HEAD_DIM % SPAN != 0 && c >= HEAD_DIM) break;
    typename Tail::template Operands<VEC> op;
    Tail::template read_operands<VEC, HEAD_DIM>(p, c, w.block, op);
    float g[VEC], x[VEC];
    load_vec<E, VEC>(grad_y + c, g);
    load_f32_written<VEC>(pooled + c, x);
    Tail::template rope_transposed_columns<E, VEC, HEAD_DIM>(grad_y, c, op, g);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      sums[0] = __fadd_rn(sums[0], __fmul_rn(x[v], x[v]));
      sums[1] = __fadd_rn(sums[1], __fmul_rn(__fmul_rn(op.w[v], g[v]), x[v]));
    }
  }
  row_sums<32, THREADS>(sums, nullptr, static_cast<int>(threadIdx.x));
  // The square root's rare path inline: called, it took a stack frame here.
  const float rstd = Tail::template rstd_of<HEAD_DIM, true>(sums[0], p.eps);
  const float coef = Tail::template norm_coefficient<HEAD_DIM>(rstd, sums[1]);
  if (lane == 0) reinterpret_cast<float2*>(p.row_stats)[row] = make_float2(rstd, coef);
}

}  // namespace csa_kernel
