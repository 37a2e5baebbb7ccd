// The CPU references of the pooling's tail (RMSNorm, RoPE, Hadamard): hand-computed tiny rows
// for each stage alone and all three, the block positions (THD segments, padding rows, SBHD
// columns), the backward against central differences of the fp64 forward, the fp32 reference
// against the fp64 oracle, and every rule on the tail's arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "csa/reference.hpp"
#include "test_util.hpp"

namespace csa::test {
namespace {

// An fp32 THD (or SBHD) problem with its own storage: ratio 1, coff 1 pools each token's row
// as it is (one slot, weight 1), so a tail's output is the tail of kv's rows.
struct Fp32Problem {
  Config config;
  std::vector<std::int32_t> cu, cuc;
  std::vector<float> kv, score, ape;
  std::int64_t total_tokens = 0, total_comp = 0;
  std::int64_t seq_len = 0;

  reference::HostProblem host() const {
    reference::HostProblem h;
    h.kv = kv.data();
    h.score = score.data();
    h.ape = ape.data();
    const bool sbhd = config.layout == Layout::kSbhd;
    h.cu_seqlens = sbhd ? nullptr : cu.data();
    h.cu_seqlens_comp = sbhd ? nullptr : cuc.data();
    h.total_tokens = total_tokens;
    h.num_segments = static_cast<std::int32_t>(cu.size()) - 1;
    h.total_comp = total_comp;
    h.config = config;
    h.seq_len = seq_len;
    return h;
  }
};

Fp32Problem random_problem(const Config& c, const std::vector<std::int32_t>& lens,
                           std::int64_t extra_rows, std::uint64_t seed) {
  Fp32Problem p;
  p.config = c;
  p.config.dtype = DType::kF32;
  p.cu = {0};
  p.cuc = {0};
  for (auto len : lens) {
    p.cu.push_back(p.cu.back() + len);
    p.cuc.push_back(p.cuc.back() + len / c.ratio);
  }
  p.total_tokens = p.cu.back();
  p.total_comp = p.cuc.back() + extra_rows;
  if (c.layout == Layout::kSbhd) p.seq_len = lens.front();
  const std::int64_t w = static_cast<std::int64_t>(c.coff) * c.head_dim;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < p.total_tokens * w; ++i) {
    p.kv.push_back(normal(rng));
    p.score.push_back(1.5f * normal(rng));
  }
  for (std::int64_t i = 0; i < c.ratio * w; ++i) p.ape.push_back(0.25f * normal(rng));
  return p;
}

// One segment of `rows` tokens at ratio 1, coff 1, with the given kv rows.
Fp32Problem rows_problem(int head_dim, const std::vector<std::vector<float>>& rows) {
  Fp32Problem p = random_problem({1, head_dim, 1}, {static_cast<std::int32_t>(rows.size())}, 0, 1);
  p.kv.clear();
  for (const auto& r : rows) p.kv.insert(p.kv.end(), r.begin(), r.end());
  return p;
}

std::vector<float> forward(const Fp32Problem& p, const Tail& t) {
  std::vector<float> y(static_cast<std::size_t>(p.total_comp * p.config.head_dim));
  reference::tail_forward_fp32(p.host(), t, y.data());
  return y;
}

struct RopeTables {
  std::vector<float> cos, sin;
  void attach(TailShape& shape, Tail& t, int rope_dim) const {
    shape.rope_dim = rope_dim;
    t.rope_cos = cos.data();
    t.rope_sin = sin.data();
    t.rope_max_blocks = static_cast<std::int64_t>(cos.size()) / (rope_dim / 2);
  }
};

// Row `block` of the tables: angle (block + 1) * (i + 1) * 0.3 for pair i.
RopeTables tables(std::int64_t blocks, int rope_dim) {
  RopeTables r;
  for (std::int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < rope_dim / 2; ++i) {
      const double angle = 0.3 * static_cast<double>((b + 1) * (i + 1));
      r.cos.push_back(static_cast<float>(std::cos(angle)));
      r.sin.push_back(static_cast<float>(std::sin(angle)));
    }
  }
  return r;
}

void expect_near_all(const std::vector<float>& got, const std::vector<double>& want, double tol,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::fabs(want[i])))
        << what << " [" << i << "]";
}

TEST(ReferenceTail, AllStagesOffIsThePooling) {
  const std::uint64_t seed = base_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto p = random_problem({4, 64, 2}, {13, 8, 3}, 2, seed);
  std::vector<float> plain(static_cast<std::size_t>(p.total_comp * 64));
  reference::forward_fp32(p.host(), plain.data());
  EXPECT_EQ(forward(p, Tail{}), plain);
}

TEST(ReferenceTail, NormAloneScalesEachRowByItsRmsAndTheWeight) {
  auto p = rows_problem(4, {{1, 2, 3, 4}, {-2, 0, 0, 2}});
  const std::vector<float> w = {1.0f, 0.5f, 2.0f, -1.0f};
  Tail t;
  p.config.tail.norm = true;
  t.norm_weight = w.data();
  t.eps = 1e-6f;
  std::vector<float> rstd(2);
  std::vector<float> y(8);
  reference::tail_forward_fp32(p.host(), t, y.data(), rstd.data());
  const double r0 = 1.0 / std::sqrt(30.0 / 4 + 1e-6);
  const double r1 = 1.0 / std::sqrt(8.0 / 4 + 1e-6);
  expect_near_all(rstd, {r0, r1}, 1e-6, "rstd");
  expect_near_all(y, {1 * r0, 2 * r0 * 0.5, 3 * r0 * 2, -4 * r0, -2 * r1, 0, 0, -2 * r1}, 1e-6,
                  "y");
  // A bf16 weight gives the same (its values are exact in bf16).
  std::vector<std::uint16_t> w16(w.size());
  for (std::size_t j = 0; j < w.size(); ++j) w16[j] = reference::float_to_bf16(w[j]);
  t.norm_weight = w16.data();
  p.config.tail.norm_weight_dtype = DType::kBf16;
  EXPECT_EQ(forward(p, t), y);
}

TEST(ReferenceTail, RopeRotatesPairsOfTheLastColumnsAtEachRowsBlock) {
  // Three rows of one segment at ratio 1: blocks 0, 1, 2.
  const std::vector<std::vector<float>> rows = {
      {5, 1, 2, 3, 4, 6}, {5, 1, 2, 3, 4, 6}, {5, 1, 2, 3, 4, 6}};
  auto p = rows_problem(6, rows);
  const RopeTables tab = tables(3, 4);
  for (bool interleaved : {true, false}) {
    Tail t;
    tab.attach(p.config.tail, t, 4);  // columns 2..5 rotate; 0 and 1 stay
    p.config.tail.rope_interleaved = interleaved;
    const auto y = forward(p, t);
    std::vector<double> want;
    for (std::size_t b = 0; b < 3; ++b) {
      std::vector<double> r(rows[b].begin(), rows[b].end());
      for (std::size_t i = 0; i < 2; ++i) {
        const std::size_t a = interleaved ? 2 + 2 * i : 2 + i;
        const std::size_t c = interleaved ? 3 + 2 * i : 4 + i;
        const double cs = tab.cos[b * 2 + i];
        const double sn = tab.sin[b * 2 + i];
        const double x = r[a], z = r[c];
        r[a] = x * cs - z * sn;
        r[c] = x * sn + z * cs;
      }
      want.insert(want.end(), r.begin(), r.end());
    }
    expect_near_all(y, want, 1e-6, interleaved ? "interleaved" : "half-split");
    for (int b = 0; b < 3; ++b) {  // the first columns are untouched, bit for bit
      EXPECT_EQ(y[static_cast<std::size_t>(6 * b)], 5.0f);
      EXPECT_EQ(y[static_cast<std::size_t>(6 * b + 1)], 1.0f);
    }
  }
}

TEST(ReferenceTail, HadamardIsTheScaledSylvesterTransform) {
  auto p = rows_problem(4, {{1, 2, 3, 4}});
  p.config.tail.hadamard = true;
  const Tail t;
  // H4 / 2 applied to (1, 2, 3, 4).
  expect_near_all(forward(p, t), {5, -1, -2, 0}, 1e-7, "H4");
  // Applied twice, the transform is the identity (it is its own inverse).
  auto q = rows_problem(8, {{0.5f, -1, 2, 0.25f, 3, -4, 1, 7}});
  q.config.tail.hadamard = true;
  const auto once = forward(q, t);
  auto again = rows_problem(8, {once});
  again.config.tail.hadamard = true;
  const auto twice = forward(again, t);
  expect_near_all(twice, {0.5, -1, 2, 0.25, 3, -4, 1, 7}, 1e-6, "H8 twice");
}

// The chain written out directly in fp64: norm, then rotation, then the Hadamard matrix.
std::vector<double> chain(const std::vector<double>& x, const std::vector<float>& w, double eps,
                          const RopeTables& tab, std::int64_t block, int rope_dim) {
  const auto d = static_cast<int>(x.size());
  double ss = 0;
  for (double v : x) ss += v * v;
  const double r = 1.0 / std::sqrt(ss / d + eps);
  std::vector<double> n(x.size());
  for (int j = 0; j < d; ++j) n[j] = x[j] * r * w[j];
  for (int i = 0; i < rope_dim / 2; ++i) {
    const int a = d - rope_dim + 2 * i;
    const double c = tab.cos[static_cast<std::size_t>(block * (rope_dim / 2) + i)];
    const double s = tab.sin[static_cast<std::size_t>(block * (rope_dim / 2) + i)];
    const double u = n[a], v = n[a + 1];
    n[a] = u * c - v * s;
    n[a + 1] = u * s + v * c;
  }
  std::vector<double> y(x.size(), 0.0);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) y[i] += (__builtin_popcount(i & j) % 2 ? -1.0 : 1.0) * n[j];
  for (auto& v : y) v /= std::sqrt(static_cast<double>(d));
  return y;
}

TEST(ReferenceTail, AllThreeStagesMatchTheChainWrittenOutAndPaddingRowsSitAtBlockZero) {
  const std::uint64_t seed = base_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // ratio 2, coff 2, head_dim 16: two segments and two padding rows.
  const Config c{2, 16, 2};
  auto p = random_problem(c, {9, 6}, 2, seed);
  std::vector<float> w(16);
  for (int j = 0; j < 16; ++j) w[j] = 0.5f + 0.125f * static_cast<float>(j);
  const RopeTables tab = tables(4, 8);
  Tail t;
  p.config.tail.norm = true;
  t.norm_weight = w.data();
  t.eps = 1e-5f;
  tab.attach(p.config.tail, t, 8);
  p.config.tail.hadamard = true;
  std::vector<double> y64(static_cast<std::size_t>(p.total_comp * 16));
  reference::tail_forward_fp64(p.host(), t, y64.data());
  std::vector<double> pooled(y64.size());
  Fp32Problem plain = p;
  plain.config.tail = TailShape{};
  reference::forward_fp64(plain.host(), pooled.data());
  // Rows: segment 0 blocks 0..3, segment 1 blocks 0..2, padding rows (block 0).
  const std::vector<std::int64_t> blocks = {0, 1, 2, 3, 0, 1, 2, 0, 0};
  ASSERT_EQ(static_cast<std::size_t>(p.total_comp), blocks.size());
  for (std::size_t row = 0; row < blocks.size(); ++row) {
    const std::vector<double> x(pooled.begin() + static_cast<std::ptrdiff_t>(row * 16),
                                pooled.begin() + static_cast<std::ptrdiff_t>(row * 16 + 16));
    const auto want = chain(x, w, 1e-5, tab, blocks[row], 8);
    for (int j = 0; j < 16; ++j)
      EXPECT_NEAR(y64[row * 16 + static_cast<std::size_t>(j)], want[static_cast<std::size_t>(j)],
                  1e-6)
          << "row " << row << " col " << j;
  }
  // The fp32 reference is the same chain with fp32 intermediates.
  expect_near_all(forward(p, t), y64, 2e-5, "fp32 against fp64");
}

TEST(ReferenceTail, SbhdRowsTakeTheirColumnsBlocks) {
  const std::uint64_t seed = base_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Config c{4, 8, 2};
  auto thd = random_problem(c, {12, 12}, 0, seed);  // segments 0, 1: blocks 0..2 each
  c.layout = Layout::kSbhd;
  Fp32Problem sbhd = thd;
  sbhd.config.layout = Layout::kSbhd;
  sbhd.seq_len = 12;
  // Token t of column b is row t * 2 + b.
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t tk = 0; tk < 12; ++tk)
      for (int e = 0; e < 16; ++e) {
        sbhd.kv[static_cast<std::size_t>((tk * 2 + b) * 16 + e)] =
            thd.kv[static_cast<std::size_t>((b * 12 + tk) * 16 + e)];
        sbhd.score[static_cast<std::size_t>((tk * 2 + b) * 16 + e)] =
            thd.score[static_cast<std::size_t>((b * 12 + tk) * 16 + e)];
      }
  const RopeTables tab = tables(3, 8);
  Tail t;
  tab.attach(thd.config.tail, t, 8);
  sbhd.config.tail = thd.config.tail;
  const auto a = forward(thd, t);
  const auto s = forward(sbhd, t);
  // SBHD row i * 2 + b is THD row b * 3 + i.
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 8; ++j)
        EXPECT_EQ(s[static_cast<std::size_t>((i * 2 + b) * 8 + j)],
                  a[static_cast<std::size_t>((b * 3 + i) * 8 + j)]);
}

// The fp64 backward against central differences of L = Σ grad_y · y (fp64 forward).
TEST(ReferenceTail, BackwardIsTheGradientOfTheForward) {
  const std::uint64_t seed = base_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Config c{2, 8, 2};
  auto p = random_problem(c, {7, 4}, 1, seed);
  std::vector<float> w = {1.5f, 0.5f, -1.0f, 2.0f, 0.75f, 1.25f, -0.5f, 1.0f};
  const RopeTables tab = tables(3, 4);
  Tail t;
  p.config.tail.norm = true;
  t.norm_weight = w.data();
  t.eps = 1e-3f;
  tab.attach(p.config.tail, t, 4);
  p.config.tail.hadamard = true;
  const std::size_t out_n = static_cast<std::size_t>(p.total_comp * 8);
  std::vector<float> gy(out_n);
  std::mt19937_64 rng(seed + 7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : gy) v = normal(rng);
  const std::size_t tok_n = p.kv.size();
  std::vector<double> gkv(tok_n), gs(tok_n), gape(p.ape.size()), gw(8);
  reference::tail_backward_fp64(p.host(), t, gy.data(), gkv.data(), gs.data(), gape.data(),
                                gw.data());
  // Padding rows (the last one) carry no gradient.
  const std::int64_t valid = p.cuc.back();
  auto loss = [&] {
    std::vector<double> y(out_n);
    reference::tail_forward_fp64(p.host(), t, y.data());
    double l = 0;
    for (std::size_t i = 0; i < static_cast<std::size_t>(valid * 8); ++i) l += gy[i] * y[i];
    return l;
  };
  const float h = 0x1p-10f;
  // The perturbed values as stored (x ± h rounds in fp32): the difference of those.
  auto numeric = [&](float& x) {
    const float keep = x;
    const float hi = keep + h;
    const float lo = keep - h;
    x = hi;
    const double up = loss();
    x = lo;
    const double down = loss();
    x = keep;
    return (up - down) / (static_cast<double>(hi) - static_cast<double>(lo));
  };
  for (std::size_t i = 0; i < tok_n; i += 3) {
    EXPECT_NEAR(gkv[i], numeric(p.kv[i]), 1e-4 * std::max(1.0, std::fabs(gkv[i]))) << "kv " << i;
    EXPECT_NEAR(gs[i], numeric(p.score[i]), 1e-4 * std::max(1.0, std::fabs(gs[i])))
        << "score " << i;
  }
  for (std::size_t i = 0; i < p.ape.size(); ++i)
    EXPECT_NEAR(gape[i], numeric(p.ape[i]), 1e-4 * std::max(1.0, std::fabs(gape[i])))
        << "ape " << i;
  for (std::size_t j = 0; j < w.size(); ++j)
    EXPECT_NEAR(gw[j], numeric(w[j]), 1e-4 * std::max(1.0, std::fabs(gw[j]))) << "w " << j;

  // The fp32 reference: the same gradients with fp32 intermediates; grad_w accumulates.
  std::vector<float> gkv32(tok_n), gs32(tok_n), gape32(p.ape.size()), gw32(8, 0.0f);
  reference::tail_backward_fp32(p.host(), t, gy.data(), gkv32.data(), gs32.data(), gape32.data(),
                                gw32.data());
  expect_near_all(gkv32, gkv, 1e-4, "grad_kv");
  expect_near_all(gs32, gs, 1e-4, "grad_score");
  expect_near_all(gape32, gape, 1e-4, "grad_ape");
  expect_near_all(gw32, gw, 1e-4, "grad_w");
  const auto once = gw32;
  reference::tail_backward_fp32(p.host(), t, gy.data(), gkv32.data(), gs32.data(), gape32.data(),
                                gw32.data(), /*accumulate=*/true);
  for (std::size_t j = 0; j < 8; ++j) EXPECT_EQ(gw32[j], once[j] + once[j]);
}

TEST(ReferenceTail, EveryBadTailArgumentIsRejectedNamingIt) {
  const auto base = rows_problem(6, {{1, 2, 3, 4, 5, 6}, {1, 2, 3, 4, 5, 6}});
  const std::vector<float> w(6, 1.0f);
  const RopeTables tab = tables(2, 4);
  std::vector<float> y(12), rstd(2);
  auto rejects = [&](const TailShape& shape, const Tail& t, const std::string& name,
                     float* r = nullptr) {
    Fp32Problem p = base;
    p.config.tail = shape;
    try {
      reference::tail_forward_fp32(p.host(), t, y.data(), r);
      ADD_FAILURE() << "accepted; expected a rejection naming " << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Status::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  TailShape norm_shape;
  norm_shape.norm = true;
  Tail norm;
  norm.norm_weight = w.data();
  TailShape s = norm_shape;
  s.norm_weight_dtype = DType::kF16;
  rejects(s, norm, "config.tail.norm_weight_dtype");
  rejects(norm_shape, Tail{}, "tail.norm_weight is null");
  rejects(TailShape{}, norm, "tail.norm_weight is set");
  for (float eps : {0.0f, -1.0f, std::nanf(""), INFINITY}) {
    Tail t = norm;
    t.eps = eps;
    rejects(norm_shape, t, "tail.eps");
  }
  Tail rope;
  TailShape rope_shape;
  tab.attach(rope_shape, rope, 4);
  for (int rope_dim : {3, -2, 8}) {
    s = rope_shape;
    s.rope_dim = rope_dim;
    rejects(s, rope, "config.tail.rope_dim");
  }
  Tail t = rope;
  t.rope_sin = nullptr;
  rejects(rope_shape, t, "tail.rope_sin");
  t = rope;
  t.rope_max_blocks = 0;
  rejects(rope_shape, t, "tail.rope_max_blocks");
  t = rope;
  t.rope_max_blocks = 1;  // row 1 is block 1: no table row for it
  rejects(rope_shape, t, "tail.rope_max_blocks");
  rejects(TailShape{}, rope, "rope_dim is 0");  // tables without rope_dim
  s = TailShape{};
  s.hadamard = true;  // head_dim 6
  rejects(s, Tail{}, "config.tail.hadamard");
  rejects(TailShape{}, Tail{}, "rstd", rstd.data());  // rstd without the norm
  // grad_w must be given exactly when the norm is.
  std::vector<float> g(12, 1.0f), gkv(12), gs(12), gape(6), gw(6);
  Fp32Problem p = base;
  p.config.tail = norm_shape;
  EXPECT_THROW(reference::tail_backward_fp32(p.host(), norm, g.data(), gkv.data(), gs.data(),
                                             gape.data(), nullptr),
               Error);
  EXPECT_NO_THROW(reference::tail_backward_fp32(p.host(), norm, g.data(), gkv.data(), gs.data(),
                                                gape.data(), gw.data()));
  EXPECT_THROW(reference::tail_backward_fp32(base.host(), Tail{}, g.data(), gkv.data(), gs.data(),
                                             gape.data(), gw.data()),
               Error);
}

}  // namespace
}  // namespace csa::test
