// CPU references. NOTE: this file is compiled with -ffp-contract=off so that every product and
// sum is rounded on its own, exactly as SPEC §2 orders them.
#include "csa/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace csa::reference {

float bf16_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::uint16_t float_to_bf16(float value) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

float fp16_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const int exponent = (bits >> 10) & 0x1f;
  const std::uint32_t mantissa = bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero and subnormals
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), exponent - 25);
  }
  std::uint32_t u;
  std::memcpy(&u, &magnitude, sizeof u);
  u |= sign;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::uint16_t float_to_fp16(float value) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(value);
  if (std::isnan(value)) return static_cast<std::uint16_t>(sign | 0x7e00u);
  if (a >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 0x1p-14f) {
    // Subnormal range: multiples of 2^-24, rounded to nearest even by the FPU's rint.
    const auto m = static_cast<std::uint32_t>(std::nearbyint(a * 0x1p24f));
    return static_cast<std::uint16_t>(sign | m);
  }
  std::uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  // Keep 10 mantissa bits, round to nearest even on the 13 dropped ones.
  const std::uint32_t rounded = bits + 0xfffu + ((bits >> 13) & 1u);
  const std::uint32_t exponent = (rounded >> 23) - 127 + 15;
  return static_cast<std::uint16_t>(sign | (exponent << 10) | ((rounded >> 13) & 0x3ffu));
}

namespace {

// Element i of a config.dtype tensor, and the rounding of a result to it.
float element(const void* data, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return fp16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    default:
      return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
}

void store_element(void* data, DType dtype, std::int64_t i, float v) {
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

bool sbhd(const HostProblem& p) {
  return p.config.layout == Layout::kSbhd;
}

// The window of one output row (SPEC §1), for valid offsets: its segment, its block, and the
// segment's first token row (THD) or column (SBHD).
struct Window {
  std::int64_t segment_row0 = 0;  // THD: cu[s]; SBHD: s
  std::int64_t block = 0;
  bool first = true;
};

std::int64_t valid_rows(const HostProblem& p) {
  if (sbhd(p)) return p.total_comp;
  if (p.num_segments <= 0) return 0;
  return std::min<std::int64_t>(p.cu_seqlens_comp[p.num_segments], p.total_comp);
}

Window window_of(const HostProblem& p, std::int64_t row) {
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
std::int64_t token_row(const HostProblem& p, const Window& w, std::int64_t t) {
  return sbhd(p) ? t * p.num_segments + w.segment_row0 : w.segment_row0 + t;
}

struct Slot {
  bool valid;
  std::int64_t offset;  // into kv / score
  std::int64_t ape;     // into ape
};

Slot slot_of(const HostProblem& p, const Window& w, int k, int j) {
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

template <typename T, typename Store>
void forward_impl(const HostProblem& p, Store store) {
  const int d = p.config.head_dim;
  const int slots = p.config.coff * p.config.ratio;
  std::vector<T> prob;
  for (std::int64_t row = 0; row < p.total_comp; ++row) {
    const Window w = window_of(p, row);
    for (int j = 0; j < d; ++j) {
      weights<T>(p, w, j, prob);
      T acc = 0;
      for (int k = 0; k < slots; ++k) acc += kv_of<T>(p, slot_of(p, w, k, j)) * prob[k];
      store(row * d + j, acc);
    }
  }
}

// Calls emit(slot, ds, gkv) for every valid slot of every valid row.
template <typename T, typename Emit>
void backward_impl(const HostProblem& p, const void* grad_out, Emit emit) {
  const int d = p.config.head_dim;
  const int slots = p.config.coff * p.config.ratio;
  std::vector<T> prob;
  const std::int64_t rows = valid_rows(p);
  for (std::int64_t row = 0; row < rows; ++row) {
    const Window w = window_of(p, row);
    for (int j = 0; j < d; ++j) {
      weights<T>(p, w, j, prob);
      const T g = static_cast<T>(element(grad_out, p.config.dtype, row * d + j));
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

std::int64_t width_of(const HostProblem& p) {
  return static_cast<std::int64_t>(p.config.coff) * p.config.head_dim;
}

}  // namespace

void forward_fp32(const HostProblem& problem, void* out) {
  forward_impl<float>(
      problem, [&](std::int64_t i, float v) { store_element(out, problem.config.dtype, i, v); });
}

void forward_fp64(const HostProblem& problem, double* out) {
  forward_impl<double>(problem, [&](std::int64_t i, double v) { out[i] = v; });
}

void backward_fp32(const HostProblem& problem, const void* grad_out, void* grad_kv,
                   void* grad_score, float* grad_ape, bool accumulate) {
  const std::int64_t n = problem.total_tokens * width_of(problem);
  const DType dtype = problem.config.dtype;
  for (std::int64_t i = 0; i < n; ++i) {
    store_element(grad_kv, dtype, i, 0.0f);
    store_element(grad_score, dtype, i, 0.0f);
  }
  // Row-ascending sums per APE element, kept apart so `accumulate` adds one total.
  std::vector<float> ape(static_cast<std::size_t>(problem.config.ratio * width_of(problem)), 0.0f);
  backward_impl<float>(problem, grad_out, [&](const Slot& sl, float ds, float gkv) {
    store_element(grad_kv, dtype, sl.offset, gkv);
    store_element(grad_score, dtype, sl.offset, ds);
    ape[sl.ape] += ds;
  });
  for (std::size_t i = 0; i < ape.size(); ++i)
    grad_ape[i] = accumulate ? grad_ape[i] + ape[i] : ape[i];
}

void backward_fp64(const HostProblem& problem, const void* grad_out, double* grad_kv,
                   double* grad_score, double* grad_ape) {
  const std::int64_t n = problem.total_tokens * width_of(problem);
  std::fill(grad_kv, grad_kv + n, 0.0);
  std::fill(grad_score, grad_score + n, 0.0);
  std::fill(grad_ape, grad_ape + problem.config.ratio * width_of(problem), 0.0);
  backward_impl<double>(problem, grad_out, [&](const Slot& sl, double ds, double gkv) {
    grad_kv[sl.offset] = gkv;
    grad_score[sl.offset] = ds;
    grad_ape[sl.ape] += ds;
  });
}

}  // namespace csa::reference
