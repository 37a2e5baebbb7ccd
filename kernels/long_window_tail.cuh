// The tail epilogue (tail_epilogue.cuh) in the long-window family's lanes form, whose CTAs hold
// a column slice of a row (forward) or of a row group (backward), never a whole row:
//   forward, cluster form (sm_90+): the row's slices are one thread-block cluster, and the
//             first reads the others' pooled values from their shared memory (forward_cluster);
//   forward:  every slice's CTA writes its fp32 pooled values to p.pooled and arrives at its
//             row's claim word in p.row_arrivals; the row's last arrival reads the whole pooled row
//             back from L2 and runs the tail over it with all its threads (long_tail_vec
//             columns each), so y is written once, by one CTA, in one fixed order.
//   backward: every CTA reads each of its rows' grad_y and the forward's pooled row whole and
//             runs the tail's backward over it (the same op order as the short-window family),
//             keeping the pooled row's gradient of its own columns in shared memory; its
//             grad_w terms are the sum over its rows for its own columns (a partial, or added
//             into grad_w as grad_ape is);
//   backward, row-stats form (LongRowStats): tail_row_stats first writes each row's scalars,
//             then every thread of the backward runs the tail's backward of its own columns.
#pragma once
#include "long_window_common.cuh"
namespace csa_kernel {

template <class IO, int RATIO, int COFF, int HEAD_DIM, int THREADS>
struct LongTail {
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  using Tail = typename IO::Store;
  using E = typename IO::E;
  static constexpr int VEC = long_tail_vec(HEAD_DIM, THREADS);
  static_assert(VEC > 0, "the tail needs a CTA that whole rows' threads divide (long_tail_vec)");
  static constexpr int NCV = HEAD_DIM / VEC;

  static __device__ __forceinline__ int tid() {
    return static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  }

  // Every thread of the CTA, after its last use of shared memory: `value` is this thread's
  // pooled value of column `col` where `has_value`. SLICES: the row's column slices (CTAs).
  template <int SLICES>
  static __device__ __forceinline__ void forward(const ForwardParams& p, int row, int block,
                                                 bool has_value, int col, float value) {
    float* const pooled = p.pooled + static_cast<long long>(row) * HEAD_DIM;
    if (has_value) pooled[col] = value;
    const int t = tid();
    const bool has_row = t < NCV;
    const int c = (t % NCV) * VEC;
    // The operands first, in every CTA: their L2 round trip overlaps the arrival's.
    typename Tail::template Operands<VEC> op;
    Tail::template read_operands<VEC, HEAD_DIM>(p, c, has_row ? block : 0, op);
    __shared__ int last;
    __syncthreads();  // every pooled value of this CTA written
    if (threadIdx.x == 0 && threadIdx.y == 0) {
      int is_last = 1;
      if constexpr (SLICES > 1) {
        // The arrival releases this CTA's pooled values (the barrier above orders the other
        // threads' stores) and, for the last one, acquires the others'.
        is_last = claim_word::count_arrival(p.row_arrivals + row) + 1 == SLICES;
        // For the next launch (after this grid's end).
        if (is_last) claim_word::clear_arrivals(p.row_arrivals + row, SLICES);
      }
      last = is_last;
    }
    __syncthreads();
    if (!last) return;
    float x[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) x[v] = has_row ? __ldcg(pooled + c + v) : 0.0f;
    Tail::template store_row_with<E, VEC, HEAD_DIM, THREADS>(
        p, op, IO::out(p.out) + row * L::out_stride(p, p.out_stride) + c, row, c, has_row, x, t);
  }

  // The cluster form (Store::kCluster; the row's SLICES CTAs are one cluster, the slice its
  // rank), every thread of the CTA: `value` is this thread's pooled value of the slice's column
  // `slice_col` where `has_value`. Each slice keeps its values in shared memory; after the
  // cluster's barrier the first slice reads the whole row from the others' and runs the tail,
  // while they wait until it has read them. No global round trip, no arrival word; the pooled
  // rows go to p.pooled only where the caller keeps them.
  template <int SLICES, int COLS>
  static __device__ __forceinline__ void forward_cluster(const ForwardParams& p, int row, int block,
                                                         int slice, bool has_value, int slice_col,
                                                         float value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(SLICES < 0, "the cluster form needs sm_90 or newer");
#endif
    static_assert(SLICES >= 2 && SLICES <= kTailClusterMaxSlices, "a portable cluster of slices");
    static_assert(COLS % VEC == 0, "a thread's tail columns lie in one slice");
    __shared__ float slice_values[COLS];
    if (has_value) {
      slice_values[slice_col] = value;
      if (p.pooled != nullptr)
        p.pooled[static_cast<long long>(row) * HEAD_DIM + slice * COLS + slice_col] = value;
    }
    const int t = tid();
    const bool has_row = t < NCV;
    const int c = (t % NCV) * VEC;
    typename Tail::template Operands<VEC> op;
    if (slice == 0) Tail::template read_operands<VEC, HEAD_DIM>(p, c, has_row ? block : 0, op);
    cluster_arrive();  // this slice's values (and, with it, the CTA's) released
    cluster_wait();
    if (slice != 0) {
      // NOTE: this CTA's shared memory must outlive the first slice's reads of it.
      cluster_arrive();
      cluster_wait();
      return;
    }
    float x[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      x[v] = has_row ? load_cluster_f32(&slice_values[(c + v) % COLS], (c + v) / COLS) : 0.0f;
    cluster_arrive();  // the others may leave once every thread here has its values
    Tail::template store_row_with<E, VEC, HEAD_DIM, THREADS>(
        p, op, IO::out(p.out) + row * L::out_stride(p, p.out_stride) + c, row, c, has_row, x, t);
    cluster_wait();
  }

  // A row's inputs of the backward for this thread's columns (zero for threads without a row):
  // grad_y and, with the norm, the forward's pooled values; loaded a row ahead.
  struct RowInputs {
    float g[VEC];
    float x[VEC];
  };
  static __device__ __forceinline__ void load(const BackwardParams& p, int row, RowInputs& in) {
    const int t = tid();
    const int c = (t % NCV) * VEC;
    if (t < NCV) {
      raw_to_f32<E, VEC>(
          load_raw<E, VEC>(IO::in(p.grad_out) + row * L::out_stride(p, p.grad_out_stride) + c),
          in.g);
      if constexpr (Tail::kNorm) {
        load_f32_written<VEC>(p.pooled + static_cast<long long>(row) * HEAD_DIM + c, in.x);
        return;
      }
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) in.g[v] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) in.x[v] = 0.0f;  // only the norm's backward reads the row
  }

  // The operands of this thread's columns at the row's block (issued early, used by backward).
  static __device__ __forceinline__ void operands(const BackwardParams& p, int block,
                                                  typename Tail::template Operands<VEC>& op) {
    const int t = tid();
    Tail::template read_operands<VEC, HEAD_DIM>(p, (t % NCV) * VEC, t < NCV ? block : 0, op);
  }

  // Every thread of the CTA, once per row (`parity` alternating): the pooled row's gradient
  // of every column into gx[HEAD_DIM] (visible after the caller's next barrier), this
  // thread's grad_w terms added into dw (threads without a row add zeros, never written out).
  static __device__ __forceinline__ void backward(const BackwardParams& p, RowInputs& in,
                                                  const typename Tail::template Operands<VEC>& op,
                                                  int parity, float* gx, float (&dw)[VEC]) {
    const int t = tid();
    const int c = (t % NCV) * VEC;
    Tail::template backward_row_with<VEC, HEAD_DIM, THREADS>(p, op, c, t, parity, in.x, in.g, dw);
    if (t >= NCV) return;
#pragma unroll
    for (int v = 0; v < VEC; ++v) gx[c + v] = in.g[v];
  }

  // This CTA's grad_w terms (its row group, its columns [col0, col0 + cols)): its partial
  // written at `dst` (the group's head_dim floats), or (ATOMIC) added into grad_w at `dst`.
  template <bool ATOMIC>
  static __device__ __forceinline__ void grad_w_out(float* dst, int col0, int cols,
                                                    const float (&dw)[VEC]) {
    const int t = tid();
    if (t >= NCV) return;
    const int c = t * VEC;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      if (c + v < col0 || c + v >= col0 + cols) continue;
      if constexpr (ATOMIC) {
        atomicAdd(dst + c + v, dw[v]);
      } else {
        dst[c + v] = dw[v];
      }
    }
  }
};

// The tail backward's row-stats form in the lanes form (Store::kRowStats): each thread runs the
// tail's backward of its own VEC columns of a row from grad_y (the window's loads bring it), the
// forward's pooled values and the row's scalars that tail_row_stats wrote before this kernel, so
// no column slice repeats the row's work and no barrier waits for it.
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC>
struct LongRowStats {
  using Tail = typename IO::Store;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  static_assert(Tail::kRowStats, "the row-stats form's I/O policy");
  float x[VEC];
  typename Tail::template Operands<VEC> op;
  float2 stats;

  // After the row's window loads are issued: the pooled values and the operands, then (after the
  // programmatic wait, which only tail_row_stats's scalars need) the row's scalars.
  __device__ __forceinline__ void issue(const BackwardParams& p, int row, int col, int block,
                                        bool active) {
    if (active) {
      load_f32_written<VEC>(p.pooled + static_cast<long long>(row) * HEAD_DIM + col, x);
      Tail::template read_operands<VEC, HEAD_DIM>(p, col, block, op);
    }
    pdl_wait();
    if (active) stats = load_written(reinterpret_cast<const float2*>(p.row_stats) + row);
  }

  // `g`: grad_y of this thread's columns on entry, the pooled row's gradient on return; the
  // columns' grad_w terms added into `dw` (every window lane of a column alike: the kernel
  // writes lane 0's).
  __device__ __forceinline__ void apply(const BackwardParams& p, int row, int col, bool active,
                                        float (&g)[VEC], float (&dw)[VEC]) const {
    if (!active) return;
    Tail::template backward_columns<typename IO::E, VEC, HEAD_DIM>(
        IO::in(p.grad_out) + row * L::out_stride(p, p.grad_out_stride), col, op, stats, x, g, dw);
  }
};

// LongTail's per-row state types where the kernel has a tail, empty ones where it has not (so
// that a plain kernel never instantiates LongTail).
template <bool ON, class LT>
struct LongTailState {
  struct Row {};
  struct Operands {};
};

template <class LT>
struct LongTailState<true, LT> {
  using Row = typename LT::RowInputs;
  using Operands = typename LT::Tail::template Operands<LT::VEC>;
};

// LongRowStats where the kernel takes the row-stats form, an empty type elsewhere.
template <bool ON, class IO, int RATIO, int COFF, int HEAD_DIM, int VEC>
struct LongRowStatsState {
  struct Row {};
};
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC>
struct LongRowStatsState<true, IO, RATIO, COFF, HEAD_DIM, VEC> {
  using Row = LongRowStats<IO, RATIO, COFF, HEAD_DIM, VEC>;
};

}  // namespace csa_kernel
