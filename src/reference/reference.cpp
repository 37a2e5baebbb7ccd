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

namespace {

// The window of one output row (SPEC §1), for valid offsets.
struct Window {
  std::int64_t t0 = 0;
  bool first = true;
};

std::int64_t valid_rows(const HostProblem& p) {
  if (p.num_segments <= 0) return 0;
  return std::min<std::int64_t>(p.cu_seqlens_comp[p.num_segments], p.total_comp);
}

Window window_of(const HostProblem& p, std::int64_t row) {
  Window w;
  if (row >= valid_rows(p)) return w;  // padding row: block 0 from token 0
  for (int s = 0; s < p.num_segments; ++s) {
    if (p.cu_seqlens_comp[s] <= row && row < p.cu_seqlens_comp[s + 1]) {
      const std::int64_t block = row - p.cu_seqlens_comp[s];
      w.t0 = p.cu_seqlens[s] + block * p.config.ratio;
      w.first = block == 0;
    }
  }
  return w;
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
  if (p.config.coff == 1)
    return {true, (w.t0 + k) * width + j, static_cast<std::int64_t>(k) * width + j};
  if (k < r)
    return {!w.first, (w.t0 - r + k) * width + j, static_cast<std::int64_t>(k) * width + j};
  return {true, (w.t0 + k - r) * width + d + j, static_cast<std::int64_t>(k - r) * width + d + j};
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
    s[k] = sl.valid
               ? static_cast<T>(bf16_to_float(p.score[sl.offset])) + static_cast<T>(p.ape[sl.ape])
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
  return sl.valid ? static_cast<T>(bf16_to_float(p.kv[sl.offset])) : T(0);
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
void backward_impl(const HostProblem& p, const std::uint16_t* grad_out, Emit emit) {
  const int d = p.config.head_dim;
  const int slots = p.config.coff * p.config.ratio;
  std::vector<T> prob;
  const std::int64_t rows = valid_rows(p);
  for (std::int64_t row = 0; row < rows; ++row) {
    const Window w = window_of(p, row);
    for (int j = 0; j < d; ++j) {
      weights<T>(p, w, j, prob);
      const T g = static_cast<T>(bf16_to_float(grad_out[row * d + j]));
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

void forward_fp32(const HostProblem& problem, std::uint16_t* out) {
  forward_impl<float>(problem, [&](std::int64_t i, float v) { out[i] = float_to_bf16(v); });
}

void forward_fp64(const HostProblem& problem, double* out) {
  forward_impl<double>(problem, [&](std::int64_t i, double v) { out[i] = v; });
}

void backward_fp32(const HostProblem& problem, const std::uint16_t* grad_out,
                   std::uint16_t* grad_kv, std::uint16_t* grad_score, float* grad_ape,
                   bool accumulate) {
  const std::int64_t n = problem.total_tokens * width_of(problem);
  std::fill(grad_kv, grad_kv + n, std::uint16_t{0});
  std::fill(grad_score, grad_score + n, std::uint16_t{0});
  // Row-ascending sums per APE element, kept apart so `accumulate` adds one total.
  std::vector<float> ape(static_cast<std::size_t>(problem.config.ratio * width_of(problem)), 0.0f);
  backward_impl<float>(problem, grad_out, [&](const Slot& sl, float ds, float gkv) {
    grad_kv[sl.offset] = float_to_bf16(gkv);
    grad_score[sl.offset] = float_to_bf16(ds);
    ape[sl.ape] += ds;
  });
  for (std::size_t i = 0; i < ape.size(); ++i)
    grad_ape[i] = accumulate ? grad_ape[i] + ape[i] : ape[i];
}

void backward_fp64(const HostProblem& problem, const std::uint16_t* grad_out, double* grad_kv,
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
