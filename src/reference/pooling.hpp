// The pooling of the CPU references, shared by the plain and the tail references: element
// access in every type, each output row's window (SPEC §1), and the forward and backward in the
// SPEC §2 op order over T = float (the reference) or double (the oracle). Internal.
// NOTE: every file including this must be compiled with -ffp-contract=off (CMakeLists.txt).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "csa/reference.hpp"

namespace csa::reference::detail {

// Element i of a config.dtype tensor, and the rounding of a result to it.
inline float element(const void* data, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return fp16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    default:
      return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
}

inline void store_element(void* data, DType dtype, std::int64_t i, float v) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(data)[i] = v;
      return;
    case DType::kF16:
      static_cast<std::uint16_t*>(data)[i] = float_to_fp16(v);
      return;
    default:
      static_cast<std::uint16_t*>(data)[i] = float_to_bf16(v);
  }
}

inline bool sbhd(const HostProblem& p) {
  return p.config.layout == Layout::kSbhd;
}

// The window of one output row (SPEC §1), for valid offsets: its segment, its block, and the
// segment's first token row (THD) or column (SBHD).
struct Window {
  std::int64_t segment_row0 = 0;  // THD: cu[s]; SBHD: s
  std::int64_t block = 0;
  bool first = true;
};

inline std::int64_t valid_rows(const HostProblem& p) {
  if (sbhd(p)) return p.total_comp;
  if (p.num_segments <= 0) return 0;
  return std::min<std::int64_t>(p.cu_seqlens_comp[p.num_segments], p.total_comp);
}

inline Window window_of(const HostProblem& p, std::int64_t row) {
  Window w;
  if (sbhd(p)) {  // row i * B + b: block i of column b
    w.segment_row0 = row % p.num_segments;
    w.block = row / p.num_segments;
    w.first = w.block == 0;
    return w;
  }
  if (row >= valid_rows(p)) return w;  // padding row: block 0 from token 0
  for (int s = 0; s < p.num_segments; ++s) {
    if (p.cu_seqlens_comp[s] <= row && row < p.cu_seqlens_comp[s + 1]) {
      w.block = row - p.cu_seqlens_comp[s];
      w.segment_row0 = p.cu_seqlens[s];
      w.first = w.block == 0;
    }
  }
  return w;
}

// Row of token t (counted from the segment's start) of the window's segment.
inline std::int64_t token_row(const HostProblem& p, const Window& w, std::int64_t t) {
  return sbhd(p) ? t * p.num_segments + w.segment_row0 : w.segment_row0 + t;
}

struct Slot {
  bool valid;
  std::int64_t offset;  // into kv / score
  std::int64_t ape;     // into ape
};

inline Slot slot_of(const HostProblem& p, const Window& w, int k, int j) {
  const int r = p.config.ratio;
  const int d = p.config.head_dim;
  const std::int64_t width = static_cast<std::int64_t>(p.config.coff) * d;
  const std::int64_t t0 = w.block * r;
  if (p.config.coff == 1)
    return {true, token_row(p, w, t0 + k) * width + j, static_cast<std::int64_t>(k) * width + j};
  if (k < r) {
    const bool valid = !w.first;
    return {valid, valid ? token_row(p, w, t0 - r + k) * width + j : 0,
            static_cast<std::int64_t>(k) * width + j};
  }
  return {true, token_row(p, w, t0 + k - r) * width + d + j,
          static_cast<std::int64_t>(k - r) * width + d + j};
}

// Softmax weights of one (row, column); T is float (reference order) or double (oracle).
template <typename T>
void weights(const HostProblem& p, const Window& w, int j, std::vector<T>& prob) {
  const int slots = p.config.coff * p.config.ratio;
  prob.assign(slots, T(0));
  std::vector<T> s(slots);
  T m = -std::numeric_limits<T>::infinity();
  for (int k = 0; k < slots; ++k) {
    const Slot sl = slot_of(p, w, k, j);
    s[k] = sl.valid ? static_cast<T>(element(p.score, p.config.dtype, sl.offset)) +
                          static_cast<T>(p.ape[sl.ape])
                    : -std::numeric_limits<T>::infinity();
    m = std::fmax(m, s[k]);
  }
  T den = 0;
  for (int k = 0; k < slots; ++k) {
    prob[k] = std::exp(s[k] - m);
    den += prob[k];
  }
  for (int k = 0; k < slots; ++k) prob[k] = prob[k] / den;
}

template <typename T>
T kv_of(const HostProblem& p, const Slot& sl) {
  return sl.valid ? static_cast<T>(element(p.kv, p.config.dtype, sl.offset)) : T(0);
}

// The pooled row `row` (head_dim values, not rounded).
template <typename T>
void pooled_row(const HostProblem& p, std::int64_t row, std::vector<T>& x) {
  const int d = p.config.head_dim;
  const int slots = p.config.coff * p.config.ratio;
  const Window w = window_of(p, row);
  std::vector<T> prob;
  x.assign(static_cast<std::size_t>(d), T(0));
  for (int j = 0; j < d; ++j) {
    weights<T>(p, w, j, prob);
    T acc = 0;
    for (int k = 0; k < slots; ++k) acc += kv_of<T>(p, slot_of(p, w, k, j)) * prob[k];
    x[static_cast<std::size_t>(j)] = acc;
  }
}

template <typename T, typename Store>
void forward_impl(const HostProblem& p, Store store) {
  const int d = p.config.head_dim;
  std::vector<T> x;
  for (std::int64_t row = 0; row < p.total_comp; ++row) {
    pooled_row<T>(p, row, x);
    for (int j = 0; j < d; ++j) store(row * d + j, x[static_cast<std::size_t>(j)]);
  }
}

// Calls emit(slot, ds, gkv) for every valid slot of every valid row, the pooled row's gradient
// being grad(row, j).
template <typename T, typename Grad, typename Emit>
void backward_rows(const HostProblem& p, Grad grad, Emit emit) {
  const int d = p.config.head_dim;
  const int slots = p.config.coff * p.config.ratio;
  std::vector<T> prob;
  const std::int64_t rows = valid_rows(p);
  for (std::int64_t row = 0; row < rows; ++row) {
    const Window w = window_of(p, row);
    for (int j = 0; j < d; ++j) {
      weights<T>(p, w, j, prob);
      const T g = grad(row, j);
      T S = 0;
      for (int k = 0; k < slots; ++k) {
        const T dp = g * kv_of<T>(p, slot_of(p, w, k, j));
        const T pd = dp * prob[k];
        S += pd;
      }
      for (int k = 0; k < slots; ++k) {
        const Slot sl = slot_of(p, w, k, j);
        if (!sl.valid) continue;
        const T dp = g * kv_of<T>(p, sl);
        const T pd = dp * prob[k];
        const T ds = std::fma(prob[k], -S, pd);
        emit(sl, ds, g * prob[k]);
      }
    }
  }
}

// The same with the pooled rows' gradient read from grad_out (config.dtype elements).
template <typename T, typename Emit>
void backward_impl(const HostProblem& p, const void* grad_out, Emit emit) {
  const int d = p.config.head_dim;
  backward_rows<T>(
      p,
      [&](std::int64_t row, int j) {
        return static_cast<T>(element(grad_out, p.config.dtype, row * d + j));
      },
      emit);
}

// The block index of output row `row` in its segment (padding rows: 0).
inline std::int64_t block_of(const HostProblem& p, std::int64_t row) {
  return window_of(p, row).block;
}

inline std::int64_t width_of(const HostProblem& p) {
  return static_cast<std::int64_t>(p.config.coff) * p.config.head_dim;
}

}  // namespace csa::reference::detail
