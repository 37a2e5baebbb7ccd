// CPU references of the pooling followed by its tail (RMSNorm, RoPE, Hadamard), forward and
// backward, each stage in T = float (the reference) or double (the oracle) in the order the
// user guide writes down. NOTE: compiled with -ffp-contract=off, as reference.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/error.hpp"
#include "compressor/validation.hpp"
#include "csa/reference.hpp"
#include "reference/pooling.hpp"

namespace csa::reference {

using namespace detail;

namespace {

// grad_w is given exactly when the norm is.
void check_grad_w(const HostProblem& p, const void* grad_w) {
  if ((grad_w != nullptr) != p.config.tail.norm) {
    fail(Status::kInvalidArgument, "grad_w is {} but config.tail.norm is {}",
         grad_w != nullptr ? "set" : "null", p.config.tail.norm ? "true" : "false");
  }
}

void check(const HostProblem& p, const Tail& t) {
  compressor::validate_config(p.config);
  compressor::validate_tail(p.config, t);
  if (!p.config.tail.rope()) return;
  for (std::int64_t row = 0; row < p.total_comp; ++row) {
    const std::int64_t block = block_of(p, row);
    if (block >= t.rope_max_blocks) {
      fail(Status::kInvalidArgument,
           "tail.rope_max_blocks is {}, but output row {} is block {} of its segment",
           t.rope_max_blocks, row, block);
    }
  }
}

template <typename T>
T weight(const HostProblem& p, const Tail& t, int j) {
  return static_cast<T>(element(t.norm_weight, p.config.tail.norm_weight_dtype, j));
}

// The two columns of RoPE pair i.
struct Pair {
  int a, b;
};
Pair pair_of(const Config& c, int i) {
  const TailShape& t = c.tail;
  const int first = c.head_dim - t.rope_dim;
  return t.rope_interleaved ? Pair{first + 2 * i, first + 2 * i + 1}
                            : Pair{first + i, first + i + t.rope_dim / 2};
}

// Calls f(a, b, cos, sin) for every RoPE pair of row `row`: its columns and its table entries.
template <typename T, typename F>
void for_each_pair(const HostProblem& p, const Tail& t, std::int64_t row, F f) {
  const int half = p.config.tail.rope_dim / 2;
  const std::int64_t base = block_of(p, row) * half;
  for (int i = 0; i < half; ++i) {
    const Pair q = pair_of(p.config, i);
    f(q.a, q.b, static_cast<T>(t.rope_cos[base + i]), static_cast<T>(t.rope_sin[base + i]));
  }
}

// (mean(x²) + eps)^-1/2 of one row, the sum serial in column order.
template <typename T>
T rstd_of(const std::vector<T>& x, const Tail& t) {
  T sum = 0;
  for (const T v : x) sum += v * v;
  return T(1) / std::sqrt(sum / static_cast<T>(x.size()) + static_cast<T>(t.eps));
}

// The Hadamard transform in place: log2(d) butterfly stages (h = 1, 2, 4, ...; (a + b, a - b)),
// then one product by d^-1/2.
template <typename T>
void hadamard(std::vector<T>& v) {
  const auto d = v.size();
  for (std::size_t h = 1; h < d; h *= 2) {
    for (std::size_t i = 0; i < d; i += 2 * h) {
      for (std::size_t j = i; j < i + h; ++j) {
        const T a = v[j];
        const T b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  for (auto& x : v) x = x * scale;
}

// One row's forward from its pooled values x: returns rstd (1 without the norm), leaves y.
template <typename T>
T tail_row(const HostProblem& p, const Tail& t, std::int64_t row, const std::vector<T>& x,
           std::vector<T>& y) {
  const int d = p.config.head_dim;
  y = x;
  T rstd = 1;
  if (p.config.tail.norm) {
    rstd = rstd_of(x, t);
    for (int j = 0; j < d; ++j) y[j] = (x[j] * rstd) * weight<T>(p, t, j);
  }
  if (p.config.tail.rope()) {
    for_each_pair<T>(p, t, row, [&](int ia, int ib, T c, T s) {
      const T a = y[ia];
      const T b = y[ib];
      y[ia] = a * c - b * s;
      y[ib] = a * s + b * c;
    });
  }
  if (p.config.tail.hadamard) hadamard(y);
  return rstd;
}

// One row's gradient of the pooled values from gy (overwritten): the Hadamard (its own
// transpose), the rotation's transpose, then the norm's backward, adding gn · x · rstd into gw.
template <typename T>
void tail_row_backward(const HostProblem& p, const Tail& t, std::int64_t row,
                       const std::vector<T>& x, std::vector<T>& g, std::vector<T>& gw) {
  const int d = p.config.head_dim;
  if (p.config.tail.hadamard) hadamard(g);
  if (p.config.tail.rope()) {
    for_each_pair<T>(p, t, row, [&](int ia, int ib, T c, T s) {
      const T ga = g[ia];
      const T gb = g[ib];
      g[ia] = ga * c + gb * s;
      g[ib] = gb * c - ga * s;
    });
  }
  if (!p.config.tail.norm) return;
  const T rstd = rstd_of(x, t);
  // gx_j = rstd · w_j·gn_j − x_j · rstd³ · (Σ_k w_k·gn_k·x_k) / d
  T dot = 0;
  for (int j = 0; j < d; ++j) dot += (weight<T>(p, t, j) * g[j]) * x[j];
  const T coef = ((rstd * rstd) * rstd) * dot / static_cast<T>(d);
  for (int j = 0; j < d; ++j) {
    gw[j] += g[j] * (x[j] * rstd);
    g[j] = rstd * (weight<T>(p, t, j) * g[j]) - coef * x[j];
  }
}

// The pooled rows' gradients (valid rows only; the rest are never read) and grad_w.
template <typename T>
std::vector<T> pooled_gradients(const HostProblem& p, const Tail& t, const void* grad_y,
                                std::vector<T>& gw) {
  const int d = p.config.head_dim;
  gw.assign(static_cast<std::size_t>(d), T(0));
  const std::int64_t rows = valid_rows(p);
  std::vector<T> gx(static_cast<std::size_t>(rows * d));
  std::vector<T> x, g(static_cast<std::size_t>(d));
  for (std::int64_t row = 0; row < rows; ++row) {
    pooled_row<T>(p, row, x);
    for (int j = 0; j < d; ++j) g[j] = static_cast<T>(element(grad_y, p.config.dtype, row * d + j));
    tail_row_backward<T>(p, t, row, x, g, gw);
    std::copy(g.begin(), g.end(), gx.begin() + row * d);
  }
  return gx;
}

}  // namespace

void tail_forward_fp32(const HostProblem& problem, const Tail& tail, void* y, float* rstd) {
  check(problem, tail);
  if (rstd != nullptr && !problem.config.tail.norm)
    fail(Status::kInvalidArgument, "rstd is asked for without a norm (config.tail.norm is false)");
  const int d = problem.config.head_dim;
  std::vector<float> x, out;
  for (std::int64_t row = 0; row < problem.total_comp; ++row) {
    pooled_row<float>(problem, row, x);
    const float r = tail_row<float>(problem, tail, row, x, out);
    if (rstd != nullptr) rstd[row] = r;
    for (int j = 0; j < d; ++j) store_element(y, problem.config.dtype, row * d + j, out[j]);
  }
}

void pooled_fp32(const HostProblem& problem, float* pooled) {
  const int d = problem.config.head_dim;
  std::vector<float> x;
  for (std::int64_t row = 0; row < problem.total_comp; ++row) {
    pooled_row<float>(problem, row, x);
    std::copy(x.begin(), x.end(), pooled + row * d);
  }
}

void tail_rows_fp32(const HostProblem& problem, const Tail& tail, const float* pooled, void* y,
                    float* rstd) {
  check(problem, tail);
  if (rstd != nullptr && !problem.config.tail.norm)
    fail(Status::kInvalidArgument, "rstd is asked for without a norm (config.tail.norm is false)");
  const int d = problem.config.head_dim;
  std::vector<float> x(static_cast<std::size_t>(d)), out;
  for (std::int64_t row = 0; row < problem.total_comp; ++row) {
    std::copy(pooled + row * d, pooled + (row + 1) * d, x.begin());
    const float r = tail_row<float>(problem, tail, row, x, out);
    if (rstd != nullptr) rstd[row] = r;
    for (int j = 0; j < d; ++j) store_element(y, problem.config.dtype, row * d + j, out[j]);
  }
}

void tail_forward_fp64(const HostProblem& problem, const Tail& tail, double* y) {
  check(problem, tail);
  const int d = problem.config.head_dim;
  std::vector<double> x, out;
  for (std::int64_t row = 0; row < problem.total_comp; ++row) {
    pooled_row<double>(problem, row, x);
    tail_row<double>(problem, tail, row, x, out);
    std::copy(out.begin(), out.end(), y + row * d);
  }
}

void tail_backward_fp32(const HostProblem& problem, const Tail& tail, const void* grad_y,
                        void* grad_kv, void* grad_score, float* grad_ape, float* grad_w,
                        bool accumulate) {
  check(problem, tail);
  check_grad_w(problem, grad_w);
  const int d = problem.config.head_dim;
  std::vector<float> gw;
  const std::vector<float> gx = pooled_gradients<float>(problem, tail, grad_y, gw);
  const DType dtype = problem.config.dtype;
  const std::int64_t n = problem.total_tokens * width_of(problem);
  for (std::int64_t i = 0; i < n; ++i) {
    store_element(grad_kv, dtype, i, 0.0f);
    store_element(grad_score, dtype, i, 0.0f);
  }
  std::vector<float> ape(static_cast<std::size_t>(problem.config.ratio * width_of(problem)), 0.0f);
  backward_rows<float>(
      problem, [&](std::int64_t row, int j) { return gx[static_cast<std::size_t>(row * d + j)]; },
      [&](const Slot& sl, float ds, float gkv) {
        store_element(grad_kv, dtype, sl.offset, gkv);
        store_element(grad_score, dtype, sl.offset, ds);
        ape[sl.ape] += ds;
      });
  for (std::size_t i = 0; i < ape.size(); ++i)
    grad_ape[i] = accumulate ? grad_ape[i] + ape[i] : ape[i];
  if (grad_w != nullptr) {
    for (int j = 0; j < d; ++j) grad_w[j] = accumulate ? grad_w[j] + gw[j] : gw[j];
  }
}

void tail_backward_fp64(const HostProblem& problem, const Tail& tail, const void* grad_y,
                        double* grad_kv, double* grad_score, double* grad_ape, double* grad_w) {
  check(problem, tail);
  check_grad_w(problem, grad_w);
  const int d = problem.config.head_dim;
  std::vector<double> gw;
  const std::vector<double> gx = pooled_gradients<double>(problem, tail, grad_y, gw);
  const std::int64_t n = problem.total_tokens * width_of(problem);
  std::fill(grad_kv, grad_kv + n, 0.0);
  std::fill(grad_score, grad_score + n, 0.0);
  std::fill(grad_ape, grad_ape + problem.config.ratio * width_of(problem), 0.0);
  backward_rows<double>(
      problem, [&](std::int64_t row, int j) { return gx[static_cast<std::size_t>(row * d + j)]; },
      [&](const Slot& sl, double ds, double gkv) {
        grad_kv[sl.offset] = gkv;
        grad_score[sl.offset] = ds;
        grad_ape[sl.ape] += ds;
      });
  if (grad_w != nullptr) std::copy(gw.begin(), gw.end(), grad_w);
}

}  // namespace csa::reference
