// Device helpers shared by every kernel family: bf16 conversion, fp32 vector access, the
// THD row-to-window mapping with clamping. Self-contained: NVRTC needs no CUDA include directory.
#pragma once
#include "csa_params.h"
#include "exact_math.cuh"

namespace csa_kernel {

// Programmatic dependent launch (sm_90 and newer): wait until the kernels before this one in
// the stream have finished and their memory is visible, then let the next kernel's CTAs be
// scheduled while this one runs (they wait in their own pdl_enter()). This hides the launch
// latency between back-to-back kernels. Both instructions do nothing when the launch did not
// ask for programmatic serialization.
// NOTE: must come before the kernel's first global memory access, read or write. The one
// exception is an L2 prefetch (prefetch_l2): a hint that neither reads a value nor writes one,
// and L2 is where the previous kernel's stores land, so it cannot observe or keep stale data.
// Issued before the wait, the window's DRAM round trip overlaps the previous kernel's tail
// (short_window_forward; lane_window_forward on grids of at most 3 waves).
// NOTE: the early launch_dependents also lets a kernel that the application launches next
// with programmatic serialization start before this one ends; such a kernel must wait
// (griddepcontrol.wait / cudaGridDependencySynchronize) before reading csa's outputs, as the
// programmatic-launch contract asks anyway (CSA_PROGRAMMATIC_LAUNCH=0 otherwise).
// `dependents_first`: let the next kernel's CTAs in before this one's wait, not after. Only
// for grids of one wave that issue nothing before the wait (the short-window backward, the
// grad_ape reduction): their CTAs are all resident, so the next kernel's waiting CTAs take no
// place they need, and reach their own wait a kernel earlier. Every kernel doing it slowed the
// forwards: their prefetches before the wait then met the next call's.
// The two halves of pdl_enter for a kernel whose predecessor lets it in only after that
// predecessor's own wait (pdl_enter(false)): everything before that one is then complete, so
// this kernel may read its inputs and write its outputs before pdl_wait, which only the
// predecessor's results need (the tail backward's row-stats form after tail_row_stats).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_enter(bool dependents_first = false) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (dependents_first) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!dependents_first) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
  (void)dependents_first;
#endif
}

// Thread-block clusters (sm_90 and newer; a kernel that uses them is never built for older
// arches). cluster_arrive releases this thread's earlier writes, cluster_wait acquires every
// arrived thread's: between the two, a CTA of the cluster may read what the others wrote to
// their shared memory before arriving (load_cluster_f32), and a CTA must not exit while
// another may still read its shared memory.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
// The float at `local` (this CTA's shared memory) in the shared memory of the cluster's CTA
// of rank `rank`.
__device__ __forceinline__ float load_cluster_f32(const float* local, int rank) {
  float value = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(remote) : "memory");
#else
  (void)local;
  (void)rank;
#endif
  return value;
}

// blockIdx.x * span + threadIdx.x, read from the special registers at this point.
// NOTE: volatile on purpose: ptxas may not reuse an earlier read held through a loop, which is
// the point (a value it would otherwise keep live, at a register budget where it spills).
__device__ __forceinline__ int reread_block_thread_x(int span) {
  unsigned block, thread;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(block));
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(thread));
  return static_cast<int>(block) * span + static_cast<int>(thread);
}

// threadIdx.y * blockDim.x + threadIdx.x of a CTA of `tx` columns of threads, read from the
// special registers at this point (volatile on purpose, as reread_block_thread_x).
__device__ __forceinline__ int reread_thread_linear(int tx) {
  unsigned x, y;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
  asm volatile("mov.u32 %0, %%tid.y;" : "=r"(y));
  return static_cast<int>(y) * tx + static_cast<int>(x);
}

// acc += b per lane, each sum rounded to nearest (no contraction).
__device__ __forceinline__ void add_rn_into(float4& acc, const float4& b) {
  acc.x = __fadd_rn(acc.x, b.x);
  acc.y = __fadd_rn(acc.y, b.y);
  acc.z = __fadd_rn(acc.z, b.z);
  acc.w = __fadd_rn(acc.w, b.w);
}

// Adds four consecutive floats into global memory: one 16-byte reduction on sm_90 and newer
// (`red.global.add.v4.f32`), four scalar atomics before. `dst` must be 16-byte aligned.
__device__ __forceinline__ void atomic_add_quad(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

// Adds VEC consecutive floats into global memory: 16-byte reductions where whole quads fit, an
// 8-byte `red.global.add.v2.f32` for pairs (sm_90 and newer), scalar atomics otherwise. `dst`
// must be aligned to the vector (VEC * 4 bytes, at most 16).
template <int VEC>
__device__ __forceinline__ void atomic_add_vec(float* dst, const float (&v)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4)
      atomic_add_quad(dst + i, make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (VEC == 2) {
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(v[0]), "f"(v[1])
                   : "memory");
      return;
    }
#endif
#pragma unroll
    for (int i = 0; i < VEC; ++i) atomicAdd(dst + i, v[i]);
  }
}

// Atomic grad_ape, overwriting, in one launch: a column block's grad_ape elements must be
// zero before any of its CTAs adds into them, and nothing clears memory between calls. The
// block's claim word `state` (zero when first allocated) holds
// [generation:32 | zeroed:1 | arrivals:31]; `ctas` is the number of the block's CTAs, and every
// one of them takes the three steps below once, in this order:
//   claim_arrive        at the kernel's start (after pdl_enter): one arrival (thread 0);
//   claim_zero_if_first once the arrival's reply is due anyway (warp 0): the CTA that found no
//                       arrival before its own claims the block, zeroes it with warp 0's lanes
//                       and publishes `zeroed`;
//   claim_await_zeroed  before the CTA's adds, with a __syncthreads() between (thread 0): a
//                       CTA that did not claim waits until `zeroed`; the last arrival then
//                       resets the word to the next generation with no arrivals.
// So the word is ready for the next launch on its own, with nothing from the host, and a CUDA
// graph can replay the launch as it is. A CTA only ever waits for the claimant, which arrived
// first and so is running, whatever the grid's residency. The claimant zeroes early, at its
// start, so that the others rarely wait at their end: with the claim taken at the end (after
// the CTA's rows) 17 % of the warp samples of the 32-row 128,1,512 backward sat on it.
// NOTE: acquire / release at gpu scope (not fences), so that a CTA's own pending gradient
// stores are not drained on the way; the barriers carry the order to the CTA's other threads.
// The publication is a reduction (no reply): the claimant does not wait for it to land.
// NOTE: one launch at a time per word: the next launch on a stream touches the word only
// after its programmatic wait (the previous grid complete and flushed).
namespace claim_word {
constexpr unsigned long long kZeroed = 1ull << 31;
constexpr unsigned long long kArrivals = kZeroed - 1;
// Added to a word holding `zeroed` and all `ctas` arrivals, it leaves generation + 1.
__device__ __forceinline__ unsigned long long next_generation(unsigned ctas) {
  return (1ull << 32) - kZeroed - ctas;
}
__device__ __forceinline__ void reset(unsigned long long* state, unsigned ctas) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(state), "l"(next_generation(ctas))
               : "memory");
}

// A claim word as a plain arrival counter (the long-window tail's rows): an arrival adds one
// to its low bits (acquire / release at gpu scope) and returns the count before it; the last
// of `arrivals` clears them again, keeping the generation, so that the word is one that both
// uses take as unused (no arrivals) whichever used it last.
// NOTE: the generation is not a count: a counter must never be read from the whole word.
__device__ __forceinline__ unsigned count_arrival(unsigned long long* state) {
  unsigned long long before;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;"
               : "=l"(before)
               : "l"(state)
               : "memory");
  return static_cast<unsigned>(before & kArrivals);
}
__device__ __forceinline__ void clear_arrivals(unsigned long long* state, unsigned arrivals) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(state),
               "l"(0ull - static_cast<unsigned long long>(arrivals))
               : "memory");
}
}  // namespace claim_word

// Thread 0's arrival; the word before it, which only thread 0 holds. Relaxed, so that nothing
// waits for the reply here (an acquire would hold the warp until it lands): it is first read by
// claim_zero_if_first, and claim_await_zeroed acquires.
__device__ __forceinline__ unsigned long long claim_arrive(unsigned long long* state) {
  unsigned long long old = 0;
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], 1;"
                 : "=l"(old)
                 : "l"(state)
                 : "memory");
  }
  return old;
}

// Every thread of warp 0, at a point the whole warp reaches; zero_block(lane, lanes) zeroes
// the block. `old` is claim_arrive's value, and thread 0 keeps it.
template <class ZeroBlock>
__device__ __forceinline__ void claim_zero_if_first(unsigned long long* state, unsigned ctas,
                                                    unsigned long long old,
                                                    const ZeroBlock& zero_block) {
  const int threads = blockDim.x * blockDim.y;
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  if (t >= 32) return;
  const unsigned lanes = threads >= 32 ? 0xffffffffu : (1u << threads) - 1u;
  old = __shfl_sync(lanes, old, 0);
  if ((old & claim_word::kArrivals) != 0) return;  // another CTA claimed the block
  zero_block(t, threads < 32 ? threads : 32);
  __syncwarp(lanes);
  if (t == 0) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(state), "l"(claim_word::kZeroed)
                 : "memory");
    // The claimant is also the last arrival only as the block's one CTA; it resets after its
    // publication (same thread, same word: the two reductions land in this order).
    if (ctas == 1) claim_word::reset(state, ctas);
  }
}

// Thread 0, before the CTA's adds (the caller puts a __syncthreads() between): unless this CTA
// zeroed the block, waits until it is zeroed (one acquiring load when the claimant has
// published, as it usually has by then); the last arrival then resets the word.
__device__ __forceinline__ void claim_await_zeroed(unsigned long long* state, unsigned ctas,
                                                   unsigned long long old) {
  if (threadIdx.x != 0 || threadIdx.y != 0) return;
  const unsigned long long arrivals = old & claim_word::kArrivals;
  if (arrivals == 0) return;  // the claimant: published (and, as the only CTA, reset)
  const unsigned long long generation = old >> 32;
  for (;;) {
    unsigned long long now;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(state) : "memory");
    // Zeroed, or already reset by the last arrival (which waits for `zeroed` first).
    if ((now & claim_word::kZeroed) != 0 || (now >> 32) != generation) break;
    __nanosleep(64);
  }
  if (arrivals + 1 == ctas) claim_word::reset(state, ctas);
}

// One slot's gradients in the reference op order (SPEC §2): pd = round(round(g * kv) * p),
// grad_score = fma(p, -S, pd), grad_kv = g * p; grad_score is added into the slot's grad_ape
// partial.
template <int VEC>
__device__ __forceinline__ void slot_gradients(const float (&g)[VEC], const float (&kv)[VEC],
                                               const float (&p)[VEC], const float (&S)[VEC],
                                               float (&gkv)[VEC], float (&gs)[VEC],
                                               float (&dape)[VEC]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const float pd = __fmul_rn(__fmul_rn(g[v], kv[v]), p[v]);
    gs[v] = __fmaf_rn(p[v], -S[v], pd);
    gkv[v] = __fmul_rn(g[v], p[v]);
    dape[v] = __fadd_rn(dape[v], gs[v]);
  }
}

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
  return __uint_as_float(static_cast<unsigned>(h) << 16);
}

// Round to nearest even, as PyTorch's .to(bfloat16) does.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ float neg_inf() {
  return __int_as_float(0xff800000);
}

// One value through the read-only data cache (ld.global.nc), or (WRITTEN) from L2
// (ld.global.cg).
template <bool WRITTEN, class T>
__device__ __forceinline__ T load_cached(const T* p) {
  if constexpr (WRITTEN) {
    return __ldcg(p);
  } else {
    return __ldg(p);
  }
}

// One value an earlier kernel of the stream wrote, from L2 (load_f32_written's rule).
template <class T>
__device__ __forceinline__ T load_written(const T* p) {
  return load_cached<true>(p);
}

template <bool WRITTEN, int VEC>
__device__ __forceinline__ void load_f32_as(const float* p, float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    v[0] = load_cached<WRITTEN>(p);
  } else if constexpr (VEC == 2) {
    const float2 u = load_cached<WRITTEN>(reinterpret_cast<const float2*>(p));
    v[0] = u.x;
    v[1] = u.y;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float4 u = load_cached<WRITTEN>(reinterpret_cast<const float4*>(p + i));
      v[i] = u.x;
      v[i + 1] = u.y;
      v[i + 2] = u.z;
      v[i + 3] = u.w;
    }
  }
}

// VEC floats through the read-only data cache: for data that no grid may write while this
// kernel runs. NOTE: that excludes what a programmatic predecessor writes (the pooled rows,
// the row scalars, the fixed order's partials): it may still be running when this kernel
// starts, so those go through load_f32_written.
template <int VEC>
__device__ __forceinline__ void load_f32(const float* p, float (&v)[VEC]) {
  load_f32_as<false, VEC>(p, v);
}

// VEC floats from L2: data an earlier kernel of the stream wrote, which a programmatic
// predecessor may still have been writing at this kernel's launch (read after pdl_wait /
// pdl_enter).
template <int VEC>
__device__ __forceinline__ void load_f32_written(const float* p, float (&v)[VEC]) {
  load_f32_as<true, VEC>(p, v);
}

__device__ __forceinline__ int clamp_i32(long long v, int lo, int hi) {
  return static_cast<int>(v < lo ? lo : (v > hi ? hi : v));
}

// Number of rows that belong to segments: min(cuc[B], total_comp); the rest are padding rows.
__device__ __forceinline__ int valid_row_count(const int* cuc, int num_segments, int total_comp) {
  if (num_segments <= 0) return 0;
  return clamp_i32(__ldg(cuc + num_segments), 0, total_comp);
}

// Largest s in [0, B) with cuc[s] <= row. Terminates and stays in bounds for any array content.
__device__ __forceinline__ int find_segment(const int* cuc, int num_segments, int row) {
  int lo = 0;
  int hi = num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cuc + mid) <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Turns the window's s_k = score_k + ape_k into softmax weights in place, in the reference op
// order: m = max_k s_k, e_k = expf(s_k - m), den = sum_k e_k (slot order, previous half first),
// p_k = e_k / den (IEEE). The previous half takes part only when `use_prev`.
template <int NPREV, int NOWN, int VEC>
__device__ __forceinline__ void softmax_weights(float (&prev)[NPREV][VEC], float (&own)[NOWN][VEC],
                                                bool use_prev) {
  float mx[VEC], mn[VEC], den[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    mx[v] = neg_inf();
    mn[v] = __int_as_float(0x7f800000);
    den[v] = 0.0f;
  }
  if (use_prev) {
#pragma unroll
    for (int k = 0; k < NPREV; ++k)
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        mx[v] = fmaxf(mx[v], prev[k][v]);
        mn[v] = fminf(mn[v], prev[k][v]);
      }
  }
#pragma unroll
  for (int k = 0; k < NOWN; ++k)
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      mx[v] = fmaxf(mx[v], own[k][v]);
      mn[v] = fminf(mn[v], own[k][v]);
    }
  if (use_prev) {
#pragma unroll
    for (int k = 0; k < NPREV; ++k)
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        prev[k][v] = expf(__fsub_rn(prev[k][v], mx[v]));
        den[v] = __fadd_rn(den[v], prev[k][v]);
      }
  }
#pragma unroll
  for (int k = 0; k < NOWN; ++k)
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      own[k][v] = expf(__fsub_rn(own[k][v], mx[v]));
      den[v] = __fadd_rn(den[v], own[k][v]);
    }
  bool fast = true;
  float r[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    fast = fast && den[v] >= 1.0f && den[v] <= 0x1p24f && __fsub_rn(mn[v], mx[v]) >= -41.0f;
    r[v] = refined_reciprocal(den[v]);
  }
  if (fast) {
    if (use_prev) {
#pragma unroll
      for (int k = 0; k < NPREV; ++k)
#pragma unroll
        for (int v = 0; v < VEC; ++v) prev[k][v] = div_rn_fast(prev[k][v], den[v], r[v]);
    }
#pragma unroll
    for (int k = 0; k < NOWN; ++k)
#pragma unroll
      for (int v = 0; v < VEC; ++v) own[k][v] = div_rn_fast(own[k][v], den[v], r[v]);
  } else {
    if (use_prev) {
#pragma unroll
      for (int k = 0; k < NPREV; ++k)
#pragma unroll
        for (int v = 0; v < VEC; ++v) prev[k][v] = div_rn_exact(prev[k][v], den[v], r[v]);
    }
#pragma unroll
    for (int k = 0; k < NOWN; ++k)
#pragma unroll
      for (int v = 0; v < VEC; ++v) own[k][v] = div_rn_exact(own[k][v], den[v], r[v]);
  }
}

// Where the window of one output row lies. `first`: the previous-block half is invalid.
struct RowWindow {
  int t0;    // the layout's row of the first token of the row's own block
  int tail;  // the segment's last block (last): tokens after it, < ratio, never consumed
  bool first;
  bool last;     // the segment's last block: owns the zero-writes of its tail
  bool padding;  // at or past the last segment's rows (cuc[B]): no window of its own
  int block;     // the row's block index in its segment (padding rows: 0), RoPE's position
};

// Where a pack of ratio-aligned segments (every length a multiple of ratio, as in one long
// sequence) puts `row`: its own block starts at token row * RATIO. Only the speculative
// prefetches below use it, issued before locate_row's dependent offset loads so that the
// window's DRAM latency overlaps theirs instead of following it. A wrong guess warms lines a
// neighbouring row reads; the window stays inside [0, total_tokens) (padding: none fits).
template <int RATIO>
__device__ __forceinline__ RowWindow guessed_row_window(int row, int total_tokens) {
  RowWindow w{};
  const long long last_start = static_cast<long long>(total_tokens) - RATIO;
  const long long t0 = min(static_cast<long long>(row) * RATIO, last_start);
  w.padding = last_start < 0;
  w.t0 = w.padding ? 0 : static_cast<int>(t0);
  w.first = w.t0 < RATIO;
  return w;
}

// prefetch.global.L2: a hint, no register result, nothing waits for it.
__device__ __forceinline__ void prefetch_l2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
}

// NOTE: offsets are device data the host cannot check; every derived token index is clamped
// so that [t0 - ratio (when !first), t0 + ratio) and the tail stay inside [0, total_tokens).
template <int RATIO>
__device__ __forceinline__ RowWindow locate_row(const int* cu, const int* cuc, int num_segments,
                                                int total_tokens, int row) {
  RowWindow w;
  w.t0 = 0;
  w.tail = 0;
  w.first = true;
  w.last = false;
  w.padding = true;
  w.block = 0;
  if (num_segments <= 0) return w;  // no segments: every row is a padding row
  // A row at or past cuc[B] is a padding row: the search then ends at the last segment with
  // row >= cuc[s + 1]. Deciding it from the segment's own offsets keeps one dependent load
  // (cuc[B]) off the path to the window's loads.
  const int s = find_segment(cuc, num_segments, row);
  const int c0 = __ldg(cuc + s);
  const int c1 = __ldg(cuc + s + 1);
  const int cu0 = __ldg(cu + s);
  const int cu1 = __ldg(cu + s + 1);
  // 32-bit arithmetic throughout: block <= total_tokens / RATIO and the segment start is
  // clamped to [0, total_tokens], so t0 < 2 * total_tokens < 2^32 fits an unsigned.
  int block = row - c0;
  block = block < 0 ? 0 : min(block, total_tokens / RATIO);
  const unsigned start = static_cast<unsigned>(min(max(cu0, 0), total_tokens));
  const unsigned t0 = start + static_cast<unsigned>(block) * RATIO;
  int lo = block > 0 ? RATIO : 0;
  const int hi = total_tokens - RATIO;
  if (lo > hi) {
    lo = 0;
    block = 0;
  }
  // Padding rows: block 0 of a segment starting at token 0.
  const bool padding = row >= c1;
  w.t0 = padding
             ? 0
             : static_cast<int>(min(max(t0, static_cast<unsigned>(lo)), static_cast<unsigned>(hi)));
  w.padding = padding;
  w.block = padding ? 0 : block;
  w.first = padding || block == 0;
  w.last = !padding && row + 1 >= c1;
  const int seg_end = padding ? 0 : min(max(cu1, 0), total_tokens);
  w.tail = w.last ? max(0, min(seg_end, w.t0 + 2 * RATIO - 1) - (w.t0 + RATIO)) : 0;
  return w;
}

}  // namespace csa_kernel
