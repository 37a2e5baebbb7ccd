// GPU tests (skipped without a driver or device): the short-window kernels against the plain GPU
// reference kernel (bitwise), the CPU fp32 reference (tolerance) and the fp64 oracle (parity);
// poisoned outputs, exact zeros, determinism, accumulate/overwrite, bad pointers and adversarial
// offsets.
#include <gtest/gtest.h>

#include <future>
#include <mutex>
#include <thread>

#include "gpu_fixture.hpp"

namespace csa::test {
namespace {

const auto* const g_environment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// Compiles the fused and reference modules of every configuration in parallel before the
// per-configuration tests run.
TEST_F(Gpu, PrewarmEveryTestedConfiguration) {
  std::vector<std::pair<Config, Family>> jobs;
  for (int ratio : {1, 2, 4, 8, 16})
    for (int coff : {1, 2})
      for (int d : {65, 128, 512})
        for (Family f : {Family::kAuto, Family::kReference}) jobs.push_back({{ratio, d, coff}, f});
  std::atomic<std::size_t> next{0};
  std::mutex mutex;
  std::vector<std::string> errors;
  auto worker = [&] {
    for (std::size_t i = next++; i < jobs.size(); i = next++) {
      try {
        g_runtime->prewarm(jobs[i].first, 0, jobs[i].second);
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors.push_back(e.what());
      }
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < std::max(2u, std::thread::hardware_concurrency()); ++t)
    threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

std::string config_name(const ::testing::TestParamInfo<std::tuple<int, int, int>>& info) {
  return "r" + std::to_string(std::get<0>(info.param)) + "_c" +
         std::to_string(std::get<1>(info.param)) + "_d" + std::to_string(std::get<2>(info.param));
}

class ShortWindow : public Gpu, public ::testing::WithParamInterface<std::tuple<int, int, int>> {};

TEST_P(ShortWindow, MatchesReferencesOnEveryPack) {
  const auto [ratio, coff, head_dim] = GetParam();
  const Config config{ratio, head_dim, coff};
  int pack_index = 0;
  for (const auto& pack : packs()) {
    const std::uint64_t seed =
        base_seed() + static_cast<std::uint64_t>(ratio * 1000 + coff * 100 + head_dim) * 7 +
        pack_index++;
    const Problem p = make_problem(config, pack.lens, kExtraTokens, kExtraRows, seed);
    SCOPED_TRACE(std::string(pack.name) + ": " + p.describe());
    DeviceProblem dev(p);

    // CPU references in the background while the GPU runs.
    CpuReferences cpu = CpuReferences::start(p);

    // Forward: every element written, bitwise equal to the GPU reference, stable over 3 runs.
    const auto out = dev.forward(Family::kAuto);
    for (std::size_t i = 0; i < out.size(); ++i)
      ASSERT_NE(out[i], 0xffff) << "out[" << i << "] not written";
    const auto out_ref = dev.forward(Family::kReference);
    ASSERT_EQ(first_difference(out.data(), out_ref.data(), out.size() * 2, 2),
              static_cast<std::size_t>(-1))
        << "out differs from the GPU reference";
    ASSERT_EQ(dev.forward(Family::kAuto), out);
    ASSERT_EQ(dev.forward(Family::kAuto), out);

    // Backward, default mode, NaN-poisoned grad buffers and grad_ape.
    const auto g = dev.backward(Family::kAuto, 0, 0xff, nan_ape(p));
    for (std::size_t i = 0; i < g.kv.size(); ++i) {
      ASSERT_NE(g.kv[i], 0xffff) << "grad_kv[" << i << "] not written";
      ASSERT_NE(g.score[i], 0xffff) << "grad_score[" << i << "] not written";
    }
    for (float v : g.ape) ASSERT_FALSE(std::isnan(v)) << "grad_ape not overwritten";
    const auto g_zeroed =
        dev.backward(Family::kAuto, 0, 0x00, std::vector<float>(p.ape.size(), 0.0f));
    ASSERT_EQ(g_zeroed.kv, g.kv) << "grad_kv depends on the buffer's prior content";
    ASSERT_EQ(g_zeroed.score, g.score) << "grad_score depends on the buffer's prior content";
    const auto mask = consumed_mask(p);
    for (std::size_t i = 0; i < mask.size(); ++i) {
      if (!mask[i]) {
        ASSERT_EQ(g.kv[i], 0) << "never-consumed grad_kv[" << i << "] not exactly 0";
        ASSERT_EQ(g.score[i], 0) << "never-consumed grad_score[" << i << "] not exactly 0";
      }
    }
    const auto g_ref = dev.backward(Family::kReference, 0, 0xff, nan_ape(p));
    ASSERT_EQ(first_difference(g.kv.data(), g_ref.kv.data(), g.kv.size() * 2, 2),
              static_cast<std::size_t>(-1))
        << "grad_kv differs from the GPU reference";
    ASSERT_EQ(first_difference(g.score.data(), g_ref.score.data(), g.score.size() * 2, 2),
              static_cast<std::size_t>(-1))
        << "grad_score differs from the GPU reference";
    for (std::size_t i = 0; i < g.ape.size(); ++i)
      ASSERT_NEAR(g.ape[i], g_ref.ape[i], 1e-3) << "grad_ape[" << i << "]";
    for (int run = 0; run < 2; ++run) {
      const auto again = dev.backward(Family::kAuto, 0, 0xff, nan_ape(p));
      ASSERT_EQ(again.kv, g.kv);
      ASSERT_EQ(again.score, g.score);
    }

    // Deterministic mode: grad_ape bitwise over 3 runs; accumulate adds exactly once.
    const auto d1 = dev.backward(Family::kAuto, kDeterministic, 0xff, nan_ape(p));
    ASSERT_EQ(d1.kv, g.kv);
    ASSERT_EQ(d1.score, g.score);
    for (int run = 0; run < 2; ++run) {
      const auto again = dev.backward(Family::kAuto, kDeterministic, 0xff, nan_ape(p));
      ASSERT_EQ(first_difference(again.ape.data(), d1.ape.data(), d1.ape.size() * 4, 4),
                static_cast<std::size_t>(-1))
          << "deterministic grad_ape changed between runs";
    }
    for (std::size_t i = 0; i < g.ape.size(); ++i) ASSERT_NEAR(d1.ape[i], g.ape[i], 1e-3);
    std::vector<float> preset(p.ape.size());
    for (std::size_t i = 0; i < preset.size(); ++i) preset[i] = 0.5f + static_cast<float>(i % 7);
    const auto acc_det =
        dev.backward(Family::kAuto, kDeterministic | kAccumulateGradApe, 0xff, preset);
    for (std::size_t i = 0; i < preset.size(); ++i)
      ASSERT_EQ(acc_det.ape[i], preset[i] + d1.ape[i]) << i;
    const auto acc = dev.backward(Family::kAuto, kAccumulateGradApe, 0xff, preset);
    for (std::size_t i = 0; i < preset.size(); ++i)
      ASSERT_NEAR(acc.ape[i], preset[i] + g.ape[i], 1e-3) << i;
    ASSERT_EQ(acc.kv, g.kv);

    // CPU fp32 reference (tolerance contract) and fp64 oracle (parity).
    const auto out_cpu = cpu.forward.get();
    const auto out64 = cpu.forward64.get();
    const auto grads_cpu = cpu.backward.get();
    const auto oracle = cpu.backward64.get();
    auto bf = [](std::uint16_t v) { return bf16_value(v); };
    auto f32 = [](float v) { return static_cast<double>(v); };
    for (const std::string& failure :
         {cpu_tolerance_failure(distinct_out_rows(out, p), distinct_out_rows(out_ref, p),
                                distinct_out_rows(out_cpu, p), "out"),
          cpu_tolerance_failure(g.kv, g_ref.kv, grads_cpu.kv, "grad_kv"),
          cpu_tolerance_failure(g.score, g_ref.score, grads_cpu.score, "grad_score"),
          parity_failure(out, out_cpu, out64, bf, "out"),
          parity_failure(g.kv, grads_cpu.kv, oracle.kv, bf, "grad_kv"),
          parity_failure(g.score, grads_cpu.score, oracle.score, bf, "grad_score"),
          parity_failure(d1.ape, grads_cpu.ape, oracle.ape, f32, "grad_ape")}) {
      EXPECT_TRUE(failure.empty()) << failure;
    }
    for (std::size_t i = 0; i < g.ape.size(); ++i)
      EXPECT_NEAR(g.ape[i], grads_cpu.ape[i], 1e-3) << "grad_ape[" << i << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, ShortWindow,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8, 16),
                                            ::testing::Values(1, 2),
                                            ::testing::Values(65, 128, 512)),
                         config_name);

// The envelope's corners between the tested powers of two: odd ratios, head_dim 1 and the
// largest odd one (scalar columns), a narrow odd one.
INSTANTIATE_TEST_SUITE_P(Envelope, ShortWindow,
                         ::testing::Values(std::make_tuple(3, 2, 4095), std::make_tuple(13, 1, 1),
                                           std::make_tuple(7, 2, 9)),
                         config_name);

TEST_F(Gpu, NothingToPoolGivesZeroGradients) {
  // Every segment shorter than ratio: no rows; total_comp == 0.
  const Problem p = make_problem({8, 128, 2}, {5, 6, 7}, kExtraTokens, 0, base_seed());
  SCOPED_TRACE(p.describe());
  DeviceProblem dev(p);
  for (std::uint32_t flags : {0u, static_cast<std::uint32_t>(kDeterministic)}) {
    const auto g = dev.backward(Family::kAuto, flags, 0xff, nan_ape(p));
    for (std::size_t i = 0; i < g.kv.size(); ++i) ASSERT_TRUE(g.kv[i] == 0 && g.score[i] == 0) << i;
    for (float v : g.ape) ASSERT_EQ(v, 0.0f);
    std::vector<float> preset(p.ape.size(), 3.25f);
    const auto acc = dev.backward(Family::kAuto, flags | kAccumulateGradApe, 0xff, preset);
    for (float v : acc.ape) ASSERT_EQ(v, 3.25f) << "accumulate must leave grad_ape unchanged";
  }
}

TEST_F(Gpu, MisalignedDevicePointersAreRejectedAndOutputsUntouched) {
  const Problem p = make_problem({4, 128, 2}, {256}, 0, 0, base_seed());
  DeviceProblem dev(p);
  dev.device.out.fill(0x5a);
  dev.device.grad_kv.fill(0x5a);
  ForwardArgs f = dev.forward_args();
  f.kv = static_cast<const char*>(f.kv) + 2;
  f.total_tokens -= 1;
  try {
    g_runtime->forward(f, nullptr);
    FAIL() << "accepted a misaligned kv";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("kv"), std::string::npos);
  }
  BackwardArgs b = dev.backward_args(0);
  b.grad_kv = static_cast<char*>(b.grad_kv) + 4;
  EXPECT_THROW(g_runtime->backward(b, nullptr), Error);
  device::synchronize(nullptr);
  std::vector<std::uint8_t> host(dev.device.out.size());
  dev.device.out.download(host.data(), host.size());
  for (auto v : host) ASSERT_EQ(v, 0x5a);
  host.resize(dev.device.grad_kv.size());
  dev.device.grad_kv.download(host.data(), host.size());
  for (auto v : host) ASSERT_EQ(v, 0x5a);
}

// Offsets are device data: whatever they hold, kernels stay in bounds (run this under
// compute-sanitizer memcheck), and check_offsets names the first bad entry.
TEST_F(Gpu, AdversarialOffsetsStayInBounds) {
  using Offsets = std::vector<std::vector<std::int32_t>>;
  // The first three sets of each list break the contract and must fail check_offsets.
  const auto run = [](const std::vector<std::int32_t>& seqlens, const Offsets& bad_cu,
                      const Offsets& bad_cuc) {
    for (int coff : {1, 2})
      for (int ratio : {1, 4, 16, 32, 128}) {  // both families
        Problem p = make_problem({ratio, 64, coff}, seqlens, 24, 40, base_seed() + ratio);
        for (std::size_t k = 0; k < bad_cu.size(); ++k) {
          p.cu = bad_cu[k];
          p.cuc = bad_cuc[k];
          SCOPED_TRACE("offset set " + std::to_string(k) + " " + p.describe());
          DeviceProblem dev(p);
          EXPECT_NO_THROW(dev.forward(Family::kAuto));
          EXPECT_NO_THROW(dev.backward(Family::kAuto, 0, 0xff, nan_ape(p)));
          EXPECT_NO_THROW(dev.backward(Family::kAuto, kDeterministic, 0xff, nan_ape(p)));
          const OffsetReport r = g_runtime->check_offsets(
              dev.device.cu.as<std::int32_t>(), dev.device.cuc.as<std::int32_t>(), p.segments(),
              p.total_tokens, p.total_comp, ratio, nullptr);
          EXPECT_FALSE(r.ok && k < 3) << "offset set " << k << " passed the device check";
          if (!r.ok) {
            EXPECT_FALSE(r.message.empty());
          }
        }
      }
  };
  run({400, 300, 300},
      {{0, 900, 100, 2000},      // non-monotonic
       {0, 512, 4096, 1 << 30},  // beyond total_tokens
       {-77, 16, 300, 1000},     // negative start
       {0, 1000, 1000, 1000}},
      {{0, 300, 10, 500},           // inconsistent, non-monotonic
       {0, 128, 1 << 28, 1 << 29},  // beyond total_comp
       {5, 4, 90, -3},              // garbage
       {0, 250, 250, 250}});        // consistent with cu
  // One segment: the short-window backward then loads the window before the offsets arrive.
  run({1000},
      {{-77, 1000},   // negative start
       {0, 1 << 30},  // beyond total_tokens
       {500, 100},    // decreasing
       {0, 1000}},
      {{5, 90},       // garbage
       {0, 1 << 28},  // beyond total_comp
       {300, -3},     // garbage
       {0, 250}});    // consistent with cu
}

TEST_F(Gpu, CheckOffsetsAcceptsValidOffsets) {
  const Problem p = make_problem({4, 64, 2}, {64, 0, 253, 3}, 21, 8, base_seed());
  DeviceProblem dev(p);
  const OffsetReport r =
      g_runtime->check_offsets(dev.device.cu.as<std::int32_t>(), dev.device.cuc.as<std::int32_t>(),
                               p.segments(), p.total_tokens, p.total_comp, 4, nullptr);
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace
}  // namespace csa::test
