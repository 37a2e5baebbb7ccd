// Short-window family: one thread holds the whole window of one (row, VEC columns) in registers
// and evaluates it in the serial op order of the fp32-intermediate reference, so out, grad_kv
// and grad_score are bitwise equal to it (SPEC §2 item 2).
#pragma once
#include "csa_io.cuh"

namespace csa_kernel {

// One row's window, every load issued before any arithmetic (one memory round trip): s_k =
// score_k + ape_k and kv_k for each slot; the previous half only when `use_prev`. `sbase` /
// `kbase` are the element offsets of the row's first own-block token in score / kv plus the
// column; consecutive tokens lie `ss` / `ks` elements apart (compile-time in packed THD).
// kv lands converted (KvSlot = float[VEC]) or as the raw elements (KvSlot = RawVec), which the
// forward converts where it uses them (ForwardKv): fp16's conversion (cvt) stayed at the load,
// so the wide fp16 forward held twice bf16's registers for its window. bf16's is a shift the
// compiler places itself, and held raw the narrow bf16 forward ran slower.
// NOTE: 64-bit row bases, so that every slot's load is the base plus a constant offset.
template <class E, int VEC>
__device__ __forceinline__ void load_kv(const typename E::T* p, float (&v)[VEC]) {
  load_vec<E, VEC>(p, v);
}
template <class E, int VEC>
__device__ __forceinline__ void load_kv(const typename E::T* p, RawVec<E, VEC>& raw) {
  raw = load_raw<E, VEC>(p);
}
template <class E, int VEC>
__device__ __forceinline__ void kv_to_f32(const float (&v)[VEC], float (&x)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) x[i] = v[i];
}
template <class E, int VEC>
__device__ __forceinline__ void kv_to_f32(const RawVec<E, VEC>& raw, float (&x)[VEC]) {
  raw_to_f32<E, VEC>(raw, x);
}

// How the forward holds a window slot's kv: raw where RAW (fp16 kernels whose registers a
// residency target bounds), converted otherwise (held raw, the narrow forwards of every
// two-byte type ran slower: docs/notes/dropped.md).
template <bool RAW, class E, int VEC>
struct ForwardKv {
  using type = float[VEC];
};
template <class E, int VEC>
struct ForwardKv<true, E, VEC> {
  using type = RawVec<E, VEC>;
};

template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int NPREV, class KvSlot>
__device__ __forceinline__ void load_window(const typename IO::T* score, const typename IO::T* kv,
                                            const float* ape, long long sbase, long long ss,
                                            long long kbase, long long ks, int col, bool use_prev,
                                            float (&prev_s)[NPREV][VEC], KvSlot (&prev_kv)[NPREV],
                                            float (&own_s)[RATIO][VEC], KvSlot (&own_kv)[RATIO]) {
  using E = typename IO::E;
  constexpr int W = COFF * HEAD_DIM;
  constexpr int OWN = (COFF - 1) * HEAD_DIM;
  if (use_prev) {
#pragma unroll
    for (int k = 0; k < NPREV; ++k) {
      float sc[VEC], ap[VEC];
      load_vec<E, VEC>(score + sbase - (RATIO - k) * ss, sc);
      load_kv<E, VEC>(kv + kbase - (RATIO - k) * ks, prev_kv[k]);
      load_f32<VEC>(ape + col + k * W, ap);
#pragma unroll
      for (int v = 0; v < VEC; ++v) prev_s[k][v] = __fadd_rn(sc[v], ap[v]);
    }
  }
#pragma unroll
  for (int k = 0; k < RATIO; ++k) {
    float sc[VEC], ap[VEC];
    load_vec<E, VEC>(score + sbase + k * ss + OWN, sc);
    load_kv<E, VEC>(kv + kbase + k * ks + OWN, own_kv[k]);
    load_f32<VEC>(ape + col + k * W + OWN, ap);
#pragma unroll
    for (int v = 0; v < VEC; ++v) own_s[k][v] = __fadd_rn(sc[v], ap[v]);
  }
}

// The window `w` of one (row, VEC columns), at the guessed place (Layout::guess); every thread
// prefetches its own sectors (a prefetch brings the 32-byte sectors its address touches).
template <class IO, int RATIO, int COFF, int HEAD_DIM, class P>
__device__ __forceinline__ void prefetch_row_window(const P& p, const RowWindow& w, int col) {
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  constexpr int OWN = (COFF - 1) * HEAD_DIM;
  if (w.padding) return;
  const TokenRows sr = L::rows(p, p.score_stride);
  const TokenRows kr = L::rows(p, p.kv_stride);
  const typename IO::T* const score = IO::in(p.score) + sr.at(w.t0) + col;
  const typename IO::T* const kv = IO::in(p.kv) + kr.at(w.t0) + col;
#pragma unroll
  for (int k = 0; k < RATIO; ++k) {
    prefetch_l2(score + sr.steps(k) + OWN);
    prefetch_l2(kv + kr.steps(k) + OWN);
  }
  if (COFF == 2 && !w.first) {
#pragma unroll
    for (int k = 0; k < RATIO; ++k) {
      prefetch_l2(score - sr.steps(RATIO - k));
      prefetch_l2(kv - kr.steps(RATIO - k));
    }
  }
}

// MIN_CTAS: the CTAs per SM ptxas must fit (0: its own choice).
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int THREADS, int MIN_CTAS>
__global__ void __launch_bounds__(THREADS, MIN_CTAS)
    short_window_forward(const __grid_constant__ ForwardParams p) {
  static_assert(COFF == 1 || COFF == 2, "coff");
  static_assert(HEAD_DIM % VEC == 0, "VEC must divide head_dim");
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  constexpr int NCV = HEAD_DIM / VEC;
  constexpr int NPREV = COFF == 2 ? RATIO : 1;

  const long long gid = static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x;
  const bool has_row = gid < static_cast<long long>(p.total_comp) * NCV;
  const int row = static_cast<int>(gid / NCV);
  const int col = static_cast<int>(gid - static_cast<long long>(row) * NCV) * VEC;
  // The guessed window's prefetch (every thread: its own sectors) goes out before the
  // programmatic wait (pdl_enter), so that its DRAM round trip overlaps the previous kernel's
  // tail. Only the wide kernel (256 threads) with 8-slot windows at head_dim 128 measured
  // slower with it, before or after the wait, so such kernels do not prefetch.
  constexpr bool PREFETCH = !(THREADS >= 256 && COFF * RATIO >= 8 && HEAD_DIM < 256);
  // SBHD locates the row once, here (its guess is the window).
  const RowWindow located = L::kGuessIsExact && has_row ? L::locate(p, row) : RowWindow{};
  if (PREFETCH && has_row) {
    prefetch_row_window<IO, RATIO, COFF, HEAD_DIM>(p, L::kGuessIsExact ? located : L::guess(p, row),
                                                   col);
  }
  pdl_enter();
  // A cooperative epilogue (the tail) needs every thread of the CTA, threads without a row too.
  using Store = typename IO::Store;
  if (!Store::kCooperative && !has_row) return;
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
  if (has_row) {
    const RowWindow w = L::kGuessIsExact ? located : L::locate(p, row);
    Store::template stage_operands<VEC, HEAD_DIM, THREADS>(p, col, w.block,
                                                           static_cast<int>(threadIdx.x));
    const bool use_prev = COFF == 2 && !w.first;
    const TokenRows sr = L::rows(p, p.score_stride);
    const TokenRows kr = L::rows(p, p.kv_stride);
    using Kv =
        typename ForwardKv<IO::kElement == kElementF16 && MIN_CTAS != 0, typename IO::E, VEC>::type;
    float prev_s[NPREV][VEC], own_s[RATIO][VEC];
    Kv prev_kv[NPREV], own_kv[RATIO];
    load_window<IO, RATIO, COFF, HEAD_DIM, VEC, NPREV>(
        IO::in(p.score), IO::in(p.kv), p.ape, sr.at(w.t0) + col, sr.step, kr.at(w.t0) + col,
        kr.step, col, use_prev, prev_s, prev_kv, own_s, own_kv);
    softmax_weights<NPREV, RATIO, VEC>(prev_s, own_s, use_prev);
    if (use_prev) {
#pragma unroll
      for (int k = 0; k < NPREV; ++k) {
        float x[VEC];
        kv_to_f32<typename IO::E, VEC>(prev_kv[k], x);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(x[v], prev_s[k][v]));
      }
    }
#pragma unroll
    for (int k = 0; k < RATIO; ++k) {
      float x[VEC];
      kv_to_f32<typename IO::E, VEC>(own_kv[k], x);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(x[v], own_s[k][v]));
    }
  }
  if constexpr (Store::kCooperative) {
    // The tail's pooled rows, where the caller keeps them for the row-stats backward.
    if (has_row && p.pooled != nullptr)
      store_vec<Element<kElementF32>, VEC>(p.pooled + static_cast<long long>(row) * HEAD_DIM + col,
                                           acc);
  }
  Store::template store_row<typename IO::E, VEC, HEAD_DIM, THREADS>(
      p, IO::out(p.out) + row * L::out_stride(p, p.out_stride) + col, row, col, has_row, acc);
}

// Writes exact zeros to the columns this thread owns of one never-consumed token: the layout's
// row `token_row`, both halves.
template <class IO, int COFF, int HEAD_DIM, int VEC>
__device__ __forceinline__ void zero_token(const BackwardParams& p, const TokenRows& gk,
                                           const TokenRows& gs, long long token_row, int col) {
  using E = typename IO::E;
  constexpr int OWN = (COFF - 1) * HEAD_DIM;
  typename IO::T* const kv = IO::out(p.grad_kv) + token_row * gk.stride + col;
  typename IO::T* const sc = IO::out(p.grad_score) + token_row * gs.stride + col;
  if (COFF == 2) {
    store_zero_vec<E, VEC>(kv);
    store_zero_vec<E, VEC>(sc);
  }
  store_zero_vec<E, VEC>(kv + OWN);
  store_zero_vec<E, VEC>(sc + OWN);
}

// Writes the zeros no row owns, at the columns this thread owns: the tokens of segments shorter
// than ratio (layouts with offsets) and the token rows past the `used` ones, spread over the
// row groups (blockIdx.y) and their TY row lanes.
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int TY>
__device__ __forceinline__ void zero_rowless_tokens(const BackwardParams& p, const TokenRows& gk,
                                                    const TokenRows& gs, int used, int col) {
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  const int groups = gridDim.y;
  const int ty = threadIdx.y;
  if constexpr (L::kOffsets) {
    for (int s = blockIdx.y; s < p.num_segments; s += groups) {
      if (__ldg(p.cu_seqlens_comp + s + 1) > __ldg(p.cu_seqlens_comp + s)) continue;
      const int t_begin = clamp_i32(__ldg(p.cu_seqlens + s), 0, p.total_tokens);
      const int t_end =
          clamp_i32(__ldg(p.cu_seqlens + s + 1), t_begin, min(p.total_tokens, t_begin + RATIO - 1));
      for (int t = t_begin + ty; t < t_end; t += TY)
        zero_token<IO, COFF, HEAD_DIM, VEC>(p, gk, gs, t, col);
    }
  }
  for (long long t = used + static_cast<long long>(blockIdx.y) * TY + ty; t < p.total_tokens;
       t += static_cast<long long>(groups) * TY)
    zero_token<IO, COFF, HEAD_DIM, VEC>(p, gk, gs, t, col);
}

// The per-slot gradient of one window, in the reference op order:
// dp = g*kv, pd = round(dp*p), S = sum pd (serial), ds = fma(p, -S, pd).
template <int N, int VEC>
__device__ __forceinline__ void accumulate_dot(const float (&g)[VEC], const float (&kv)[N][VEC],
                                               const float (&pr)[N][VEC], float (&S)[VEC]) {
#pragma unroll
  for (int k = 0; k < N; ++k)
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      S[v] = __fadd_rn(S[v], __fmul_rn(__fmul_rn(g[v], kv[k][v]), pr[k][v]));
}

// grad_ape's (and a fixed-order partial's) element of window slot `slot` and column
// `col0 + c` (a column block's first column, the column within it): slots [0, RATIO) of
// coff 2 are the previous half (columns [0, d)), the rest the own half.
template <int RATIO, int COFF, int HEAD_DIM>
__device__ __forceinline__ int window_slot_index(int slot, int col0, int c) {
  return (slot % RATIO) * (COFF * HEAD_DIM) + (slot / RATIO) * HEAD_DIM + col0 + c;
}

// Atomic mode, overwriting, one launch: the column block's claim word, and the zeroing of its
// grad_ape elements by the claimant (columns [blockIdx.x * ROW_FLOATS, + ROW_FLOATS) of each
// of the SLOTS window slots; claim_zero_if_first).
__device__ __forceinline__ unsigned long long* grad_ape_claim_word(const BackwardParams& p) {
  return reinterpret_cast<unsigned long long*>(p.workspace) + blockIdx.x;
}

template <int COFF, int HEAD_DIM, int SLOTS, int ROW_FLOATS>
__device__ __forceinline__ void zero_grad_ape_block(const BackwardParams& p, int t, int threads) {
  constexpr int RATIO = SLOTS / COFF;
  const int col0 = blockIdx.x * ROW_FLOATS;
  for (int e = t; e < SLOTS * ROW_FLOATS; e += threads) {
    const int slot = e / ROW_FLOATS;
    const int c = e - slot * ROW_FLOATS;
    if (col0 + c < HEAD_DIM)
      p.grad_ape[window_slot_index<RATIO, COFF, HEAD_DIM>(slot, col0, c)] = 0.0f;
  }
}

// MIN_CTAS: the CTAs per SM ptxas must fit (0: its own choice). FORM: a ShortWindowBackwardForm
// (csa_params.h), register fitting's choice for kernels whose default form still uses local
// memory. The same bytes out, with fewer constraints on the registers: from the scalar-partials
// form on, one row lane's partials are written a float at a time (a vector store needs aligned
// registers); from the zeros-first form on, the zeros no row owns are written before the rows
// (fewer values live across the row loop); in the lean form also the claim
// word's value waits in shared memory, and each row takes its thread index from the special
// registers and its buffer parity from the lane's iteration count; in the lean-column form
// also its column.
template <class IO, int RATIO, int COFF, int HEAD_DIM, int VEC, int TX, int TY, bool FIXED_ORDER,
          int MIN_CTAS, int FORM>
__global__ void __launch_bounds__(TX* TY, MIN_CTAS)
    short_window_backward(const __grid_constant__ BackwardParams p) {
  using Tail = typename IO::Store;
  // One wave: see backward_grid(). The row-stats form waits only before its first row's
  // scalars (tail_row_stats lets it in after its own wait).
  if constexpr (Tail::kRowStats) {
    pdl_launch_dependents();
  } else {
    pdl_enter(/*dependents_first=*/true);
  }
  static_assert(FORM >= kBackwardFormDefault && FORM < kShortWindowBackwardForms, "a form");
  constexpr bool ZEROS_FIRST = FORM >= kBackwardFormZerosFirst;
  constexpr bool LEAN = FORM >= kBackwardFormLean;
  constexpr bool ROW_COLUMN = FORM >= kBackwardFormLeanColumn;
  constexpr bool SCALAR_PARTIALS = FORM >= kBackwardFormScalarPartials;
  using E = typename IO::E;
  using L = typename IO::template L<RATIO, COFF, HEAD_DIM>;
  constexpr int W = COFF * HEAD_DIM;
  constexpr int NCV = HEAD_DIM / VEC;
  constexpr int OWN = (COFF - 1) * HEAD_DIM;
  constexpr int NPREV = COFF == 2 ? RATIO : 1;

  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int cv = blockIdx.x * TX + tx;
  const bool active = cv < NCV;
  const int col = cv * VEC;
  // In the default form the zero loops after the rows take the column and the used-token count.
  // Loaded up front, the count's round trip overlaps the rows'. NOTE: at a named residency (the
  // resident backward) ptxas kept one of the two in local memory through the row loop, so THD
  // kernels read both again after it. Not SBHD (its count needs no load) nor the tails: there
  // it measured slower or moved the pressure elsewhere (docs/notes/dropped.md).
  constexpr bool REREAD = L::kOffsets && MIN_CTAS > 0 && !IO::Store::kCooperative && !ZEROS_FIRST;
  const int used = REREAD || ZEROS_FIRST ? 0 : L::used_tokens(p);
  const TokenRows sr = L::rows(p, p.score_stride);
  const TokenRows kr = L::rows(p, p.kv_stride);
  const TokenRows gs_rows = L::rows(p, p.grad_score_stride);
  const TokenRows gk_rows = L::rows(p, p.grad_kv_stride);
  const long long gout_stride = L::out_stride(p, p.grad_out_stride);
  typename IO::T* const grad_kv = IO::out(p.grad_kv);
  typename IO::T* const grad_score = IO::out(p.grad_score);
  constexpr int SLOTS = (COFF == 2 ? 2 : 1) * RATIO;
  constexpr int ROW_FLOATS = TX * VEC;  // one slot's columns in this CTA
  // The tail (a cooperative epilogue): rows whole in a CTA (TX * VEC = head_dim, one column
  // block), the tail's backward between grad_y and the pooling's backward, and with the norm
  // grad_w summed as grad_ape is: its partials after grad_ape's in each row group's block of
  // the workspace (the fixed order), or added into grad_w, which the block's claimant zeroes
  // with grad_ape (atomic).
  // The tail's row-stats form (Tail::kRowStats) holds the plain kernel's column blocks: each
  // thread runs the tail's backward of its own columns from the row's scalars, which
  // tail_row_stats wrote before this kernel (p.row_stats).
  constexpr bool TAIL = Tail::kCooperative;
  constexpr bool ROW_STATS = Tail::kRowStats;
  constexpr bool GRAD_W = (TAIL || ROW_STATS) && Tail::kNorm;
  static_assert(!TAIL || ROW_FLOATS == HEAD_DIM, "the tail's backward takes whole rows");
  constexpr int GROUP_FLOATS = RATIO * W + (GRAD_W ? HEAD_DIM : 0);
  const int tid = ty * TX + tx;
  constexpr int DW = TAIL || ROW_STATS ? VEC : 1;
  float dw[DW];  // the norm's grad_w terms (unused without the norm)
#pragma unroll
  for (int v = 0; v < DW; ++v) dw[v] = 0.0f;
  int parity = 0;
  // Atomic mode with claim words: the arrival and, in the CTA that claims the block, its
  // zeroing at the start, so that no CTA waits for the zeroing after its rows (warp 0 waits
  // here for the arrival's reply).
  const bool claims = !FIXED_ORDER && p.workspace != nullptr;
  unsigned long long claim = 0;
  __shared__ unsigned long long parked_claim;
  if (claims) {
    claim = claim_arrive(grad_ape_claim_word(p));
    claim_zero_if_first(grad_ape_claim_word(p), gridDim.y, claim, [&](int t, int threads) {
      zero_grad_ape_block<COFF, HEAD_DIM, SLOTS, ROW_FLOATS>(p, t, threads);
      if constexpr (GRAD_W) {
        // This column block's part of grad_w (the whole of it where a row is one block).
        const int col0 = static_cast<int>(blockIdx.x) * ROW_FLOATS;
        for (int c = t; c < ROW_FLOATS && col0 + c < HEAD_DIM; c += threads)
          p.grad_w[col0 + c] = 0.0f;
      }
    });
    if (LEAN && tid == 0) parked_claim = claim;
  }

  float dape_prev[NPREV][VEC];
  float dape_own[RATIO][VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
#pragma unroll
    for (int k = 0; k < NPREV; ++k) dape_prev[k][v] = 0.0f;
#pragma unroll
    for (int k = 0; k < RATIO; ++k) dape_own[k][v] = 0.0f;
  }

  if (ZEROS_FIRST && active) {
    zero_rowless_tokens<IO, RATIO, COFF, HEAD_DIM, VEC, TY>(p, gk_rows, gs_rows, L::used_tokens(p),
                                                            col);
  }
  if (active) {
    const long long row_begin = static_cast<long long>(blockIdx.y) * p.rows_per_cta;
    const int row_end = static_cast<int>(
        row_begin + p.rows_per_cta < p.total_comp ? row_begin + p.rows_per_cta : p.total_comp);
    for (int row = static_cast<int>(row_begin) + ty; row < row_end; row += TY) {
      // Padding rows (gradients ignored) are told apart by locate_row from the segment's own
      // offsets, as in the forward: no load of cuc[B] ahead of the window's loads. The guessed
      // window's prefetch (every thread: its own sectors) and grad_out's load, whose address
      // needs no offsets, go out first (every thread its own sectors: faster than one thread
      // per 128-byte line). Before the programmatic wait, as the forward does, it measured
      // slower here. SBHD rows: the tails split them with the batch divisor, the plain kernels
      // with the division, which measured faster there (docs/design.md).
      prefetch_row_window<IO, RATIO, COFF, HEAD_DIM>(p, L::template guess<TAIL>(p, row), col);
      float g[VEC];
      load_vec<E, VEC>(IO::in(p.grad_out) + row * gout_stride + col, g);
      const RowWindow w = L::template locate<TAIL>(p, row);
      if (w.padding) continue;  // the whole row's threads alike
      const int row_tid = LEAN ? reread_thread_linear(TX) : tid;
      const int row_col = ROW_COLUMN ? reread_block_thread_x(TX) * VEC : col;
      Tail::template stage_operands<VEC, HEAD_DIM, TX * TY>(p, row_col, w.block, row_tid);
      // The row-stats form's operands: their L2 round trip overlaps the window's.
      [[maybe_unused]] typename Tail::template Operands<ROW_STATS ? VEC : 1> op;
      if constexpr (ROW_STATS) Tail::template read_operands<VEC, HEAD_DIM>(p, row_col, w.block, op);
      const bool use_prev = COFF == 2 && !w.first;
      float prev_e[NPREV][VEC], prev_kv[NPREV][VEC];
      float own_e[RATIO][VEC], own_kv[RATIO][VEC];
      load_window<IO, RATIO, COFF, HEAD_DIM, VEC, NPREV>(
          IO::in(p.score), IO::in(p.kv), p.ape, sr.at(w.t0) + row_col, sr.step,
          kr.at(w.t0) + row_col, kr.step, row_col, use_prev, prev_e, prev_kv, own_e, own_kv);
      [[maybe_unused]] float2 stats;
      if constexpr (ROW_STATS) {
        pdl_wait();  // the row scalars of tail_row_stats (the window's loads are out)
        stats = load_written(reinterpret_cast<const float2*>(p.row_stats) + row);
      }
      const long long gkb = gk_rows.at(w.t0) + row_col;
      const long long gsb = gs_rows.at(w.t0) + row_col;
      // p_k replaces s_k in place.
      softmax_weights<NPREV, RATIO, VEC>(prev_e, own_e, use_prev);
      if constexpr (TAIL || ROW_STATS) {
        // The pooled row, recomputed as the forward computes it, then g: grad_y -> grad_x.
        float x[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) x[v] = 0.0f;
        if (use_prev) {
#pragma unroll
          for (int k = 0; k < NPREV; ++k)
#pragma unroll
            for (int v = 0; v < VEC; ++v)
              x[v] = __fadd_rn(x[v], __fmul_rn(prev_kv[k][v], prev_e[k][v]));
        }
#pragma unroll
        for (int k = 0; k < RATIO; ++k)
#pragma unroll
          for (int v = 0; v < VEC; ++v)
            x[v] = __fadd_rn(x[v], __fmul_rn(own_kv[k][v], own_e[k][v]));
        if constexpr (ROW_STATS) {
          Tail::template backward_columns<E, VEC, HEAD_DIM>(IO::in(p.grad_out) + row * gout_stride,
                                                            row_col, op, stats, x, g, dw);
        } else {
          // NOTE: the lean form takes the parity from the lane's iteration count: the same
          // alternation, since padding rows (skipped) are the last rows of the pack.
          const int row_parity =
              LEAN ? ((row - static_cast<int>(blockIdx.y) * p.rows_per_cta) / TY) & 1 : parity;
          Tail::template backward_row<VEC, HEAD_DIM, TX * TY>(p, row_col, row_tid, row_parity, x, g,
                                                              dw);
          parity ^= 1;
        }
      }

      float S[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) S[v] = 0.0f;
      if (use_prev) accumulate_dot<NPREV, VEC>(g, prev_kv, prev_e, S);
      accumulate_dot<RATIO, VEC>(g, own_kv, own_e, S);

      if (use_prev) {
#pragma unroll
        for (int k = 0; k < NPREV; ++k) {
          float gkv[VEC], gs[VEC];
          slot_gradients<VEC>(g, prev_kv[k], prev_e[k], S, gkv, gs, dape_prev[k]);
          store_vec<E, VEC>(grad_kv + gkb - gk_rows.steps(RATIO - k), gkv);
          store_vec<E, VEC>(grad_score + gsb - gs_rows.steps(RATIO - k), gs);
        }
      }
#pragma unroll
      for (int k = 0; k < RATIO; ++k) {
        float gkv[VEC], gs[VEC];
        slot_gradients<VEC>(g, own_kv[k], own_e[k], S, gkv, gs, dape_own[k]);
        store_vec<E, VEC>(grad_kv + gkb + gk_rows.steps(k) + OWN, gkv);
        store_vec<E, VEC>(grad_score + gsb + gs_rows.steps(k) + OWN, gs);
      }
      if (w.last) {
        // The segment's last block: its own tokens' first-half columns are never consumed
        // (no next block), nor is the tail (< ratio tokens) after it.
        if (COFF == 2) {
#pragma unroll
          for (int k = 0; k < RATIO; ++k) {
            store_zero_vec<E, VEC>(grad_kv + gkb + gk_rows.steps(k));
            store_zero_vec<E, VEC>(grad_score + gsb + gs_rows.steps(k));
          }
        }
        const int step = L::token_step(p);
        for (int t = 0; t < w.tail; ++t)
          zero_token<IO, COFF, HEAD_DIM, VEC>(p, gk_rows, gs_rows,
                                              w.t0 + static_cast<long long>(RATIO + t) * step, col);
      }
    }

    // The zeros no row owns, in the default form after the rows.
    if constexpr (!ZEROS_FIRST) {
      const int zcol = REREAD ? reread_block_thread_x(TX) * VEC : col;
      const int zused = REREAD ? L::used_tokens(p) : used;
      zero_rowless_tokens<IO, RATIO, COFF, HEAD_DIM, VEC, TY>(p, gk_rows, gs_rows, zused, zcol);
    }
  }

  // grad_ape: every thread parks its partials in shared memory; then each thread folds a few
  // (slot, column) elements over the TY row lanes in lane order (fixed, so bitwise stable) and
  // writes one partial (or one atomic) per element, consecutive threads on consecutive floats.
  // The block zeroed before this CTA's adds; a barrier follows (the fold's, or the one below).
  if (claims) claim_await_zeroed(grad_ape_claim_word(p), gridDim.y, LEAN ? parked_claim : claim);
  if constexpr (TY > 1) {
    __shared__ __align__(16) float fold[TY][SLOTS][ROW_FLOATS];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      if constexpr (COFF == 2) {
#pragma unroll
        for (int k = 0; k < RATIO; ++k) fold[ty][k][tx * VEC + v] = dape_prev[k][v];
      }
#pragma unroll
      for (int k = 0; k < RATIO; ++k) fold[ty][SLOTS - RATIO + k][tx * VEC + v] = dape_own[k][v];
    }
    if constexpr (GRAD_W) {
      __shared__ float wfold[TY][ROW_FLOATS];
#pragma unroll
      for (int v = 0; v < VEC; ++v) wfold[ty][tx * VEC + v] = dw[v];
      __syncthreads();
      // grad_w's partial of this row group and column block, folded over the row lanes in
      // lane order (after the claimant's zeroing: claim_await_zeroed above).
      const int wcol0 = static_cast<int>(blockIdx.x) * ROW_FLOATS;
      for (int c = ty * TX + tx; c < ROW_FLOATS && wcol0 + c < HEAD_DIM; c += TX * TY) {
        float sum = wfold[0][c];
#pragma unroll
        for (int y = 1; y < TY; ++y) sum = __fadd_rn(sum, wfold[y][c]);
        if constexpr (FIXED_ORDER) {
          p.workspace[static_cast<long long>(blockIdx.y) * GROUP_FLOATS + RATIO * W + wcol0 + c] =
              sum;
        } else {
          atomicAdd(p.grad_w + wcol0 + c, sum);
        }
      }
    }
    __syncthreads();
    float* dst =
        FIXED_ORDER ? p.workspace + static_cast<long long>(blockIdx.y) * GROUP_FLOATS : p.grad_ape;
    const int col0 = blockIdx.x * ROW_FLOATS;
    if constexpr (!FIXED_ORDER && ROW_FLOATS % 4 == 0 && HEAD_DIM % 4 == 0) {
      // Four consecutive elements a thread, added by one 16-byte reduction: a quarter of the
      // atomics. Each element is still folded over the lanes in lane order. A quad never
      // straddles a slot (ROW_FLOATS % 4 == 0) nor head_dim (col0 and c are multiples of 4),
      // and grad_ape is 16-byte aligned (validation).
      for (int q = ty * TX + tx; q < SLOTS * ROW_FLOATS / 4; q += TX * TY) {
        const int slot = q * 4 / ROW_FLOATS;
        const int c = q * 4 - slot * ROW_FLOATS;
        if (col0 + c >= HEAD_DIM) continue;
        float4 sum = *reinterpret_cast<const float4*>(&fold[0][slot][c]);
#pragma unroll
        for (int y = 1; y < TY; ++y)
          add_rn_into(sum, *reinterpret_cast<const float4*>(&fold[y][slot][c]));
        atomic_add_quad(dst + window_slot_index<RATIO, COFF, HEAD_DIM>(slot, col0, c), sum);
      }
    } else {
      for (int e = ty * TX + tx; e < SLOTS * ROW_FLOATS; e += TX * TY) {
        const int slot = e / ROW_FLOATS;
        const int c = e - slot * ROW_FLOATS;
        if (col0 + c >= HEAD_DIM) continue;
        float sum = fold[0][slot][c];
#pragma unroll
        for (int y = 1; y < TY; ++y) sum = __fadd_rn(sum, fold[y][slot][c]);
        const int idx = window_slot_index<RATIO, COFF, HEAD_DIM>(slot, col0, c);
        if (FIXED_ORDER) {
          dst[idx] = sum;
        } else {
          atomicAdd(dst + idx, sum);
        }
      }
    }
  } else {
    if (claims) __syncthreads();
    if (!active) return;
    float* dst =
        FIXED_ORDER ? p.workspace + static_cast<long long>(blockIdx.y) * GROUP_FLOATS : p.grad_ape;
    // Each thread's VEC columns of a slot as one vector, except in the scalar-partials form: the
    // partials' rows and grad_ape are aligned to it (W and the workspace's row groups are
    // multiples of head_dim). grad_w is only 4-byte aligned: scalar atomics there.
    static_assert(HEAD_DIM % VEC == 0 && (VEC & (VEC - 1)) == 0, "whole aligned vectors a slot");
    using F32 = Element<kElementF32>;
    const auto put = [&](float* at, const float(&v)[VEC]) {
      if constexpr (SCALAR_PARTIALS) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          if constexpr (FIXED_ORDER) {
            at[i] = v[i];
          } else {
            atomicAdd(at + i, v[i]);
          }
        }
      } else if constexpr (FIXED_ORDER) {
        store_vec<F32, VEC>(at, v);
      } else {
        atomic_add_vec<VEC>(at, v);
      }
    };
    if constexpr (GRAD_W) {
      if constexpr (FIXED_ORDER) {
        put(dst + RATIO * W + col, dw);
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) atomicAdd(p.grad_w + col + v, dw[v]);
      }
    }
    if constexpr (COFF == 2) {
#pragma unroll
      for (int k = 0; k < RATIO; ++k) put(dst + k * W + col, dape_prev[k]);
    }
#pragma unroll
    for (int k = 0; k < RATIO; ++k) put(dst + k * W + OWN + col, dape_own[k]);
  }
}

}  // namespace csa_kernel
