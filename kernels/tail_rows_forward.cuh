// The long-window forward's row-kernel form, its second kernel: after the pooling wrote the
// fp32 pooled rows (the column slices of lane_window_forward), each CTA holds whole rows
// (tail_rows_vec columns a thread) and runs the tail over them: y rounded once, and rstd
// (tail_epilogue.cuh), in the op order of every tail form.
#pragma once
#include "csa_io.cuh"

namespace csa_kernel {

template <class IO, int RATIO, int COFF, int HEAD_DIM, int THREADS>
__global__ void __launch_bounds__(THREADS)
    tail_rows_forward(const __grid_constant__ ForwardParams p) {
  using Tail = typename IO::Store;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  static_assert(Tail::kRowKernel, "the row-kernel form's I/O policy");
  constexpr int VEC = tail_rows_vec(HEAD_DIM, THREADS);
  static_assert(VEC > 0, "whole rows in the CTA (tail_rows_vec)");
  constexpr int NCV = HEAD_DIM / VEC;
  // The pooled rows are the previous kernel's: nothing is read before the wait.
  pdl_enter();
  const int t = static_cast<int>(threadIdx.x);
  const int row = static_cast<int>(blockIdx.x) * (THREADS / NCV) + t / NCV;
  const int c = (t % NCV) * VEC;
  // NOTE: every thread of the CTA takes part in its rows' sums and exchanges, with or without
  // a row (store_row_with).
  const bool has_row = row < p.total_comp;
  const RowWindow w = L::locate(p, has_row ? row : 0);
  typename Tail::template Operands<VEC> op;
  Tail::template read_operands<VEC, HEAD_DIM>(p, c, has_row ? w.block : 0, op);
  float x[VEC];
  if (has_row) {
    load_f32_written<VEC>(p.pooled + static_cast<long long>(row) * HEAD_DIM + c, x);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = 0.0f;
  }
  Tail::template store_row_with<typename IO::E, VEC, HEAD_DIM, THREADS>(
      p, op, IO::out(p.out) + (has_row ? row : 0) * L::out_stride(p, p.out_stride) + c, row, c,
      has_row, x, t);
}

}  // namespace csa_kernel
