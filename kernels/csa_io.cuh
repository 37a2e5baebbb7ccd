// The I/O policy of every kernel template: the element type of the bf16/fp16/fp32 tensors,
// where a token's row lies (layout) and how the forward stores a pooled row (epilogue). A
// kernel is instantiated as kernel<Io<ELEMENT, LAYOUT, EPILOGUE>, shape..., schedule...>; the
// arithmetic is the same fp32 code for every policy, with one rounding per output.
#pragma once
#include "csa_common.cuh"

namespace csa_kernel {

// ---- element types ------------------------------------------------------------------------

template <int KIND>
struct Element;

// Two-byte types convert pairs packed in one 32-bit word (the low half first).
template <>
struct Element<kElementBf16> {
  using T = unsigned short;
  static __device__ __forceinline__ float low(unsigned w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float high(unsigned w) {
    return __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ float to_f32(T h) { return bf16_to_f32(h); }
  static __device__ __forceinline__ T from_f32(float f) { return f32_to_bf16(f); }
  // Two values rounded and packed with one instruction (lo in the low half).
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <>
struct Element<kElementF16> {
  using T = unsigned short;
  static __device__ __forceinline__ float to_f32(T h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  static __device__ __forceinline__ float low(unsigned w) {
    return to_f32(static_cast<T>(w & 0xffffu));
  }
  static __device__ __forceinline__ float high(unsigned w) {
    return to_f32(static_cast<T>(w >> 16));
  }
  // Round to nearest even, as PyTorch's .to(float16) does.
  static __device__ __forceinline__ T from_f32(float f) {
    T h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <>
struct Element<kElementF32> {
  using T = float;
  static __device__ __forceinline__ float to_f32(T x) { return x; }
  static __device__ __forceinline__ T from_f32(float f) { return f; }
};

// VEC adjacent elements as raw bits, moved with one access (32 bytes: two 16-byte accesses).
struct Raw32 {
  uint4 lo, hi;
};
template <int BYTES>
struct RawBits;
template <>
struct RawBits<2> {
  using type = unsigned short;
};
template <>
struct RawBits<4> {
  using type = unsigned;
};
template <>
struct RawBits<8> {
  using type = uint2;
};
template <>
struct RawBits<16> {
  using type = uint4;
};
template <>
struct RawBits<32> {
  using type = Raw32;
};

template <class E, int VEC>
using RawVec = typename RawBits<VEC* static_cast<int>(sizeof(typename E::T))>::type;

template <class E, int VEC>
__device__ __forceinline__ RawVec<E, VEC> load_raw(const typename E::T* p) {
  using Raw = RawVec<E, VEC>;
  if constexpr (sizeof(Raw) == 32) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    return Raw32{__ldg(q), __ldg(q + 1)};
  } else {
    return __ldg(reinterpret_cast<const Raw*>(p));
  }
}

template <class E, int VEC>
__device__ __forceinline__ void raw_to_f32(const RawVec<E, VEC>& raw, float (&v)[VEC]) {
  if constexpr (sizeof(typename E::T) == 4) {
    const float* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = f[i];
  } else if constexpr (VEC == 1) {
    v[0] = E::to_f32(raw);
  } else {
    const unsigned* w = reinterpret_cast<const unsigned*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      v[2 * i] = E::low(w[i]);
      v[2 * i + 1] = E::high(w[i]);
    }
  }
}

template <class E, int VEC>
__device__ __forceinline__ void load_vec(const typename E::T* p, float (&v)[VEC]) {
  raw_to_f32<E, VEC>(load_raw<E, VEC>(p), v);
}

template <class E, int VEC>
__device__ __forceinline__ RawVec<E, VEC> f32_to_raw(const float (&v)[VEC]) {
  RawVec<E, VEC> raw;
  if constexpr (sizeof(typename E::T) == 4) {
    float* f = reinterpret_cast<float*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = v[i];
  } else if constexpr (VEC == 1) {
    raw = E::from_f32(v[0]);
  } else {
    unsigned* w = reinterpret_cast<unsigned*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) w[i] = E::pack(v[2 * i], v[2 * i + 1]);
  }
  return raw;
}

template <class E, int VEC>
__device__ __forceinline__ void store_raw(typename E::T* p, const RawVec<E, VEC>& raw) {
  using Raw = RawVec<E, VEC>;
  if constexpr (sizeof(Raw) == 32) {
    uint4* q = reinterpret_cast<uint4*>(p);
    q[0] = raw.lo;
    q[1] = raw.hi;
  } else {
    *reinterpret_cast<Raw*>(p) = raw;
  }
}

template <class E, int VEC>
__device__ __forceinline__ void store_vec(typename E::T* p, const float (&v)[VEC]) {
  store_raw<E, VEC>(p, f32_to_raw<E, VEC>(v));
}

template <class E, int VEC>
__device__ __forceinline__ void store_zero_vec(typename E::T* p) {
  store_raw<E, VEC>(p, RawVec<E, VEC>{});
}

// ---- layouts --------------------------------------------------------------------------------

// Element offsets of one tensor's token rows: the layout's row r starts at r * stride, and a
// segment's consecutive tokens lie `step` elements apart (stride in THD, B * stride in SBHD).
struct TokenRows {
  long long stride;
  long long step;
  // Element offsets: of the layout's row `row`, and of `n` token steps.
  __device__ __forceinline__ long long at(long long row) const { return row * stride; }
  __device__ __forceinline__ long long steps(int n) const { return n * step; }
};

template <int KIND, int RATIO, int COFF, int HEAD_DIM>
struct Layout {
  static constexpr int W = COFF * HEAD_DIM;
  static constexpr bool kPacked = KIND == kLayoutThdPacked;
  static constexpr bool kSbhd = KIND == kLayoutSbhd;
  // THD packs may hold segments shorter than the ratio and token capacity past cu[B]; in SBHD
  // every column has S tokens, and S < ratio leaves every token unconsumed.
  static constexpr bool kOffsets = !kSbhd;

  template <class P>
  static __device__ __forceinline__ int token_step(const P& p) {
    return kSbhd ? p.num_segments : 1;
  }
  // Rows of kv / score / grad_kv / grad_score (width W) and of out / grad_out (HEAD_DIM).
  template <class P>
  static __device__ __forceinline__ TokenRows rows(const P& p, int stride) {
    const long long s = kPacked ? W : stride;
    return TokenRows{s, s * token_step(p)};
  }
  template <class P>
  static __device__ __forceinline__ long long out_stride(const P& p, int stride) {
    return kPacked ? HEAD_DIM : stride;
  }

  // The window of output row `row` (SBHD rows are (block, column) in row-major order: row
  // i * B + b is block i of column b). SBHD splits the row with the host's RowDivisor, or with
  // an integer division where !BY_DIVISOR (the plain short-window backward: docs/design.md).
  template <bool BY_DIVISOR = true, class P>
  static __device__ __forceinline__ RowWindow locate(const P& p, int row) {
    if constexpr (kSbhd) {
      const int batch = p.num_segments > 0 ? p.num_segments : 1;
      const int i = BY_DIVISOR ? divide_row(row, p.batch_divisor) : row / batch;
      const int b = BY_DIVISOR ? row - i * batch : row % batch;
      const int blocks = p.seq_len / RATIO;
      RowWindow w;
      w.padding = i >= blocks;  // never: the host checks total_comp == blocks * B
      w.block = w.padding ? 0 : i;
      w.t0 = w.padding ? b : (i * RATIO) * batch + b;
      w.first = w.padding || i == 0;
      w.last = !w.padding && i + 1 == blocks;
      w.tail = w.last ? min(p.seq_len - (i + 1) * RATIO, RATIO - 1) : 0;
      return w;
    } else {
      return locate_row<RATIO>(p.cu_seqlens, p.cu_seqlens_comp, p.num_segments, p.total_tokens,
                               row);
    }
  }
  // Where row's window most likely is, with no dependent load (the prefetches' guess). In SBHD
  // the guess is the window (the short-window forward locates its row once, before the prefetch).
  static constexpr bool kGuessIsExact = kSbhd;
  template <bool BY_DIVISOR = true, class P>
  static __device__ __forceinline__ RowWindow guess(const P& p, int row) {
    if constexpr (kSbhd) {
      return locate<BY_DIVISOR>(p, row);
    } else {
      return guessed_row_window<RATIO>(row, p.total_tokens);
    }
  }
  // Rows that belong to segments (the rest are padding rows).
  template <class P>
  static __device__ __forceinline__ int rows_valid(const P& p) {
    if constexpr (kSbhd) {
      return p.total_comp;
    } else {
      return valid_row_count(p.cu_seqlens_comp, p.num_segments, p.total_comp);
    }
  }
  // Token rows before this one are consumed or owned by a row; [used, total_tokens) are not.
  template <class P>
  static __device__ __forceinline__ int used_tokens(const P& p) {
    if constexpr (kSbhd) {
      return p.seq_len >= RATIO ? p.total_tokens : 0;
    } else {
      return p.num_segments > 0 ? clamp_i32(__ldg(p.cu_seqlens + p.num_segments), 0, p.total_tokens)
                                : 0;
    }
  }
};

// ---- epilogues ------------------------------------------------------------------------------

// kEpilogueIdentity: each thread stores its own columns (store, or store_row from the
// short-window forward). A tail code: TailEpilogue (tail_epilogue.cuh), cooperative: every
// thread of the CTA calls its store_row, threads without a row included.
struct IdentityEpilogue {
  static constexpr bool kCooperative = false;
  static constexpr bool kRowStats = false;
  static constexpr bool kRowKernel = false;
  static constexpr bool kCluster = false;
  static constexpr bool kNorm = false;
  template <int VEC>
  struct Operands {};  // none
  // VEC columns of one pooled row, fp32, to `dst` (row `row`, first column `col`).
  template <class E, int VEC>
  static __device__ __forceinline__ void store(typename E::T* dst, int /*row*/, int /*col*/,
                                               const float (&v)[VEC]) {
    store_vec<E, VEC>(dst, v);
  }
  template <int VEC, int HEAD_DIM, int THREADS, class P>
  static __device__ __forceinline__ void stage_operands(const P& /*p*/, int /*col*/, int /*block*/,
                                                        int /*tid*/) {}
  template <class E, int VEC, int HEAD_DIM, int THREADS>
  static __device__ __forceinline__ void store_row(const ForwardParams& /*p*/, typename E::T* dst,
                                                   int /*row*/, int /*col*/, bool /*has_row*/,
                                                   float (&v)[VEC]) {
    store_vec<E, VEC>(dst, v);
  }
};

template <int KIND>
struct TailEpilogue;  // tail_epilogue.cuh, included at the end of this file

template <bool TAIL, int KIND>
struct EpilogueOf {
  using type = IdentityEpilogue;
};
template <int KIND>
struct EpilogueOf<true, KIND> {
  using type = TailEpilogue<KIND>;
};
template <int KIND>
using Epilogue = typename EpilogueOf<(KIND & kEpilogueTail) != 0, KIND>::type;

// ---- the policy -----------------------------------------------------------------------------

template <int ELEMENT, int LAYOUT, int EPILOGUE>
struct Io {
  static constexpr int kElement = ELEMENT;
  static constexpr int kLayout = LAYOUT;
  using E = Element<ELEMENT>;
  using T = typename E::T;
  using Store = Epilogue<EPILOGUE>;
  template <int RATIO, int COFF, int HEAD_DIM>
  using L = Layout<LAYOUT, RATIO, COFF, HEAD_DIM>;

  static __device__ __forceinline__ const T* in(const void* p) { return static_cast<const T*>(p); }
  static __device__ __forceinline__ T* out(void* p) { return static_cast<T*>(p); }
};

}  // namespace csa_kernel

#include "tail_epilogue.cuh"  // needs the element types above
