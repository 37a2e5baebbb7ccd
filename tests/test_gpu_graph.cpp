// Graph capture and concurrency on the device: forward + backward captured at static
// capacities and replayed while the offsets' contents change, grad_ape overwrite and
// accumulate under replay, the atomic grad_ape published per call on several streams, a cold
// configuration under capture (global and relaxed modes), and many threads calling on their
// own streams.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>

#include "api/runtime_impl.hpp"
#include "gpu_fixture.hpp"

namespace csa::test {
namespace {

// Output buffers of one problem, poisoned (0xFF: NaN in bf16 and fp32) before every run.
struct Outputs {
  explicit Outputs(const Problem& p)
      : out(static_cast<std::size_t>(p.comp_elems()) * 2),
        grad_kv(static_cast<std::size_t>(p.token_elems()) * 2),
        grad_score(static_cast<std::size_t>(p.token_elems()) * 2),
        grad_ape(p.ape.size() * 4) {}
  void poison(Stream stream) {
    for (auto* b : {&out, &grad_kv, &grad_score, &grad_ape})
      device::memset_async(b->get(), 0xff, b->size(), stream);
  }
  ForwardArgs forward(const DeviceProblem& dp) const {
    ForwardArgs a = dp.forward_args();
    a.out = out.get();
    return a;
  }
  BackwardArgs backward(const DeviceProblem& dp, std::uint32_t flags) const {
    BackwardArgs a = dp.backward_args(flags);
    a.grad_kv = grad_kv.get();
    a.grad_score = grad_score.get();
    a.grad_ape = grad_ape.as<float>();
    return a;
  }
  struct Host {
    std::vector<std::uint16_t> out, kv, score;
    std::vector<float> ape;
    bool operator==(const Host& o) const {
      return out == o.out && kv == o.kv && score == o.score &&
             std::memcmp(ape.data(), o.ape.data(), ape.size() * 4) == 0;
    }
  };
  Host download() const {
    Host h{
        std::vector<std::uint16_t>(out.size() / 2), std::vector<std::uint16_t>(grad_kv.size() / 2),
        std::vector<std::uint16_t>(grad_score.size() / 2), std::vector<float>(grad_ape.size() / 4)};
    out.download(h.out.data(), out.size());
    grad_kv.download(h.kv.data(), grad_kv.size());
    grad_score.download(h.score.data(), grad_score.size());
    grad_ape.download(h.ape.data(), grad_ape.size());
    return h;
  }
  device::Buffer out, grad_kv, grad_score, grad_ape;
};

// "" when no element still holds the poison (every element was written).
std::string unwritten(const Outputs::Host& h) {
  auto count16 = [](const std::vector<std::uint16_t>& v) {
    return std::count(v.begin(), v.end(), std::uint16_t{0xffff});
  };
  const auto ape = std::count_if(h.ape.begin(), h.ape.end(), [](float x) { return std::isnan(x); });
  if (count16(h.out) + count16(h.kv) + count16(h.score) + ape == 0) return {};
  return "unwritten (poison left): out " + std::to_string(count16(h.out)) + ", grad_kv " +
         std::to_string(count16(h.kv)) + ", grad_score " + std::to_string(count16(h.score)) +
         ", grad_ape " + std::to_string(ape);
}

const driver::Driver& real_driver(Runtime& rt) {
  return RuntimeAccess::of(rt).loader.get();
}

// `p` with new true lengths (same segment count, same capacities and tensors).
Problem with_lengths(const Problem& p, const std::vector<std::int32_t>& lens) {
  Problem q = p;
  q.lens = lens;
  q.cu = {0};
  q.cuc = {0};
  for (auto len : lens) {
    q.cu.push_back(q.cu.back() + len);
    q.cuc.push_back(q.cuc.back() + len / p.config.ratio);
  }
  return q;
}

void upload_offsets(DeviceProblem& dp, const Problem& q) {
  dp.device.cu.upload(q.cu.data(), q.cu.size() * 4);
  dp.device.cuc.upload(q.cuc.data(), q.cuc.size() * 4);
}

class Capture : public Gpu, public ::testing::WithParamInterface<Config> {};

// Capture forward + backward at capacities (rows +8, tokens +21), replay while the offsets
// change to a smaller true count and back, each replay bitwise equal to direct calls.
TEST_P(Capture, ReplayAtCapacitiesMatchesDirectCallsWhileOffsetsChange) {
  const Config c = GetParam();
  const Problem p = make_problem(c, {1023, 2048, 509}, kExtraTokens, kExtraRows, base_seed() + 11);
  SCOPED_TRACE(p.describe());
  DeviceProblem dp(p);
  const Plan plan(*g_runtime, c, 0);
  device::StreamHandle stream;
  Outputs graph_out(p), direct_out(p);
  device::Graph graph(stream.get(), [&] {
    plan.forward(graph_out.forward(dp), stream.get());
    plan.backward(graph_out.backward(dp, kDeterministic), stream.get());
  });
  Outputs::Host first;
  for (const auto& lens : std::vector<std::vector<std::int32_t>>{
           {1023, 2048, 509}, {500, 0, 129}, {3, 7, 0}, {1023, 2048, 509}}) {
    const Problem q = with_lengths(p, lens);
    SCOPED_TRACE("true lengths " + q.describe());
    upload_offsets(dp, q);
    graph_out.poison(stream.get());
    graph.launch(stream.get());
    direct_out.poison(stream.get());
    plan.forward(direct_out.forward(dp), stream.get());
    plan.backward(direct_out.backward(dp, kDeterministic), stream.get());
    stream.synchronize();
    const Outputs::Host replayed = graph_out.download();
    const Outputs::Host direct = direct_out.download();
    EXPECT_EQ(unwritten(replayed), "");
    EXPECT_TRUE(replayed == direct) << "graph replay differs from direct calls";
    // The replay serves the new true count: out against the CPU reference of these lengths,
    // each distinct row counted once (the padding rows repeat one window), the allowance taken
    // of the whole output as captured.
    std::vector<std::uint16_t> ref(static_cast<std::size_t>(q.comp_elems()));
    reference::forward_fp32(q.host(), ref.data());
    EXPECT_EQ(tolerance_failure(distinct_out_rows(replayed.out, q), distinct_out_rows(ref, q),
                                "out", replayed.out.size()),
              "");
    if (first.out.empty()) {
      first = replayed;
    } else if (lens == p.lens) {
      EXPECT_TRUE(replayed == first) << "replay at the original lengths changed";
    }
  }
}

// grad_ape under replay: overwrite gives the direct result every replay; accumulate into zeros
// gives it once and exactly twice it after two replays.
TEST_P(Capture, GradApeOverwriteAndAccumulateUnderReplay) {
  const Config c = GetParam();
  const Problem p = make_problem(c, {1023, 2048, 509}, kExtraTokens, kExtraRows, base_seed() + 12);
  SCOPED_TRACE(p.describe());
  DeviceProblem dp(p);
  const Plan plan(*g_runtime, c, 0);
  device::StreamHandle stream;
  Outputs direct(p), overwrite(p), accumulate(p);
  direct.poison(stream.get());
  plan.backward(direct.backward(dp, kDeterministic), stream.get());
  stream.synchronize();
  const std::vector<float> expected = direct.download().ape;
  device::Graph overwrite_graph(
      stream.get(), [&] { plan.backward(overwrite.backward(dp, kDeterministic), stream.get()); });
  device::Graph accumulate_graph(stream.get(), [&] {
    plan.backward(accumulate.backward(dp, kDeterministic | kAccumulateGradApe), stream.get());
  });
  overwrite.poison(stream.get());  // NaN grad_ape: overwrite must not read it
  accumulate.poison(stream.get());
  device::memset_async(accumulate.grad_ape.get(), 0, accumulate.grad_ape.size(), stream.get());
  std::vector<float> twice(expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) twice[i] = expected[i] + expected[i];
  for (int replay = 1; replay <= 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    overwrite_graph.launch(stream.get());
    accumulate_graph.launch(stream.get());
    stream.synchronize();
    const auto o = overwrite.download();
    const auto a = accumulate.download();
    EXPECT_EQ(std::memcmp(o.ape.data(), expected.data(), expected.size() * 4), 0)
        << "overwrite replay differs from the direct call";
    const auto& want = replay == 1 ? expected : twice;
    EXPECT_EQ(std::memcmp(a.ape.data(), want.data(), want.size() * 4), 0)
        << "accumulate replay is not " << replay << "x the direct grad_ape";
    EXPECT_TRUE(o.kv == a.kv && o.score == a.score);
  }
}

INSTANTIATE_TEST_SUITE_P(Graph, Capture,
                         ::testing::Values(Config{4, 128, 2}, Config{16, 65, 1},
                                           Config{128, 512, 1}, Config{64, 128, 2}),
                         [](const auto& param_info) {
                           return "r" + std::to_string(param_info.param.ratio) + "c" +
                                  std::to_string(param_info.param.coff) + "d" +
                                  std::to_string(param_info.param.head_dim);
                         });

// The default backward of coff * head_dim >= 512 (short window), of the narrower short-window
// configurations (fixed order when deterministic, one_launch otherwise) and of the long-window
// buckets the table marks atomic sums grad_ape with atomics, and the kernel zeroes grad_ape
// itself, per column block, through claim words that every launch leaves as it found them: the
// stream's eagerly, the call's own under capture. Calls of several such configurations,
// interleaved on two streams with deterministic and accumulating calls (another workspace, or
// none) and with replays of a captured graph on either stream: every grad_ape (NaN-poisoned
// before each call) within 1e-3 of the deterministic one, no call seeing another's sums;
// grad_kv / grad_score bitwise the same.
TEST_F(Gpu, AtomicGradApeIsPublishedOncePerCallOnEveryStream) {
  // Short-window head_dim 512, and long-window shapes whose small-row buckets add grad_ape
  // atomically in the shipped sm_90 table (others run the fixed order: still a valid check).
  // The last one has 8193 rows: many rows a CTA.
  const std::vector<Config> configs = {{2, 512, 2},  {4, 512, 2},   {16, 512, 1},
                                       {16, 512, 2}, {128, 128, 1}, {128, 512, 2},
                                       {4, 128, 2},  {2, 65, 1},    {4, 128, 2}};
  std::vector<Problem> problems;
  std::vector<std::unique_ptr<DeviceProblem>> dps;
  std::vector<Outputs::Host> expected;
  problems.reserve(configs.size());
  dps.reserve(configs.size());
  expected.reserve(configs.size());
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const std::vector<std::int32_t> pack = i + 1 == configs.size()
                                               ? std::vector<std::int32_t>{32775}
                                               : std::vector<std::int32_t>{1023, 2048, 509};
    problems.push_back(make_problem(configs[i], pack, kExtraTokens, kExtraRows,
                                    base_seed() + 40 + static_cast<unsigned>(i)));
    dps.push_back(std::make_unique<DeviceProblem>(problems.back()));
    Outputs o(problems.back());
    o.poison(nullptr);
    g_runtime->forward(o.forward(*dps.back()), nullptr);
    g_runtime->backward(o.backward(*dps.back(), kDeterministic), nullptr);
    device::synchronize(nullptr);
    expected.push_back(o.download());
    ASSERT_EQ(unwritten(expected.back()), "") << problems.back().describe();
  }
  device::StreamHandle first, second;
  std::vector<std::unique_ptr<Outputs>> outs;
  outs.reserve(problems.size());
  for (const Problem& p : problems) outs.push_back(std::make_unique<Outputs>(p));
  auto check = [&](std::size_t i, const std::string& what) {
    const Outputs::Host h = outs[i]->download();
    SCOPED_TRACE(problems[i].describe() + ", " + what + " (seed " + std::to_string(base_seed()) +
                 ")");
    ASSERT_EQ(h.kv, expected[i].kv);
    ASSERT_EQ(h.score, expected[i].score);
    for (std::size_t e = 0; e < h.ape.size(); ++e)
      ASSERT_NEAR(h.ape[e], expected[i].ape[e], 1e-3) << "grad_ape[" << e << "]";
  };
  for (int round = 0; round < 12; ++round) {
    for (std::size_t i = 0; i < configs.size(); ++i) {
      const Stream s = (round + i) % 2 == 0 ? first.get() : second.get();
      outs[i]->poison(s);
      const std::uint32_t other = round % 3 == 0 ? kDeterministic : kAccumulateGradApe;
      if (round % 3 != 2) g_runtime->backward(outs[i]->backward(*dps[i], other), s);
      outs[i]->poison(s);  // NaN grad_ape: the published call must overwrite it
      g_runtime->backward(outs[i]->backward(*dps[i], 0), s);
    }
    first.synchronize();
    second.synchronize();
    for (std::size_t i = 0; i < configs.size(); ++i) check(i, "round " + std::to_string(round));
  }
  // Captured: 2,2,512, 128,1,128 (1 row a CTA on the H200), 128,2,512 (4 rows a CTA) and
  // both 4,2,128 calls in one launch each, with claim words of their own.
  // Replayed on the stream it was captured on and on the other one, between eager calls of
  // other configurations.
  const Plan plan(*g_runtime, configs[0], 0);
  const Plan long_plan(*g_runtime, configs[4], 0);
  const Plan wide_long_plan(*g_runtime, configs[5], 0);
  const Plan narrow_plan(*g_runtime, configs[6], 0);
  device::Graph graph(first.get(), [&] {
    plan.backward(outs[0]->backward(*dps[0], 0), first.get());
    long_plan.backward(outs[4]->backward(*dps[4], 0), first.get());
    wide_long_plan.backward(outs[5]->backward(*dps[5], 0), first.get());
    narrow_plan.backward(outs[6]->backward(*dps[6], 0), first.get());
    narrow_plan.backward(outs[8]->backward(*dps[8], 0), first.get());
  });
  for (int replay = 1; replay <= 4; ++replay) {
    const Stream s = replay % 2 == 1 ? first.get() : second.get();
    for (std::size_t i : {0, 4, 5, 6, 8}) outs[i]->poison(first.get());
    first.synchronize();
    graph.launch(s);
    for (std::size_t i : {1, 3, 7}) g_runtime->backward(outs[i]->backward(*dps[i], 0), s);
    first.synchronize();
    second.synchronize();
    for (std::size_t i : {0, 4, 5, 6, 8}) check(i, "replay " + std::to_string(replay));
    for (std::size_t i : {1, 3, 7}) check(i, "after replay " + std::to_string(replay));
  }
}

// A Runtime that has only prewarmed (no eager call) captures the default backward of a
// configuration that sums grad_ape atomically, in one launch with the claim words the prewarm
// set aside: every replay (grad_ape NaN-poisoned before it) within 1e-3 of a deterministic call,
// grad_kv and grad_score bitwise equal to it.
TEST_F(Gpu, PrewarmedRuntimeCapturesTheAtomicBackward) {
  const Config c{4, 512, 2};
  const Problem p = make_problem(c, {1023, 2048, 509}, kExtraTokens, kExtraRows, base_seed() + 61);
  SCOPED_TRACE(p.describe() + " (seed " + std::to_string(base_seed()) + ")");
  DeviceProblem dp(p);
  device::StreamHandle stream;
  Outputs want(p);
  want.poison(stream.get());
  g_runtime->backward(want.backward(dp, kDeterministic), stream.get());
  stream.synchronize();
  const Outputs::Host expected = want.download();
  Runtime fresh(RuntimeOptions::from_environment());
  fresh.prewarm(c, 0);
  Outputs got(p);
  device::Graph graph(stream.get(), [&] { fresh.backward(got.backward(dp, 0), stream.get()); });
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    got.poison(stream.get());
    graph.launch(stream.get());
    stream.synchronize();
    const Outputs::Host h = got.download();
    ASSERT_EQ(h.kv, expected.kv);
    ASSERT_EQ(h.score, expected.score);
    for (std::size_t e = 0; e < h.ape.size(); ++e)
      ASSERT_NEAR(h.ape[e], expected.ape[e], 1e-3) << "grad_ape[" << e << "]";
  }
}

// A configuration no call has prepared, met under capture: a kCaptureUnsafe error naming it and
// saying how to prewarm; the capture ends cleanly and a normal call afterwards works.
TEST_F(Gpu, ColdConfigurationUnderCaptureRaisesInGlobalAndRelaxedModes) {
  const Config c{8, 96, 1};
  const Problem p = make_problem(c, {1023, 509}, kExtraTokens, kExtraRows, base_seed() + 13);
  SCOPED_TRACE(p.describe());
  DeviceProblem dp(p);
  Outputs expected(p);
  device::StreamHandle stream;
  expected.poison(stream.get());
  g_runtime->forward(expected.forward(dp), stream.get());
  g_runtime->backward(expected.backward(dp, kDeterministic), stream.get());
  stream.synchronize();
  const Outputs::Host want = expected.download();
  for (const auto mode : {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_RELAXED}) {
    SCOPED_TRACE(mode == CU_STREAM_CAPTURE_MODE_GLOBAL ? "global capture" : "relaxed capture");
    RuntimeOptions options = RuntimeOptions::from_environment();
    options.disk_cache = false;  // cold: nothing prepared, nothing on disk
    Runtime cold(options);
    const driver::Driver& d = real_driver(cold);  // the driver is loaded before the capture
    Outputs got(p);
    got.poison(stream.get());
    stream.synchronize();
    ASSERT_EQ(d.api().cuStreamBeginCapture(stream.get(), mode), CUDA_SUCCESS);
    for (int direction = 0; direction < 2; ++direction) {
      try {
        if (direction == 0)
          cold.forward(got.forward(dp), stream.get());
        else
          cold.backward(got.backward(dp, kDeterministic), stream.get());
        ADD_FAILURE() << "a cold call under capture did not raise";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Status::kCaptureUnsafe) << e.what();
        EXPECT_NE(std::string(e.what()).find("ratio=8 coff=1 head_dim=96"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("csa prewarm --config ratio=8,coff=1,head_dim=96"),
                  std::string::npos)
            << e.what();
      }
    }
    CUgraph graph = nullptr;
    ASSERT_EQ(d.api().cuStreamEndCapture(stream.get(), &graph), CUDA_SUCCESS);
    ASSERT_EQ(d.api().cuGraphDestroy(graph), CUDA_SUCCESS);
    cold.forward(got.forward(dp), stream.get());
    cold.backward(got.backward(dp, kDeterministic), stream.get());
    stream.synchronize();
    const Outputs::Host h = got.download();
    EXPECT_EQ(unwritten(h), "");
    EXPECT_TRUE(h == want) << "the call after the failed capture differs";
  }
}

// 8 threads x 200 calls (forward + backward, 100 times) on 8 streams, same and different
// configurations, through the runtime and through plans, starting cold: every call's results
// bitwise equal to a single-threaded run.
TEST_F(Gpu, EightThreadsOnEightStreamsMatchSingleThreadedRun) {
  const std::vector<Config> configs = {{4, 128, 2}, {2, 512, 2}, {128, 512, 1}, {16, 65, 1}};
  constexpr int kThreads = 8;
  constexpr int kIterations = 100;
  std::vector<Problem> problems;
  std::vector<std::unique_ptr<DeviceProblem>> device_problems;
  std::vector<Outputs::Host> expected;
  problems.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    problems.push_back(make_problem(configs[t % configs.size()], {300, 129, 77}, kExtraTokens,
                                    kExtraRows, base_seed() + 100 + static_cast<unsigned>(t)));
  }
  for (int t = 0; t < kThreads; ++t) {
    device_problems.push_back(std::make_unique<DeviceProblem>(problems[t]));
    Outputs o(problems[t]);
    o.poison(nullptr);
    g_runtime->forward(o.forward(*device_problems[t]), nullptr);
    g_runtime->backward(o.backward(*device_problems[t], kDeterministic), nullptr);
    device::synchronize(nullptr);
    expected.push_back(o.download());
    ASSERT_EQ(unwritten(expected.back()), "") << problems[t].describe();
  }
  RuntimeOptions options = RuntimeOptions::from_environment();
  options.disk_cache = false;  // the threads race the cold compiles too
  Runtime fresh(options);
  std::atomic<int> mismatches{0};
  std::vector<std::string> errors(kThreads);
  auto worker = [&](int t) {
    try {
      device::make_current(0);
      device::StreamHandle stream;
      const DeviceProblem& dp = *device_problems[t];
      std::unique_ptr<Plan> plan;
      if (t >= kThreads / 2) plan = std::make_unique<Plan>(fresh, problems[t].config, 0);
      Outputs o(problems[t]);
      for (int i = 0; i < kIterations; ++i) {
        o.poison(stream.get());
        if (plan) {
          plan->forward(o.forward(dp), stream.get());
          plan->backward(o.backward(dp, kDeterministic), stream.get());
        } else {
          fresh.forward(o.forward(dp), stream.get());
          fresh.backward(o.backward(dp, kDeterministic), stream.get());
        }
        stream.synchronize();
        if (!(o.download() == expected[t])) ++mismatches;
      }
    } catch (const std::exception& e) {
      errors[t] = e.what();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  EXPECT_EQ(mismatches.load(), 0) << "calls differing from the single-threaded run (seed "
                                  << base_seed() << ")";
}

}  // namespace
}  // namespace csa::test
