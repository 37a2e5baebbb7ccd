// The layout and element-type seams on the GPU: for every (type, layout) x ratio {2, 4, 16, 128}
// x coff {1, 2} x head_dim {65, 128, 512}, SBHD and row-strided calls give exactly the bits of
// the THD-contiguous call on the same data laid out contiguously (grad_ape: SBHD sums its rows
// in another order, within 1e-3), every type is within its contract against the reference
// kernel of that type, never-consumed slots get exact zeros, the bytes between strided rows
// stay untouched, and runs repeat bitwise. Every output is NaN-poisoned (0xff bytes) first.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>

#include "gpu_fixture.hpp"
#include "contract.hpp"
#include "layout_data.hpp"

namespace csa::test {
namespace {

using tools::contract_failure;
using tools::diff;
using tools::element_size;
using tools::element_value;
using tools::encode;
using tools::gather;
using tools::spread;
using tools::to_sbhd;

struct IoCase {
  DType dtype;
  int ratio, coff, head_dim;
};

std::string name_of(const IoCase& c) {
  return fmt::format("{}_r{}_c{}_d{}", dtype_name(c.dtype), c.ratio, c.coff, c.head_dim);
}

std::vector<IoCase> all_cases() {
  std::vector<IoCase> out;
  for (DType t : {DType::kBf16, DType::kF16, DType::kF32})
    for (int r : {2, 4, 16, 128})
      for (int c : {1, 2})
        for (int d : {65, 128, 512}) out.push_back({t, r, c, d});
  return out;
}

// Every module the cases use, compiled in parallel once (NVRTC is thread-safe), so the
// cases time what they test.
void prewarm_all() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<Config> configs;
    for (const IoCase& c : all_cases()) {
      Config thd{c.ratio, c.head_dim, c.coff, c.dtype, Layout::kThd, true};
      Config sbhd = thd;
      sbhd.layout = Layout::kSbhd;
      configs.push_back(thd);
      configs.push_back(sbhd);
    }
    std::atomic<std::size_t> next{0};
    std::vector<std::thread> pool;
    // NOTE: an error escaping a worker would end the process; the first one is rethrown here,
    // after every worker stopped (a schedule override a case's shape cannot take, say).
    std::mutex mutex;
    std::exception_ptr error;
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < n; ++i) {
      pool.emplace_back([&] {
        try {
          device::make_current(0);
          for (std::size_t k; (k = next++) < configs.size();) {
            g_runtime->prewarm(configs[k], 0);
            if (configs[k].layout == Layout::kThd) {  // the reference family of the type
              Config reference = configs[k];
              reference.strided = false;
              g_runtime->prewarm(reference, 0, Family::kReference);
            }
          }
        } catch (...) {
          next = configs.size();
          const std::lock_guard<std::mutex> lock(mutex);
          if (!error) error = std::current_exception();
        }
      });
    }
    for (auto& t : pool) t.join();
    if (error) std::rethrow_exception(error);
  });
}

// A device buffer of `bytes`, poisoned with 0xff (NaN in every type).
device::Buffer poisoned(std::size_t bytes) {
  device::Buffer b(std::max<std::size_t>(bytes, 16));
  b.fill(0xff);
  return b;
}

std::vector<std::uint8_t> download(const device::Buffer& b, std::size_t bytes) {
  std::vector<std::uint8_t> h(bytes);
  b.download(h.data(), bytes);
  return h;
}

struct Outputs {
  std::vector<std::uint8_t> out, gkv, gs;
  std::vector<float> gape;
};

// One problem in one type: B columns of S tokens (S = 24 blocks plus a tail of ratio - 1).
struct IoProblem {
  IoCase c;
  Config config;
  std::int64_t seq = 0, batch = 3, rows = 0, width = 0;
  int bytes = 2;
  Problem p;  // THD view (segment-major), bf16 values
  std::vector<std::uint8_t> kv, score, grad_out;

  explicit IoProblem(const IoCase& cs, std::uint64_t seed) : c(cs) {
    config = {cs.ratio, cs.head_dim, cs.coff, cs.dtype, Layout::kThd, false};
    seq = static_cast<std::int64_t>(cs.ratio) * 24 + cs.ratio - 1;
    rows = seq / cs.ratio;
    width = static_cast<std::int64_t>(cs.coff) * cs.head_dim;
    bytes = element_size(cs.dtype);
    p = make_problem(config, std::vector<std::int32_t>(3, static_cast<std::int32_t>(seq)), 0, 0,
                     seed);
    kv = encode(p.kv, cs.dtype);
    score = encode(p.score, cs.dtype);
    grad_out = encode(p.grad_out, cs.dtype);
  }
  std::int64_t tokens() const { return seq * batch; }
  std::int64_t comp() const { return rows * batch; }

  // strides: {kv/score, out, grad_out, grad_kv/grad_score} in elements (0: dense).
  Outputs run(Layout layout, std::int64_t in_stride, std::int64_t out_stride,
              std::int64_t gout_stride, std::int64_t grad_stride, Family family,
              std::uint32_t flags, bool* gaps_untouched) const {
    const bool sb = layout == Layout::kSbhd;
    const std::int64_t T = tokens(), R = comp(), d = c.head_dim;
    const std::int64_t is = in_stride ? in_stride : width, os = out_stride ? out_stride : d;
    const std::int64_t gos = gout_stride ? gout_stride : d, gs = grad_stride ? grad_stride : width;
    auto lay = [&](const std::vector<std::uint8_t>& v, std::int64_t rows_per_col, std::int64_t w) {
      return sb ? to_sbhd(v, rows_per_col, batch, w, bytes) : v;
    };
    const auto kv_h = spread(lay(kv, seq, width), T, width, is, bytes);
    const auto score_h = spread(lay(score, seq, width), T, width, is, bytes);
    const auto gout_h = spread(lay(grad_out, rows, d), R, d, gos, bytes);
    device::Buffer kv_d(kv_h.size()), score_d(score_h.size()), gout_d(gout_h.size());
    kv_d.upload(kv_h.data(), kv_h.size());
    score_d.upload(score_h.data(), score_h.size());
    gout_d.upload(gout_h.data(), gout_h.size());
    device::Buffer ape_d(p.ape.size() * 4), cu_d(p.cu.size() * 4), cuc_d(p.cuc.size() * 4);
    ape_d.upload(p.ape.data(), ape_d.size());
    cu_d.upload(p.cu.data(), cu_d.size());
    cuc_d.upload(p.cuc.data(), cuc_d.size());
    const std::size_t out_bytes = static_cast<std::size_t>(R * os * bytes);
    const std::size_t grad_bytes = static_cast<std::size_t>(T * gs * bytes);
    device::Buffer out_d = poisoned(out_bytes), gkv_d = poisoned(grad_bytes),
                   gsc_d = poisoned(grad_bytes), gape_d = poisoned(p.ape.size() * 4);

    Config cfg = config;
    cfg.layout = layout;
    ForwardArgs f;
    f.kv = kv_d.get();
    f.score = score_d.get();
    f.ape = ape_d.as<float>();
    f.cu_seqlens = sb ? nullptr : cu_d.as<std::int32_t>();
    f.cu_seqlens_comp = sb ? nullptr : cuc_d.as<std::int32_t>();
    f.out = out_d.get();
    f.total_tokens = T;
    f.num_segments = static_cast<std::int32_t>(batch);
    f.total_comp = R;
    f.config = cfg;
    f.seq_len = sb ? seq : 0;
    f.kv_stride = f.score_stride = in_stride;
    f.out_stride = out_stride;
    g_runtime->forward(f, nullptr, family);
    BackwardArgs b;
    b.kv = f.kv;
    b.score = f.score;
    b.ape = f.ape;
    b.cu_seqlens = f.cu_seqlens;
    b.cu_seqlens_comp = f.cu_seqlens_comp;
    b.grad_out = gout_d.get();
    b.grad_kv = gkv_d.get();
    b.grad_score = gsc_d.get();
    b.grad_ape = gape_d.as<float>();
    b.total_tokens = T;
    b.num_segments = f.num_segments;
    b.total_comp = R;
    b.config = cfg;
    b.flags = flags;
    b.seq_len = f.seq_len;
    b.kv_stride = b.score_stride = in_stride;
    b.grad_out_stride = gout_stride;
    b.grad_kv_stride = b.grad_score_stride = grad_stride;
    g_runtime->backward(b, nullptr, family);
    device::synchronize(nullptr);

    bool g1 = true, g2 = true, g3 = true;
    Outputs o;
    o.out = gather(download(out_d, out_bytes), R, d, os, bytes, &g1);
    o.gkv = gather(download(gkv_d, grad_bytes), T, width, gs, bytes, &g2);
    o.gs = gather(download(gsc_d, grad_bytes), T, width, gs, bytes, &g3);
    o.gape.resize(p.ape.size());
    gape_d.download(o.gape.data(), o.gape.size() * 4);
    if (gaps_untouched != nullptr) *gaps_untouched = g1 && g2 && g3;
    if (sb) {  // back to the THD (segment-major) order
      o.out = tools::from_sbhd(o.out, rows, batch, d, bytes);
      o.gkv = tools::from_sbhd(o.gkv, seq, batch, width, bytes);
      o.gs = tools::from_sbhd(o.gs, seq, batch, width, bytes);
    }
    return o;
  }
};

class GpuIo : public Gpu, public ::testing::WithParamInterface<IoCase> {};

TEST_P(GpuIo, LayoutsMatchThdBitwiseAndTypesMeetTheirContract) {
  prewarm_all();
  const IoCase c = GetParam();
  const std::uint64_t seed = base_seed() + static_cast<std::uint64_t>(c.ratio * 131 + c.head_dim);
  SCOPED_TRACE(name_of(c) + " seed " + std::to_string(seed));
  const IoProblem q(c, seed);
  const std::int64_t align = std::min<std::int64_t>(16 / q.bytes, c.head_dim & -c.head_dim);

  // THD contiguous, deterministic grad_ape: the baseline.
  const Outputs thd = q.run(Layout::kThd, 0, 0, 0, 0, Family::kAuto, kDeterministic, nullptr);
  // Nothing left poisoned, and exact zeros on every never-consumed slot.
  {
    const auto mask = consumed_mask(q.p);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < mask.size(); ++i) {
      const double kv = element_value(thd.gkv, c.dtype, i), sc = element_value(thd.gs, c.dtype, i);
      if (std::isnan(kv) || std::isnan(sc)) ++bad;
      if (!mask[i] && (kv != 0.0 || sc != 0.0 || std::signbit(kv) || std::signbit(sc))) ++bad;
    }
    EXPECT_EQ(bad, 0u) << "unwritten or non-zero never-consumed gradient slots";
    EXPECT_EQ(diff(thd.out, thd.out, c.dtype).differing, 0u) << "out left poisoned (NaN)";
  }

  // SBHD: the same bits (grad_ape in another row order, within the 1e-3 contract).
  const Outputs sbhd = q.run(Layout::kSbhd, 0, 0, 0, 0, Family::kAuto, kDeterministic, nullptr);
  EXPECT_TRUE(sbhd.out == thd.out) << "SBHD out differs from THD";
  EXPECT_TRUE(sbhd.gkv == thd.gkv) << "SBHD grad_kv differs from THD";
  EXPECT_TRUE(sbhd.gs == thd.gs) << "SBHD grad_score differs from THD";
  for (std::size_t i = 0; i < thd.gape.size(); ++i)
    ASSERT_NEAR(sbhd.gape[i], thd.gape[i], 1e-3) << "grad_ape " << i;
  // Determinism, SBHD, default (atomic) grad_ape.
  const Outputs sbhd2 = q.run(Layout::kSbhd, 0, 0, 0, 0, Family::kAuto, 0, nullptr);
  const Outputs sbhd3 = q.run(Layout::kSbhd, 0, 0, 0, 0, Family::kAuto, 0, nullptr);
  EXPECT_TRUE(sbhd2.out == sbhd3.out && sbhd2.gkv == sbhd3.gkv && sbhd2.gs == sbhd3.gs)
      << "SBHD runs differ";

  // Row-strided THD: kv and score as halves of one (T, 2W) tensor, gradients likewise, out and
  // grad_out rows padded; bitwise equal, gaps untouched. (grad_ape: the strided kernel's
  // registers may size another grid, whose row groups sum in another order: within 1e-3.)
  bool gaps = false;
  const Outputs strided =
      q.run(Layout::kThd, 2 * q.width, c.head_dim + align, c.head_dim + 2 * align, 2 * q.width,
            Family::kAuto, kDeterministic, &gaps);
  EXPECT_TRUE(gaps) << "bytes between strided rows were written";
  EXPECT_TRUE(strided.out == thd.out) << "strided out differs";
  EXPECT_TRUE(strided.gkv == thd.gkv) << "strided grad_kv differs";
  EXPECT_TRUE(strided.gs == thd.gs) << "strided grad_score differs";
  for (std::size_t i = 0; i < thd.gape.size(); ++i)
    ASSERT_NEAR(strided.gape[i], thd.gape[i], 1e-3) << "strided grad_ape " << i;
  // SBHD with strided rows too.
  bool sgaps = false;
  const Outputs sbhd_strided = q.run(Layout::kSbhd, q.width + align, c.head_dim + align, 0,
                                     q.width + 2 * align, Family::kAuto, kDeterministic, &sgaps);
  EXPECT_TRUE(sgaps) << "bytes between strided SBHD rows were written";
  EXPECT_TRUE(sbhd_strided.out == thd.out && sbhd_strided.gkv == thd.gkv &&
              sbhd_strided.gs == thd.gs)
      << "strided SBHD differs from THD";

  // The type against the reference kernel of that type.
  const Outputs ref = q.run(Layout::kThd, 0, 0, 0, 0, Family::kReference, 0, nullptr);
  const bool bitwise = c.ratio <= 16;
  EXPECT_EQ(contract_failure(thd.out, ref.out, c.dtype, bitwise, "out"), "");
  EXPECT_EQ(contract_failure(thd.gkv, ref.gkv, c.dtype, bitwise, "grad_kv"), "");
  EXPECT_EQ(contract_failure(thd.gs, ref.gs, c.dtype, bitwise, "grad_score"), "");
  for (std::size_t i = 0; i < ref.gape.size(); ++i)
    ASSERT_NEAR(thd.gape[i], ref.gape[i], 1e-3 * std::max(1.0f, std::fabs(ref.gape[i])))
        << "grad_ape " << i;
}

INSTANTIATE_TEST_SUITE_P(TypesLayouts, GpuIo, ::testing::ValuesIn(all_cases()),
                         [](const auto& test) { return name_of(test.param); });

// S < ratio in SBHD: no rows, every gradient an exact zero; strided rows' gaps untouched.
TEST_F(Gpu, SbhdShorterThanRatioZeroesEveryGradient) {
  for (DType t : {DType::kBf16, DType::kF16, DType::kF32}) {
    IoCase c{t, 16, 2, 128};
    IoProblem q(c, base_seed());
    q.seq = 7;
    q.rows = 0;
    q.p = make_problem(q.config, std::vector<std::int32_t>(3, 7), 0, 0, base_seed());
    q.kv = encode(q.p.kv, t);
    q.score = encode(q.p.score, t);
    q.grad_out = encode(q.p.grad_out, t);
    bool gaps = false;
    const Outputs o = q.run(Layout::kSbhd, 0, 0, 0, q.width + 8, Family::kAuto, 0, &gaps);
    EXPECT_TRUE(gaps) << dtype_name(t);
    for (std::size_t i = 0; i < o.gkv.size(); ++i)
      ASSERT_EQ(o.gkv[i], 0) << dtype_name(t) << " " << i;
    for (std::size_t i = 0; i < o.gs.size(); ++i)
      ASSERT_EQ(o.gs[i], 0) << dtype_name(t) << " " << i;
    for (float v : o.gape) ASSERT_EQ(v, 0.0f) << dtype_name(t);
  }
}

// Buffers of exactly the bytes the strides span (the last row ends the allocation), offsets
// that lie (past the tokens, decreasing, negative), SBHD tails and S < ratio: run under
// compute-sanitizer memcheck by tools/gpu_suite.sh. Here: every call is accepted and returns.
TEST_F(Gpu, AdversarialStridesAndOffsetsStayInBounds) {
  struct Shape {
    int ratio, coff, head_dim;
  };
  for (const Shape sh : {Shape{4, 2, 128}, Shape{16, 1, 65}, Shape{128, 2, 128}}) {
    for (DType t : {DType::kBf16, DType::kF32}) {
      Config c{sh.ratio, sh.head_dim, sh.coff, t, Layout::kThd, true};
      const std::int64_t w = static_cast<std::int64_t>(sh.coff) * sh.head_dim;
      const std::int64_t align =
          std::min<std::int64_t>(16 / element_size(t), sh.head_dim & -sh.head_dim);
      const std::int64_t stride = w + 3 * align, ostride = sh.head_dim + align;
      const std::int64_t tokens = 3 * sh.ratio + 5, rows = 6;
      const auto esz = static_cast<std::size_t>(element_size(t));
      auto span = [&](std::int64_t n, std::int64_t st, std::int64_t width) {
        return static_cast<std::size_t>((n - 1) * st + width) * esz;
      };
      device::Buffer kv = poisoned(span(tokens, stride, w)),
                     score = poisoned(span(tokens, stride, w));
      device::Buffer gkv = poisoned(span(tokens, stride, w)),
                     gsc = poisoned(span(tokens, stride, w));
      device::Buffer out = poisoned(span(rows, ostride, sh.head_dim));
      device::Buffer gout = poisoned(span(rows, ostride, sh.head_dim));
      kv.fill(0x3c);
      score.fill(0x3c);
      gout.fill(0x3c);
      device::Buffer ape(static_cast<std::size_t>(sh.ratio * w) * 4), gape(ape.size());
      ape.fill(0);
      // Lying offsets: a segment past the tokens, a decreasing one, a negative one.
      const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(tokens + 40), 3, -7};
      const std::vector<std::int32_t> cuc = {0, 5, 2, 6};
      device::Buffer cu_d(cu.size() * 4), cuc_d(cuc.size() * 4);
      cu_d.upload(cu.data(), cu_d.size());
      cuc_d.upload(cuc.data(), cuc_d.size());
      ForwardArgs f;
      f.kv = kv.get();
      f.score = score.get();
      f.ape = ape.as<float>();
      f.cu_seqlens = cu_d.as<std::int32_t>();
      f.cu_seqlens_comp = cuc_d.as<std::int32_t>();
      f.out = out.get();
      f.total_tokens = tokens;
      f.num_segments = 3;
      f.total_comp = rows;
      f.config = c;
      f.kv_stride = f.score_stride = stride;
      f.out_stride = ostride;
      g_runtime->forward(f, nullptr);
      BackwardArgs b;
      b.kv = f.kv;
      b.score = f.score;
      b.ape = f.ape;
      b.cu_seqlens = f.cu_seqlens;
      b.cu_seqlens_comp = f.cu_seqlens_comp;
      b.grad_out = gout.get();
      b.grad_kv = gkv.get();
      b.grad_score = gsc.get();
      b.grad_ape = gape.as<float>();
      b.total_tokens = tokens;
      b.num_segments = 3;
      b.total_comp = rows;
      b.config = c;
      b.kv_stride = b.score_stride = b.grad_kv_stride = b.grad_score_stride = stride;
      b.grad_out_stride = ostride;
      for (std::uint32_t flags : {0u, kDeterministic}) {
        b.flags = flags;
        g_runtime->backward(b, nullptr);
      }
      // SBHD: a tail per column (S = 2 * ratio + 3), then S < ratio; exact spans again.
      for (const std::int64_t seq :
           {2 * static_cast<std::int64_t>(sh.ratio) + 3, std::int64_t{1}}) {
        const std::int64_t batch = 2, stokens = seq * batch, srows = (seq / sh.ratio) * batch;
        device::Buffer skv = poisoned(span(stokens, stride, w)),
                       ssc = poisoned(span(stokens, stride, w));
        device::Buffer sgkv = poisoned(span(stokens, stride, w)),
                       sgsc = poisoned(span(stokens, stride, w));
        device::Buffer sout = poisoned(srows > 0 ? span(srows, ostride, sh.head_dim) : 16);
        device::Buffer sgout = poisoned(srows > 0 ? span(srows, ostride, sh.head_dim) : 16);
        skv.fill(0x3c);
        ssc.fill(0x3c);
        sgout.fill(0x3c);
        ForwardArgs sf = f;
        sf.config.layout = Layout::kSbhd;
        sf.kv = skv.get();
        sf.score = ssc.get();
        sf.out = sout.get();
        sf.cu_seqlens = sf.cu_seqlens_comp = nullptr;
        sf.total_tokens = stokens;
        sf.num_segments = static_cast<std::int32_t>(batch);
        sf.total_comp = srows;
        sf.seq_len = seq;
        g_runtime->forward(sf, nullptr);
        BackwardArgs sb = b;
        sb.config.layout = Layout::kSbhd;
        sb.kv = skv.get();
        sb.score = ssc.get();
        sb.grad_out = sgout.get();
        sb.grad_kv = sgkv.get();
        sb.grad_score = sgsc.get();
        sb.cu_seqlens = sb.cu_seqlens_comp = nullptr;
        sb.total_tokens = stokens;
        sb.num_segments = static_cast<std::int32_t>(batch);
        sb.total_comp = srows;
        sb.seq_len = seq;
        g_runtime->backward(sb, nullptr);
        device::synchronize(nullptr);
      }
      device::synchronize(nullptr);
    }
  }
}

}  // namespace
}  // namespace csa::test
