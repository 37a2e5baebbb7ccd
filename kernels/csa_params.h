// What the host and the kernels (NVRTC) must agree on: the by-value kernel arguments and the
// compile-time kinds of element type, layout and epilogue that select a kernel's I/O policy.
// Both compilers see this header; the sizes are checked on both sides (static_assert below).
// NOTE: only 8-byte pointers and 4-byte ints, ordered so that no padding differs between
// compilers.
#pragma once

#ifdef __CUDACC_RTC__
typedef int csa_i32;
typedef unsigned int csa_u32;
typedef unsigned short csa_u16;
#define CSA_SHARED_FN __host__ __device__ constexpr
#else
#include <cstdint>
typedef std::int32_t csa_i32;
typedef std::uint32_t csa_u32;
typedef std::uint16_t csa_u16;
#define CSA_SHARED_FN constexpr
#endif

namespace csa_kernel {

// Element type of kv, score, out, grad_out, grad_kv and grad_score (ape and grad_ape are fp32).
enum ElementKind : int { kElementBf16 = 0, kElementF16 = 1, kElementF32 = 2 };
// Where a token's row lies. kLayoutThdPacked: THD rows of exactly the tensor's width
// (compile-time offsets); kLayoutThdStrided: THD rows `*_stride` elements apart; kLayoutSbhd:
// (S, B, width) rows `*_stride` elements apart, every batch column one segment of S tokens.
enum LayoutKind : int { kLayoutThdPacked = 0, kLayoutThdStrided = 1, kLayoutSbhd = 2 };
// How the forward stores a pooled row (kEpilogueIdentity: rounded once to the element type).
// A tail epilogue (RMSNorm, RoPE, Hadamard before the rounding) is a code with kEpilogueTail
// set: its stages in the bits below and rope_dim from bit kTailRopeShift (tail_epilogue).
enum EpilogueKind : int { kEpilogueIdentity = 0, kEpilogueTail = 1 };
enum TailBits : int {
  kTailNorm = 2,
  kTailNormWeightF32 = 4,  // else bf16
  kTailRopeInterleaved = 8,
  kTailHadamard = 16,
  // The backward's row-stats form: the norm's two row scalars come from a first kernel over the
  // forward's pooled rows (tail_row_stats), so the backward's CTAs hold column blocks of rows
  // as the plain kernel's do. Never with the Hadamard transform (its gradient couples the row).
  kTailRowStats = 32,
  // The long-window forward's row-kernel form: the pooling's column slices write the fp32
  // pooled rows only, and tail_rows_forward then runs the tail over each row whole.
  kTailRowKernel = 64,
  // The long-window forward's cluster form (sm_90 and newer): a row's column slices are one
  // thread-block cluster, and the first runs the tail over the row read from the others' shared
  // memory.
  kTailCluster = 128,
  kTailRopeShift = 8,
};

CSA_SHARED_FN int tail_epilogue(bool norm, bool weight_f32, int rope_dim, bool interleaved,
                                bool hadamard) {
  return kEpilogueTail | (norm ? kTailNorm : 0) | (norm && weight_f32 ? kTailNormWeightF32 : 0) |
         (rope_dim > 0 && interleaved ? kTailRopeInterleaved : 0) | (hadamard ? kTailHadamard : 0) |
         (rope_dim << kTailRopeShift);
}
CSA_SHARED_FN int tail_rope_dim(int code) {
  return code >> kTailRopeShift;
}
// The row-stats form of a tail code (kTailRowStats).
CSA_SHARED_FN int tail_row_stats_code(int code) {
  return code | kTailRowStats;
}
// The row-kernel form of a tail code (kTailRowKernel).
CSA_SHARED_FN int tail_row_kernel_code(int code) {
  return code | kTailRowKernel;
}
// The cluster form of a tail code (kTailCluster).
CSA_SHARED_FN int tail_cluster_code(int code) {
  return code | kTailCluster;
}
// The most column slices (CTAs) of a row in the cluster form: the portable cluster size.
constexpr int kTailClusterMaxSlices = 8;
// The row scalars tail_row_stats writes per pooled row: rstd, then the norm's coefficient
// rstd³ · Σ_j (w_j · g_j) · x_j / head_dim of the row's gradient g (after RoPE's transpose).
constexpr int kTailRowStatsFloats = 2;

// Threads holding one row in a tail kernel (every column of a row in one CTA): a power of two
// up to a warp (xor shuffles stay in the row) or whole warps, at most 256 (the tail's shared
// memory, 16 bytes a column and more, stays within a CTA's static 48 KB).
CSA_SHARED_FN bool tail_row_threads_ok(int threads) {
  return threads >= 1 && threads <= 256 &&
         (threads % 32 == 0 || (threads <= 32 && (threads & (threads - 1)) == 0));
}
// The widest head_dim a tail kernel serves (256 threads of 4 columns).
constexpr int kTailMaxHeadDim = 1024;

// The short-window backward's forms (its last template argument, after its residency), which
// register fitting tries in this order where the default still uses local memory: the same
// bytes out, with fewer constraints on the registers (kernels/short_window.cuh).
enum ShortWindowBackwardForm : int {
  kBackwardFormDefault = 0,
  // one row lane's partials written a float at a time (vector stores need aligned registers)
  kBackwardFormScalarPartials = 1,
  kBackwardFormZerosFirst = 2,  // that, and the zeros no pooled row owns written before the rows
  kBackwardFormLean = 3,        // that, and nothing else held across the rows it can re-derive
  kBackwardFormLeanColumn = 4,  // lean, and each row's column taken from the special registers
  kShortWindowBackwardForms = 5,
};

// Whether rows of `head_dim` columns, `v` a thread, lie whole in a CTA of `threads` threads: a
// power of two of row threads that tail_row_threads_ok takes, dividing the CTA.
CSA_SHARED_FN bool tail_rows_fit(int head_dim, int threads, int v) {
  if (head_dim % v != 0) return false;
  const int row_threads = head_dim / v;
  return (row_threads & (row_threads - 1)) == 0 && row_threads <= threads &&
         threads % row_threads == 0 && tail_row_threads_ok(row_threads);
}
// The long-window family's tail runs once a row is complete, over a CTA of `threads` threads
// (the lanes form's, a power of two): the columns each thread holds, 1, 2, 4 or 8, the fewest
// that fit (tail_rows_fit); 0 where none does (head_dim not a power of two, or wider than 8
// columns a thread).
CSA_SHARED_FN int long_tail_vec(int head_dim, int threads) {
  for (int v = 1; v <= 8; v *= 2)
    if (tail_rows_fit(head_dim, threads, v)) return v;
  return 0;
}

// Columns a thread of tail_rows_forward holds (`threads` a CTA holding whole rows): 4, else 2,
// 1 or 8, the first that fits (tail_rows_fit; 0: none).
CSA_SHARED_FN int tail_rows_vec(int head_dim, int threads) {
  const int order[4] = {4, 2, 1, 8};
  for (int v : order)
    if (tail_rows_fit(head_dim, threads, v)) return v;
  return 0;
}

CSA_SHARED_FN int element_bytes(int kind) {
  return kind == kElementF32 ? 4 : 2;
}

// Elements of one 16-byte access (the ring's cp.async chunk, the widest vector load).
CSA_SHARED_FN int chunk_elements(int kind) {
  return 16 / element_bytes(kind);
}

// Shared memory of the long-window kernels, which the host sizes their launches with.
// LaneRing's stage, in elements: score and kv of (window + one pad row per lane) rows of `cols`
// columns, then grad_out's `cols`, padded to 16 bytes.
CSA_SHARED_FN int lane_ring_stage_elements(int element, int window, int lanes, int cols) {
  return (2 * (window + lanes) * cols + cols + chunk_elements(element) - 1) /
         chunk_elements(element) * chunk_elements(element);
}
// Whether a lanes-form backward with the ring (stages > 1) of `threads` threads holding
// `window_values` window values each (slots a lane x vector width) fits 64 registers a thread,
// two CTAs an SM: it then keeps ape in the ring's shared memory, and takes no row-stats tail.
CSA_SHARED_FN bool lane_ring_tight_registers(int threads, int window_values) {
  return threads > 256 && window_values <= 8;
}
// The staged form's tiles, in bytes: e[window][cols], red[3][chunks][cols] and col[4][cols] in
// fp32, then kv[window][cols] in the element type.
CSA_SHARED_FN int staged_window_bytes(int element, int window, int chunks, int cols) {
  return (window * cols + 3 * chunks * cols + 4 * cols) * 4 +
         window * cols * element_bytes(element);
}

// Division by a divisor known only at launch (SBHD's batch B, which splits an output row into
// its block and batch column) as a multiply-high, an add and a shift: n / d ==
// (umulhi(n, multiplier) + n) >> shift for 0 <= n < 2^31 and 1 <= d < 2^31 (the round-up method
// of Granlund and Montgomery). The host fills it with row_divisor; the kernels apply it with
// divide_row.
struct RowDivisor {
  csa_u32 multiplier;
  csa_i32 shift;
};
CSA_SHARED_FN RowDivisor row_divisor(csa_i32 divisor) {
  csa_i32 shift = 0;
  while ((1LL << shift) < divisor) ++shift;
  // floor(2^32 (2^shift - d) / d) + 1: below 2^32, as 2^shift < 2 d.
  const unsigned long long multiplier =
      (((1ULL << shift) - static_cast<unsigned long long>(divisor)) << 32) /
          static_cast<unsigned long long>(divisor) +
      1;
  return RowDivisor{static_cast<csa_u32>(multiplier), shift};
}
CSA_SHARED_FN csa_i32 divide_row(csa_i32 row, RowDivisor d) {
  const csa_u32 n = static_cast<csa_u32>(row);
  const csa_u32 high =
      static_cast<csa_u32>((static_cast<unsigned long long>(n) * d.multiplier) >> 32);
  return static_cast<csa_i32>((high + n) >> d.shift);  // no carry out: high <= n < 2^31
}

struct ForwardParams {
  const void* kv;
  const void* score;
  const float* ape;
  const csa_i32* cu_seqlens;       // THD only (SBHD: null)
  const csa_i32* cu_seqlens_comp;  // THD only (SBHD: null)
  void* out;
  csa_i32 total_tokens;    // rows of kv / score (SBHD: S * B)
  csa_i32 num_segments;    // SBHD: B
  csa_i32 total_comp;      // rows of out (SBHD: (S / ratio) * B)
  csa_i32 prefetch_early;  // lane-window forward: prefetch the window before the wait (host)
  // Row strides in elements (strided layouts; the packed layout ignores them).
  csa_i32 kv_stride;
  csa_i32 score_stride;
  csa_i32 out_stride;
  csa_i32 seq_len;           // SBHD: S
  RowDivisor batch_divisor;  // SBHD: of B
  // The tail epilogue's tensors (unused by the identity epilogue).
  const void* norm_weight;  // (head_dim,) bf16 or fp32
  const float* rope_cos;    // (rope_max_blocks, rope_dim / 2)
  const float* rope_sin;
  float* rstd;  // (total_comp,) or null
  // The long-window family's tail: every column slice's CTA writes its fp32 pooled values to
  // `pooled` (total_comp, head_dim) and arrives at its row's claim word in `row_arrivals`
  // (claim_word::count_arrival: words of the claim-word pool, which grad_ape's claims share;
  // the row's last arrival runs the tail over the whole row and clears its arrivals).
  float* pooled;
  unsigned long long* row_arrivals;
  float eps;
  csa_i32 rope_max_blocks;
};

struct BackwardParams {
  const void* kv;
  const void* score;
  const float* ape;
  const csa_i32* cu_seqlens;
  const csa_i32* cu_seqlens_comp;
  const void* grad_out;
  void* grad_kv;
  void* grad_score;
  float* grad_ape;  // atomic mode: the adds go straight into it
  // Fixed-order mode: one (ratio, W) partial per row group. Atomic mode: null (grad_ape zeroed
  // by the host, or accumulated into), or claim words (8 bytes, one per column block, zero
  // when allocated and left so by every launch), with which the kernel zeroes grad_ape itself
  // first (claim_zero_if_first).
  float* workspace;
  csa_i32 total_tokens;
  csa_i32 num_segments;
  csa_i32 total_comp;
  csa_i32 rows_per_cta;
  csa_i32 accumulate;  // reference family: add into grad_ape instead of overwriting
  csa_i32 kv_stride;
  csa_i32 score_stride;
  csa_i32 grad_out_stride;
  csa_i32 grad_kv_stride;
  csa_i32 grad_score_stride;
  csa_i32 seq_len;
  RowDivisor batch_divisor;
  csa_i32 reserved;  // keeps the size a multiple of 8 on both sides
  // The tail epilogue's tensors (unused by the identity epilogue); grad_w is summed as
  // grad_ape is: its partials after grad_ape's in each row group's workspace block (the fixed
  // order), or added into grad_w by the kernel (atomic).
  const void* norm_weight;
  const float* rope_cos;
  const float* rope_sin;
  float* grad_w;        // the norm weight's gradient: the atomic form zeroes and adds into it
  const float* pooled;  // the tail's pooled rows (fp32): long-window family, row-stats form
  // The row-stats form: kTailRowStatsFloats per pooled row, written by tail_row_stats.
  float* row_stats;
  float eps;
  csa_i32 rope_max_blocks;
};

struct ApeReduceParams {
  const float* workspace;
  float* grad_ape;
  // With the tail's norm: element ape_elements + j of a group's partials is grad_w[j].
  float* grad_w;
  csa_i32 elements;      // per group: ratio * W (+ head_dim with grad_w)
  csa_i32 ape_elements;  // ratio * W
  csa_i32 groups;        // row groups written by the backward kernel
  csa_i32 accumulate;
  csa_i32 dependents_first;  // the grid is one wave: see pdl_enter()
  csa_i32 reserved;
};

struct OffsetCheckParams {
  const csa_i32* cu_seqlens;
  const csa_i32* cu_seqlens_comp;
  csa_i32* report;  // [0]: first bad index or -1, [1]: rule id
  csa_i32 num_segments;
  csa_i32 total_tokens;
  csa_i32 total_comp;
  csa_i32 ratio;
};

static_assert(sizeof(RowDivisor) == 2 * 4, "RowDivisor layout");
static_assert(sizeof(ForwardParams) == 12 * 8 + 12 * 4, "ForwardParams layout");
static_assert(sizeof(BackwardParams) == 16 * 8 + 16 * 4, "BackwardParams layout");
static_assert(sizeof(ApeReduceParams) == 3 * 8 + 6 * 4, "ApeReduceParams layout");
static_assert(sizeof(OffsetCheckParams) == 3 * 8 + 4 * 4, "OffsetCheckParams layout");

}  // namespace csa_kernel
