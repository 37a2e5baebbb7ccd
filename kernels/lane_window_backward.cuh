// Long-window family, lanes form: the backward kernel (a group of rows and one column slice
// per CTA), its window loads, its shared-memory ring and its merge of a column's lanes.
#pragma once
#include "lane_window.cuh"
#include "long_window_tail.cuh"
namespace csa_kernel {

// The backward's loads of one row's window: raw elements issued together, then turned into s
// and kv. ape is row-independent and held in registers for the whole CTA.
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int LANES>
struct LaneLoads {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  using E = typename IO::E;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  using Raw = RawVec<E, VEC>;
  Raw score[LW::C], kv[LW::C], grad_out;

  __device__ __forceinline__ void issue(const BackwardParams& p, const RowWindow& w, int row,
                                        int col, int lane, bool active) {
    grad_out =
        active
            ? load_raw<E, VEC>(IO::in(p.grad_out) + row * L::out_stride(p, p.grad_out_stride) + col)
            : Raw{};
    const TokenRows sr = L::rows(p, p.score_stride);
    const TokenRows kr = L::rows(p, p.kv_stride);
    if constexpr (LW::UNIFORM) {
      long long soff = 0, koff = 0;
      const bool valid =
          active && lane_slot_base<RATIO, COFF, HEAD_DIM, VEC, LANES>(w, sr, col, lane, soff);
      lane_slot_base<RATIO, COFF, HEAD_DIM, VEC, LANES>(w, kr, col, lane, koff);
      const typename IO::T* const score0 = IO::in(p.score) + soff;
      const typename IO::T* const kv0 = IO::in(p.kv) + koff;
#pragma unroll
      for (int j = 0; j < LW::C; ++j) {
        score[j] = valid ? load_raw<E, VEC>(score0 + sr.steps(j)) : Raw{};
        kv[j] = valid ? load_raw<E, VEC>(kv0 + kr.steps(j)) : Raw{};
      }
    } else {
#pragma unroll
      for (int j = 0; j < LW::C; ++j) {
        const int k = lane * LW::C + j;
        if (active && k < LW::WIN && G::valid(k, w.first)) {
          score[j] =
              load_raw<E, VEC>(IO::in(p.score) + slot_offset<RATIO, COFF, HEAD_DIM>(w, sr, k, col));
          kv[j] =
              load_raw<E, VEC>(IO::in(p.kv) + slot_offset<RATIO, COFF, HEAD_DIM>(w, kr, k, col));
        } else {
          score[j] = Raw{};
          kv[j] = Raw{};
        }
      }
    }
  }

  // s = score + ape (invalid slots: -inf), kv (invalid: 0).
  __device__ __forceinline__ void finish(const float (&ape)[LW::C][VEC], const RowWindow& w,
                                         int lane, float (&s)[LW::C][VEC], float (&x)[LW::C][VEC],
                                         float (&g)[VEC]) const {
    raw_to_f32<E, VEC>(grad_out, g);
#pragma unroll
    for (int j = 0; j < LW::C; ++j) {
      const int k = lane * LW::C + j;
      const bool valid = k < LW::WIN && G::valid(k, w.first);
      float sc[VEC];
      raw_to_f32<E, VEC>(score[j], sc);
      raw_to_f32<E, VEC>(kv[j], x[j]);
#pragma unroll
      for (int v = 0; v < VEC; ++v) s[j][v] = valid ? __fadd_rn(sc[v], ape[j][v]) : neg_inf();
    }
  }
};

// The backward's ring of STAGES rows (STAGES >= 2): score and kv of the window for the CTA's
// COLS columns, and grad_out, copied by the whole CTA with 16-byte cp.async while earlier rows
// are computed, so a row's DRAM round trip overlaps the previous rows' arithmetic and barriers
// without holding the loads in registers. Needs head_dim and COLS multiples of a 16-byte chunk
// (CH elements; the pointers and row strides are 16-byte aligned by contract).
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int LANES>
struct LaneRing {
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using G = typename LW::Geometry;
  using E = typename IO::E;
  using T = typename IO::T;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  using Raw = RawVec<E, VEC>;
  static constexpr int CH = chunk_elements(IO::kElement);
  static constexpr int COLS = TX * VEC;
  static constexpr int THREADS = TX * LANES;
  // 16-byte chunks per slot and array. The host gives the ring (STAGES > 1) only column blocks
  // of whole chunks; narrower blocks (head_dim < CH) still instantiate this class, so CHUNKS
  // stays at least 1 there for its constants, never used.
  static constexpr int CHUNKS = COLS >= CH ? COLS / CH : 1;
  // One pad row after each lane's block of C slots: the lanes of one warp read different banks.
  static constexpr int ROWS = LW::WIN + LANES;
  static __device__ __forceinline__ int slot_row(int k) { return k + k / LW::C; }
  // Per stage, in elements: score[ROWS][COLS] | kv[ROWS][COLS] | grad_out[COLS], padded to 16
  // bytes (lane_ring_stage_elements, which the host sizes the shared memory with).
  static constexpr int STAGE_ELEMS = lane_ring_stage_elements(IO::kElement, LW::WIN, LANES, COLS);

  // BLOCKED: every pass of the CTA's threads over the copies covers SLOTS_PER_PASS whole slots
  // of one array, inside one half of the window and starting at a multiple of C. Then a
  // thread's (slot within the pass, 16-byte chunk) is the same in every pass and every row, and
  // each pass adds compile-time offsets only: one 64-bit source base per row and array, one
  // shared-memory base per thread. The generic mapping rebuilt every copy's slot, token and
  // both addresses from the copy index on every row (sm_90 SASS of the 128,2,512 v2 c16 t256
  // ring backward: ~270 integer instructions a row for 4 copies a thread).
  static constexpr int SLOTS_PER_PASS = THREADS / CHUNKS;
  static constexpr bool BLOCKED = THREADS % CHUNKS == 0 && (LW::WIN * CHUNKS) % THREADS == 0 &&
                                  RATIO % SLOTS_PER_PASS == 0 && SLOTS_PER_PASS % LW::C == 0;

  static __device__ __forceinline__ void fetch_blocked(T* stage, const BackwardParams& p,
                                                       const RowWindow& w, int tid, int col0) {
    constexpr int PASSES = 2 * LW::WIN * CHUNKS / THREADS;
    const int t = tid / CHUNKS;                 // slot within a pass
    const int chunk = (tid - t * CHUNKS) * CH;  // first column within the CTA's columns
    const bool col_ok = col0 + chunk < HEAD_DIM;
    const TokenRows rows[2] = {L::rows(p, p.score_stride), L::rows(p, p.kv_stride)};
    const T* const srcs[2] = {IO::in(p.score), IO::in(p.kv)};
    // NOTE: 64-bit: the token offsets reach total_tokens * stride. Slot k0 + t of a pass lies
    // on token k0 + t - (COFF - 1) * RATIO of the block; the base is only formed, and only
    // used where the pass's slots are valid (then that token is in range).
    long long base[2];
#pragma unroll
    for (int a = 0; a < 2; ++a)
      base[a] = rows[a].at(w.t0) + rows[a].steps(t - (COFF - 1) * RATIO) + col0 + chunk;
    T* const dst = stage + slot_row(t) * COLS + chunk;
    // Runtime steps (strided rows, SBHD): one pointer per array, advanced by a pass's slots,
    // instead of a 64-bit product k0 * step per pass (packed: compile-time offsets either way).
    const T* next[2] = {srcs[0] + base[0], srcs[1] + base[1]};
    const long long pass_step[2] = {rows[0].steps(SLOTS_PER_PASS), rows[1].steps(SLOTS_PER_PASS)};
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      constexpr int PER_ARRAY = LW::WIN * CHUNKS / THREADS;
      const int array = pass / PER_ARRAY;
      const int k0 = (pass - array * PER_ARRAY) * SLOTS_PER_PASS;  // multiple of C
      const bool ok = col_ok && G::valid(k0, w.first);             // the same for the pass's slots
      const T* const src = srcs[array];
      const T* at;
      if constexpr (L::kPacked) {
        at = src + base[array] + rows[array].steps(k0);
      } else {
        at = next[array];
        next[array] += pass_step[array];
      }
      cp_async_16(dst + (array * ROWS + k0 + k0 / LW::C) * COLS, ok ? at + G::half_offset(k0) : src,
                  ok);
    }
  }

  // Any geometry: each copy's array, slot and chunk from its index.
  static __device__ __forceinline__ void fetch_generic(T* stage, const BackwardParams& p,
                                                       const RowWindow& w, int tid, int col0) {
    constexpr int ITEMS = 2 * LW::WIN * CHUNKS;
    const TokenRows sr = L::rows(p, p.score_stride);
    const TokenRows kr = L::rows(p, p.kv_stride);
#pragma unroll
    for (int i0 = 0; i0 < ITEMS; i0 += THREADS) {
      const int i = i0 + tid;
      if (ITEMS % THREADS != 0 && i >= ITEMS) break;
      const int array = i / (LW::WIN * CHUNKS);
      const int r = i - array * (LW::WIN * CHUNKS);
      const int k = r / CHUNKS;
      const int col = col0 + (r - k * CHUNKS) * CH;
      const bool ok = col < HEAD_DIM && G::valid(k, w.first);
      const T* src = IO::in(array == 0 ? p.score : p.kv);
      if (ok) src += slot_offset<RATIO, COFF, HEAD_DIM>(w, array == 0 ? sr : kr, k, col);
      cp_async_16(stage + (array * ROWS + slot_row(k)) * COLS + (col - col0), src, ok);
    }
  }

  // Issues the copies of `row` into `stage` (all threads) and commits one group; with
  // `!has_row` only the (empty) group, so every thread's group count stays in step. Returns
  // the row's window (located only with `has_row`), which the CTA reuses when it computes it.
  static __device__ __forceinline__ RowWindow fetch(T* stage, const BackwardParams& p, int row,
                                                    bool has_row, int col0) {
    static_assert(COLS % CH == 0 && HEAD_DIM % CH == 0, "the ring copies 16-byte chunks");
    RowWindow w{};
    if (has_row) {
      w = L::locate(p, row);
      const int tid = threadIdx.y * TX + threadIdx.x;
      if constexpr (BLOCKED) {
        fetch_blocked(stage, p, w, tid, col0);
      } else {
        fetch_generic(stage, p, w, tid, col0);
      }
      if (tid < CHUNKS) {
        const int col = col0 + tid * CH;
        const bool ok = col < HEAD_DIM;
        cp_async_16(stage + 2 * ROWS * COLS + tid * CH,
                    IO::in(p.grad_out) + (ok ? row * L::out_stride(p, p.grad_out_stride) + col : 0),
                    ok);
      }
    }
    cp_async_commit();
    return w;
  }

  // 512 threads with at most 8 window values a thread run two CTAs per SM (64 registers a
  // thread); with more values, one CTA per SM (128 registers), as 256 threads have.
  static constexpr bool TIGHT_REGISTERS = lane_ring_tight_registers(THREADS, VEC* LW::C);

  // This thread's slots of one staged row: s = score + ape (invalid slots: -inf), kv (invalid
  // slots and columns past head_dim were zero-filled), grad_out.
  // With 64 registers a thread this thread's ape values live in shared memory too (they are
  // the same for every row); with 128 they stay in registers, which measured faster
  // (docs/notes/measurements.md). Thread-private: [C * VEC][THREADS] floats.
  static constexpr bool APE_IN_SHARED = TIGHT_REGISTERS;
  static constexpr int APE_FLOATS = APE_IN_SHARED ? LW::C * VEC * THREADS : 0;
  static __device__ __forceinline__ float& ape_at(float* ape_sm, int j, int v) {
    return ape_sm[(j * VEC + v) * THREADS + threadIdx.y * TX + threadIdx.x];
  }

  static __device__ __forceinline__ void read(const T* stage, float* ape_sm,
                                              const float (&ape)[LW::C][VEC], const RowWindow& w,
                                              int lane, float (&s)[LW::C][VEC],
                                              float (&x)[LW::C][VEC], float (&g)[VEC]) {
    const int c = threadIdx.x * VEC;
    raw_to_f32<E, VEC>(*reinterpret_cast<const Raw*>(stage + 2 * ROWS * COLS + c), g);
    // The lane's slots are rows slot_row(lane * C) + j of the stage: one base, compile-time
    // steps (the generic slot_row(k) cost a signed division per slot in the SASS). Where the
    // lanes cover the window exactly every row is in the stage, so the reads need no guard:
    // the copies of invalid slots were zero-filled.
    constexpr bool EXACT = LW::C * LANES == LW::WIN;
    const T* const lane_rows = stage + (lane * LW::C + lane) * COLS + c;
#pragma unroll
    for (int j = 0; j < LW::C; ++j) {
      const int k = lane * LW::C + j;
      const bool valid = (EXACT || k < LW::WIN) && G::valid(k, w.first);
      Raw rs{}, rx{};
      if (EXACT || k < LW::WIN) {
        rs = *reinterpret_cast<const Raw*>(lane_rows + j * COLS);
        rx = *reinterpret_cast<const Raw*>(lane_rows + (ROWS + j) * COLS);
      }
      float sc[VEC];
      raw_to_f32<E, VEC>(rs, sc);
      raw_to_f32<E, VEC>(rx, x[j]);
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        s[j][v] =
            valid ? __fadd_rn(sc[v], APE_IN_SHARED ? ape_at(ape_sm, j, v) : ape[j][v]) : neg_inf();
    }
  }
};

// The backward's merge of one column's lanes, shared by the threads of that column within a
// warp: with TX < 32 a warp holds K = 32 / TX lanes of each of its columns (thread (x, y) is
// warp lane y * TX + x), and every thread used to merge all LANES lanes itself. Thread y now
// merges the lanes q = y % K, y % K + K, ... in order (conflict-free: the K threads of a column
// read K consecutive lane rows) and xor shuffles over the K threads combine the K results.
// Each level of the butterfly adds two values in either order, so every thread of the column,
// in every warp, ends with the same bits: fixed order, deterministic run to run.
template <int TX, int LANES>
struct ColumnLanes {
  static constexpr int K = (TX < 32 && 32 % TX == 0) ? 32 / TX : 1;
  static_assert(LANES % K == 0, "whole warps of lanes");
  // Lanes first(), first() + K, ... of the column: every K-th lane row.
  // NOTE: merged_max / merged_sum unroll by 8, not fully: 16 lanes unrolled spilled 12-20 B in
  // the 512-thread ring kernels (64 registers), tuner candidates that CI compiles.
  static constexpr int PER_THREAD = LANES / K;
  static __device__ __forceinline__ int first() { return static_cast<int>(threadIdx.y) % K; }

  static __device__ __forceinline__ float max(const float* m, int stride) {
    float M = merged_max<PER_THREAD, false>(m + first() * stride, K * stride);
#pragma unroll
    for (int o = TX; o < 32 && K > 1; o <<= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    return M;
  }

  template <bool FAST_EXP>
  static __device__ __forceinline__ float rescaled_sum(const float* m, const float* part,
                                                       int stride, float M) {
    return butterfly_sum(merged_sum<PER_THREAD, FAST_EXP>(m + first() * stride,
                                                          part + first() * stride, K * stride, M));
  }

  static __device__ __forceinline__ float sum(const float* part, int stride) {
    float s = 0.0f;
    part += first() * stride;
#pragma unroll 8
    for (int i = 0; i < PER_THREAD; ++i) s = __fadd_rn(s, part[i * K * stride]);
    return butterfly_sum(s);
  }

  static __device__ __forceinline__ float butterfly_sum(float s) {
#pragma unroll
    for (int o = TX; o < 32 && K > 1; o <<= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    return s;
  }
};

// The column slice's claim word (atomic mode, overwriting: p.workspace holds the words).
__device__ __forceinline__ unsigned long long* slice_claim_word(const BackwardParams& p) {
  return reinterpret_cast<unsigned long long*>(p.workspace) + blockIdx.y;
}

// The claimant's zeroing of its column slice's grad_ape elements (every window slot, columns
// [col0, col0 + COLS)): 16-byte stores where whole quads fit (grad_ape is 16-byte aligned).
template <int RATIO, int COFF, int HEAD_DIM, int COLS>
__device__ __forceinline__ void zero_grad_ape_slice(const BackwardParams& p, int col0, int t,
                                                    int threads) {
  using G = LongWindow<RATIO, COFF, HEAD_DIM, COLS, COLS>;
  if constexpr (COLS % 4 == 0 && HEAD_DIM % 4 == 0) {
    for (int q = t; q < G::WIN * COLS / 4; q += threads) {
      const int k = q * 4 / COLS;
      const int c = col0 + q * 4 - k * COLS;
      if (c < HEAD_DIM)
        *reinterpret_cast<float4*>(p.grad_ape + G::ape_index(k, c)) =
            make_float4(0.f, 0.f, 0.f, 0.f);
    }
  } else {
    for (int e = t; e < G::WIN * COLS; e += threads) {
      const int k = e / COLS;
      const int c = col0 + e - k * COLS;
      if (c < HEAD_DIM) p.grad_ape[G::ape_index(k, c)] = 0.0f;
    }
  }
}

// STAGES = 1: each row's window is loaded straight into registers (one round trip per row);
// STAGES >= 2: through LaneRing, STAGES - 1 rows ahead.
// Launch bounds: 256 threads, 2 CTAs per SM (128 registers); with the ring (no window loads
// held in registers, ape in shared memory) 512 threads holding at most 8 window values keep 2
// CTAs per SM (64 registers), and 512 threads holding more take one CTA per SM (128
// registers): the same warps per SM as two 256-thread CTAs, over twice the columns, so that
// each L2 request of the ring's copies and of the gradient stores carries two 32-byte sectors
// of a token row where 16 columns carry one.
// ATOMIC_APE: the CTA's grad_ape partials are added into grad_ape (atomic mode) instead of
// written to p.workspace for the fixed-order reduction. A template argument, not a flag: the
// fixed-order kernel stays exactly the code it was (a runtime branch here measured slower in
// the ring kernels).
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int LANES, int STAGES>
struct BackwardCtasPerSm {
  static constexpr int value =
      TX * LANES <= 256 ||
              (STAGES > 1 && LaneRing<IO, RATIO, COFF, HEAD_DIM, VEC, TX, LANES>::TIGHT_REGISTERS)
          ? 2
          : 1;
};

template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int LANES, int STAGES,
          bool FAST_EXP, bool ATOMIC_APE>
__global__ void __launch_bounds__(
    TX* LANES, BackwardCtasPerSm<IO, RATIO, COFF, HEAD_DIM, VEC, TX, LANES, STAGES>::value)
    lane_window_backward(const __grid_constant__ BackwardParams p) {
  // The row-stats form waits only before its first row's scalars (tail_row_stats lets it in
  // after its own wait).
  if constexpr (IO::Store::kRowStats) {
    pdl_launch_dependents();
  } else {
    pdl_enter();
  }
  static_assert(STAGES >= 1 && STAGES <= 4, "stages");
  using LW = LaneWindow<RATIO, COFF, HEAD_DIM, VEC, LANES>;
  using Ring = LaneRing<IO, RATIO, COFF, HEAD_DIM, VEC, TX, LANES>;  // STAGES >= 2 only
  using E = typename IO::E;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  using G = typename LW::Geometry;
  using Merge = ColumnLanes<TX, LANES>;
  constexpr int NCV = HEAD_DIM / VEC;
  constexpr int COLS = TX * VEC;
  constexpr int THREADS = TX * LANES;
  static_assert(THREADS % 32 == 0, "whole warps: the merge shuffles over full warps");
  // Double-buffered by row parity: two barriers per row.
  __shared__ float sm_m[2][LANES][COLS], sm_den[2][LANES][COLS], sm_s[2][LANES][COLS];
  // The tail (long_window_tail.cuh): each row's pooled-row gradient, from grad_y and the
  // forward's pooled row, replaces grad_out; this thread's grad_w terms over the rows, summed
  // as grad_ape is (partials, or added into grad_w, zeroed with grad_ape by the claimant).
  // The row-stats form (IO::Store::kRowStats, LongRowStats): each thread's own columns instead.
  constexpr bool kTail = IO::Store::kCooperative;
  constexpr bool kRowStats = IO::Store::kRowStats;
  constexpr bool kGradW = (kTail || kRowStats) && IO::Store::kNorm;
  // NOTE: the row-stats form's loads and grad_w terms spilled in the ring kernels of 64 registers
  // a thread, wherever they were placed: the host takes the whole-row form there.
  static_assert(!(kRowStats && STAGES > 1 && Ring::TIGHT_REGISTERS),
                "no row-stats form in the ring kernels of 64 registers a thread");
  using Tail = LongTail<IO, RATIO, COFF, HEAD_DIM, THREADS>;
  constexpr int kTailVec = kTail ? long_tail_vec(HEAD_DIM, THREADS) : (kRowStats ? VEC : 1);
  [[maybe_unused]] __shared__ float sm_gx[kTail ? HEAD_DIM : 1];
  [[maybe_unused]] float dw[kTailVec];
#pragma unroll
  for (int v = 0; v < kTailVec; ++v) dw[v] = 0.0f;
  const int lane = threadIdx.y;
  const int cv = blockIdx.y * TX + threadIdx.x;
  const bool active = cv < NCV;
  const int col = cv * VEC;
  const int col0 = blockIdx.y * COLS;
  const long long row_begin = static_cast<long long>(blockIdx.x) * p.rows_per_cta;
  // Atomic mode with claim words: the arrival now; the claimant zeroes the column slice's
  // grad_ape once the first rows' loads are on their way (claim_zero_if_first below).
  const bool claims = ATOMIC_APE && p.workspace != nullptr;
  unsigned long long* const claim_word = claims ? slice_claim_word(p) : nullptr;
  const unsigned long long claim = claims ? claim_arrive(claim_word) : 0ull;
  // NOTE: ring kernels with 64 registers a thread (Ring::TIGHT_REGISTERS): there the arrival's
  // reply waits for claim_await_zeroed in shared memory, not in two registers across the rows
  // (which spilled 16 bytes at 128,2,128 v2 c16 t512). Elsewhere it stays in registers: the
  // shared-memory form ran the 256-thread atomic buckets slower.
  constexpr bool kClaimReplyInShared = STAGES > 1 && Ring::TIGHT_REGISTERS;
  [[maybe_unused]] __shared__ unsigned long long claim_reply;
  // The first rows' windows (those the ring fetches before its loop, else the first) at the
  // guessed place, ahead of the dependent loads of cuc[B] and locate_row; one thread per
  // 128-byte line (faster than every thread prefetching its own sectors). Before the
  // programmatic wait it lost on large shapes, so it stays after it.
  if (active) {
#pragma unroll
    for (int i = 0; i < (STAGES > 1 ? STAGES - 1 : 1); ++i) {
      if (i < p.rows_per_cta && row_begin + i < p.total_comp)
        prefetch_lane_window<IO, RATIO, COFF, HEAD_DIM, VEC, LANES>(
            p, static_cast<int>(row_begin + i), col, lane);
    }
  }
  const int rows_valid = L::rows_valid(p);

  float dape[LW::C][VEC];
#pragma unroll
  for (int j = 0; j < LW::C; ++j)
#pragma unroll
    for (int v = 0; v < VEC; ++v) dape[j][v] = 0.0f;

  // ape of this thread's slots: the same for every row; in registers, or (ring above 256
  // threads) in the thread's part of shared memory after the ring.
  extern __shared__ __align__(16) unsigned char ring_bytes[];
  typename IO::T* const ring = reinterpret_cast<typename IO::T*>(ring_bytes);
  float* const ape_sm = reinterpret_cast<float*>(ring + STAGES * Ring::STAGE_ELEMS);
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
    if constexpr (STAGES > 1 && Ring::APE_IN_SHARED) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) Ring::ape_at(ape_sm, j, v) = ape[j][v];
    }
  }

  const int row_end = static_cast<int>(
      row_begin + p.rows_per_cta < rows_valid ? row_begin + p.rows_per_cta : rows_valid);
  // The ring (STAGES >= 2) lives in dynamic shared memory: STAGES * Ring::STAGE_ELEMS elements.
  // With two stages the window located by the fetch of a row is the one its computation uses
  // (one locate_row per row instead of two).
  RowWindow fetched{};
  if constexpr (STAGES > 1) {
    // NOTE: every thread commits exactly one group per fetch (empty past row_end), so the
    // wait_group counts below name the same rows in every thread.
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
      const long long r = row_begin + i;
      fetched =
          Ring::fetch(ring + i * Ring::STAGE_ELEMS, p, static_cast<int>(r), r < row_end, col0);
    }
  }
  // The arrival's reply is due: with the ring, once the first rows' copies are on their way;
  // without it, after cuc[B]'s load.
  if (claims)
    claim_zero_if_first(claim_word, gridDim.x, claim, [&](int t, int threads) {
      zero_grad_ape_slice<RATIO, COFF, HEAD_DIM, COLS>(p, col0, t, threads);
      if constexpr (kGradW) {
        for (int c = col0 + t; c < col0 + COLS && c < HEAD_DIM; c += threads) p.grad_w[c] = 0.0f;
      }
    });
  if constexpr (STAGES > 1) {
    if constexpr (kClaimReplyInShared) {
      if (threadIdx.x == 0 && threadIdx.y == 0) claim_reply = claim;
    }
    cp_async_wait<STAGES - 2>();
    __syncthreads();
  }
  using TailState = LongTailState<kTail, Tail>;
  [[maybe_unused]] typename TailState::Row tail_next;
  if constexpr (kTail) {
    if (row_begin < row_end) Tail::load(p, static_cast<int>(row_begin), tail_next);
  }
  int buf = 0;
  int it = 0;
  for (int row = static_cast<int>(row_begin); row < row_end; ++row, buf ^= 1, ++it) {
    const RowWindow w = STAGES == 2 ? fetched : L::locate(p, row);
    float s[LW::C][VEC], x[LW::C][VEC], g[VEC];
    [[maybe_unused]]
    typename LongRowStatsState<kRowStats, IO, RATIO, COFF, HEAD_DIM, VEC>::Row row_stats;
    if constexpr (STAGES > 1) {
      // Row `row + STAGES - 1` goes to the stage that row - 1 used: every thread finished
      // reading it before the previous row's second barrier.
      const long long ahead = static_cast<long long>(row) + STAGES - 1;
      fetched = Ring::fetch(ring + ((it + STAGES - 1) % STAGES) * Ring::STAGE_ELEMS, p,
                            static_cast<int>(ahead), ahead < row_end, col0);
      // Narrow coff-1 windows: the row after the ring's reach goes to L2 too (its guessed
      // place, one thread per 128-byte line); two rows beyond gained nothing. NOTE: at coff 2
      // the same prefetch ran much slower: the window's bytes were read twice from DRAM, as if
      // the prefetched lines left L2 before their use.
      if constexpr (COFF == 1 && HEAD_DIM <= 128) {
        const long long further = ahead + 1;
        if (active && further < row_end)
          prefetch_lane_window<IO, RATIO, COFF, HEAD_DIM, VEC, LANES>(p, static_cast<int>(further),
                                                                      col, lane);
      }
      if constexpr (kRowStats) row_stats.issue(p, row, col, w.block, active);
      Ring::read(ring + (it % STAGES) * Ring::STAGE_ELEMS, ape_sm, ape, w, lane, s, x, g);
    } else {
      LaneLoads<IO, RATIO, COFF, HEAD_DIM, VEC, LANES> loads;
      loads.issue(p, w, row, col, lane, active);
      if constexpr (kRowStats) row_stats.issue(p, row, col, w.block, active);
      loads.finish(ape, w, lane, s, x, g);
    }
    // The tail: this row's inputs (loaded a row ahead) and operands; the next row's loads.
    [[maybe_unused]] typename TailState::Row tail_in;
    [[maybe_unused]] typename TailState::Operands tail_op;
    if constexpr (kTail) {
      tail_in = tail_next;
      if (row + 1 < row_end) Tail::load(p, row + 1, tail_next);
      Tail::operands(p, w.block, tail_op);
    }
    float m[VEC], den[VEC];
    lane_exps<LW::C, VEC, FAST_EXP>(s, m, den);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      sm_m[buf][lane][threadIdx.x * VEC + v] = m[v];
      sm_den[buf][lane][threadIdx.x * VEC + v] = den[v];
    }
    // The pooled row's gradient replaces grad_out (published by the barrier below).
    if constexpr (kTail) Tail::backward(p, tail_in, tail_op, it & 1, sm_gx, dw);
    __syncthreads();
    if constexpr (kTail) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) g[v] = active ? sm_gx[col + v] : 0.0f;
    }
    if constexpr (kRowStats) row_stats.apply(p, row, col, active, g, dw);
    // The threads of a column merge its lanes in one fixed order (ColumnLanes): identical M
    // and den in every thread of the column.
    float scale[VEC], S_part[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      const float M = Merge::max(&sm_m[buf][0][c], COLS);
      const float total =
          Merge::template rescaled_sum<FAST_EXP>(&sm_m[buf][0][c], &sm_den[buf][0][c], COLS, M);
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
    // This barrier also publishes the next row's stage: this thread's copies of it are done.
    if constexpr (STAGES > 1) cp_async_wait<STAGES - 2>();
    __syncthreads();
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x * VEC + v;
      S_part[v] = Merge::sum(&sm_s[buf][0][c], COLS);
    }
    if (active) {
      // Without the ring, UNIFORM windows store each slot at one base plus an immediate, as
      // they load; with the ring the same stores measured slower at coff 2 in packed THD, so
      // there the ring keeps the per-slot form. Runtime steps (strided rows, SBHD) take the
      // base and one pointer step per slot instead of a 64-bit product per slot.
      constexpr bool SLOT_BASE = LW::UNIFORM && (STAGES == 1 || !L::kPacked);
      const TokenRows gkr = L::rows(p, p.grad_kv_stride);
      const TokenRows gsr = L::rows(p, p.grad_score_stride);
      typename IO::T* const grad_kv = IO::out(p.grad_kv);
      typename IO::T* const grad_score = IO::out(p.grad_score);
      long long gk0 = 0, gs0 = 0;
      bool lane_valid = true;
      if constexpr (SLOT_BASE) {
        lane_valid = lane_slot_base<RATIO, COFF, HEAD_DIM, VEC, LANES>(w, gkr, col, lane, gk0);
        lane_slot_base<RATIO, COFF, HEAD_DIM, VEC, LANES>(w, gsr, col, lane, gs0);
      }
      // Runtime steps: two pointers advanced by one 64-bit add a slot each (an element offset
      // re-scaled into an address at every slot cost twice the integer instructions).
      [[maybe_unused]] typename IO::T* gk_at = grad_kv + gk0;
      [[maybe_unused]] typename IO::T* gs_at = grad_score + gs0;
      // A lane's slots are all valid or all invalid where SLOT_BASE holds: one test, not one a
      // slot (the compiler kept a branch per slot).
#pragma unroll
      for (int j = 0; j < LW::C && lane_valid; ++j) {
        const int k = lane * LW::C + j;
        if (!SLOT_BASE && (k >= LW::WIN || !G::valid(k, w.first))) continue;
        float gkv[VEC], gs[VEC];
        slot_gradients<VEC>(g, x[j], s[j], S_part, gkv, gs, dape[j]);
        if constexpr (SLOT_BASE && L::kPacked) {
          store_vec<E, VEC>(grad_kv + gk0 + gkr.steps(j), gkv);
          store_vec<E, VEC>(grad_score + gs0 + gsr.steps(j), gs);
        } else if constexpr (SLOT_BASE) {
          store_vec<E, VEC>(gk_at, gkv);
          store_vec<E, VEC>(gs_at, gs);
          gk_at += gkr.step;
          gs_at += gsr.step;
        } else {
          store_vec<E, VEC>(grad_kv + slot_offset<RATIO, COFF, HEAD_DIM>(w, gkr, k, col), gkv);
          store_vec<E, VEC>(grad_score + slot_offset<RATIO, COFF, HEAD_DIM>(w, gsr, k, col), gs);
        }
      }
    }
    zero_after_last_block<IO, RATIO, COFF, HEAD_DIM, COLS, THREADS>(p, w, col0);
  }
  zero_unowned<IO, RATIO, COFF, HEAD_DIM, COLS, THREADS>(p, col0);

  if constexpr (ATOMIC_APE) {
    // Atomic mode: this CTA's partials go straight into grad_ape, zeroed first by the column
    // slice's claimant when the call overwrites it outside capture.
    if (claims) {
      if constexpr (kClaimReplyInShared) {
        claim_await_zeroed(slice_claim_word(p), gridDim.x, claim_reply);
      } else {
        claim_await_zeroed(claim_word, gridDim.x, claim);
      }
      __syncthreads();
    }
    if (row_end <= row_begin) return;  // no rows: nothing to add
    if constexpr (kTail && IO::Store::kNorm) {
      Tail::template grad_w_out<true>(p.grad_w, col0, COLS, dw);
    } else if constexpr (kGradW) {
      // Every window lane holds the same terms: lane 0's are added.
      if (lane == 0 && active) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) atomicAdd(p.grad_w + col + v, dw[v]);
      }
    }
    if (!active) return;
#pragma unroll
    for (int j = 0; j < LW::C; ++j) {
      const int k = lane * LW::C + j;
      if (k >= LW::WIN) continue;
#pragma unroll
      for (int v = 0; v < VEC; ++v) atomicAdd(p.grad_ape + G::ape_index(k, col + v), dape[j][v]);
    }
    return;
  }
  // The tail's grad_w partials follow grad_ape's in each row group's block.
  constexpr long long kGroupFloats = RATIO * LW::W + (kGradW ? HEAD_DIM : 0);
  [[maybe_unused]] float* const grad_w_partial =
      p.workspace + static_cast<long long>(blockIdx.x) * kGroupFloats + RATIO * LW::W;
  if constexpr (kTail && IO::Store::kNorm) {
    Tail::template grad_w_out<false>(grad_w_partial, col0, COLS, dw);
  } else if constexpr (kGradW) {
    if (lane == 0 && active) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) grad_w_partial[col + v] = dw[v];
    }
  }
  if (!active) return;
  float* dst = p.workspace + static_cast<long long>(blockIdx.x) * kGroupFloats;
#pragma unroll
  for (int j = 0; j < LW::C; ++j) {
    const int k = lane * LW::C + j;
    if (k >= LW::WIN) continue;
#pragma unroll
    for (int v = 0; v < VEC; ++v) dst[G::ape_index(k, col + v)] = dape[j][v];
  }
}

}  // namespace csa_kernel
