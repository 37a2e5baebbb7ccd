// The launch path against an injected fake driver table (no GPU): capture guards for cold and
// warm configurations, the prepared-record cache (one module load per configuration), grids,
// plans, devices and many threads calling at once.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "csa_params.h"
#include "cache_test_util.hpp"
#include "fake_driver.hpp"
#include "schedule/short_window.hpp"

namespace csa::test {
namespace {

TEST_F(FakeDriver, ColdConfigurationUnderCaptureRaisesAndTheNextCallWorks) {
  FakeRuntime rt;
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    state().capturing = true;
    try {
      rt.service.forward(forward_args(c), kStream, Family::kAuto);
      FAIL() << "a cold configuration was prepared under capture";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Status::kCaptureUnsafe);
      const std::string what = e.what();
      EXPECT_NE(what.find("prewarm"), std::string::npos) << what;
      EXPECT_NE(what.find("head_dim=64"), std::string::npos) << what;
    }
    EXPECT_EQ(state().library_loads, 0) << "a module was loaded under capture";
    EXPECT_EQ(state().launches, 0);
    state().capturing = false;
    rt.service.forward(forward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().library_loads, 1);
    EXPECT_EQ(state().launches, 1);
  }
}

TEST_F(FakeDriver, WarmConfigurationLaunchesUnderCaptureWithoutPreparingAgain) {
  FakeRuntime rt;
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    rt.service.prewarm(c, 0, Family::kAuto);
    EXPECT_EQ(state().library_loads, 1);
    state().capturing = true;
    for (int i = 0; i < 3; ++i) rt.service.forward(forward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().launches, 3);
    // Deterministic backward: kernel + fixed-order grad_ape reduction; the workspace comes
    // from the graph.
    rt.service.backward(backward_args(c, kDeterministic), kStream, Family::kAuto);
    EXPECT_EQ(state().launches, 5);
    EXPECT_EQ(state().allocations, 1) << "graph-owned grad_ape workspace";
    EXPECT_EQ(state().library_loads, 1) << "a warm call prepared again";
  }
}

TEST_F(FakeDriver, JitDisabledTurnsAColdKeyIntoAnError) {
  FakeRuntime rt(/*jit=*/false);
  try {
    rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
    FAIL() << "compiled with JIT disabled";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kJitDisabled);
  }
  EXPECT_EQ(state().launches, 0);
}

TEST_F(FakeDriver, CachedCubinTheDriverRefusesIsRebuilt) {
  TempDir dir;
  RuntimeOptions o = FakeRuntime::options(true);
  o.disk_cache = true;
  o.cache_dir = dir.path().string();
  { FakeRuntime(o).service.prewarm(kShort, 0, Family::kAuto); }
  const auto entries = files_with(dir.path(), ".cubin");
  ASSERT_EQ(entries.size(), 1u);
  // Checksum-valid, but no cubin the driver can load.
  const EntryParts parts = split_entry(read_bytes(entries[0]));
  write_bytes(entries[0], forge(parts.header, {'n', 'o', 't', ' ', 'E', 'L', 'F'}));
  SetUp();
  FakeRuntime rt(o);
  const PrewarmReport r = rt.service.prewarm(kShort, 0, Family::kAuto);
  EXPECT_TRUE(r.compiled);
  EXPECT_EQ(state().refused_loads, 1);
  EXPECT_EQ(state().library_loads, 1);
  EXPECT_EQ(split_entry(read_bytes(entries[0])).cubin, parts.cubin) << "the entry was not mended";
  rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 1);
}

TEST_F(FakeDriver, LongWindowGridCoversEveryRowAndColumnSlice) {
  FakeRuntime rt;
  rt.service.forward(forward_args(kLong), kStream, Family::kAuto);
  std::lock_guard<std::mutex> lock(state().mutex);
  ASSERT_EQ(state().last_grid.size(), 4u);
  // One flat dimension: every output row times every column slice.
  constexpr unsigned kRows = 8192u / 128u;
  EXPECT_EQ(state().last_grid[1], 1u);
  ASSERT_EQ(state().last_grid[0] % kRows, 0u);
  const unsigned slices = state().last_grid[0] / kRows;
  const unsigned cols = slices * state().last_grid[2];  // slices x column lanes
  EXPECT_GE(cols * 2, 64u);  // vec 1 or 2 columns per lane cover head_dim 64
}

TEST_F(FakeDriver, ShortWindowForwardGridCoversEveryRowVector) {
  FakeRuntime rt;
  const auto s = schedule::select_short_window(kShort);
  // A small call runs the narrow forward in its small CTAs; a large one the wide forward.
  for (const std::int64_t tokens : {std::int64_t{8192}, std::int64_t{65536}}) {
    ForwardArgs a = forward_args(kShort);
    a.total_tokens = tokens;
    a.total_comp = tokens / kShort.ratio;
    const auto choice = schedule::forward_choice(s, kShort, a.total_comp);
    EXPECT_EQ(choice.wide, tokens == 65536);
    rt.service.forward(a, kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    ASSERT_EQ(state().last_grid.size(), 4u);
    EXPECT_EQ(state().last_grid[2], static_cast<unsigned>(choice.threads));
    EXPECT_EQ(state().last_grid[1], 1u);
    const std::int64_t vectors = a.total_comp * kShort.head_dim / choice.vec;
    const std::int64_t threads = std::int64_t{state().last_grid[0]} * state().last_grid[2];
    EXPECT_GE(threads, vectors);
    EXPECT_LT(threads - vectors, choice.threads) << "one CTA too many";
  }
}

TEST_F(FakeDriver, ManyThreadsShareOnePreparedRecordPerConfiguration) {
  FakeRuntime rt;
  constexpr int kThreads = 8;
  constexpr int kCalls = 50;
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const Config c = t % 2 == 0 ? kShort : kLong;
      for (int i = 0; i < kCalls; ++i) {
        try {
          rt.service.forward(forward_args(c), kStream, Family::kAuto);
        } catch (const std::exception&) {
          ++errors;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors, 0);
  EXPECT_EQ(state().launches, kThreads * kCalls);
  EXPECT_EQ(state().library_loads, 2) << "one module load per configuration";
}

// The plan API over the same service: prepared by the constructor, then calls that launch
// under capture without any preparation, and reject a call for another configuration.
TEST_F(FakeDriver, PlanPreparesOnceAndLaunchesUnderCapture) {
  FakeRuntime rt;
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    auto record = rt.service.record(c, csa_kernel::kLayoutThdPacked, Family::kAuto, 0);
    EXPECT_EQ(state().library_loads, 1);
    const int queries = state().attribute_queries;
    state().capturing = true;
    for (int i = 0; i < 4; ++i) {
      rt.service.forward_with(*record, forward_args(c), kStream);
      rt.service.backward_with(*record, backward_args(c, kDeterministic), kStream);
    }
    EXPECT_EQ(state().launches, 4 * 3);  // forward + backward kernel + grad_ape reduction
    EXPECT_EQ(state().attribute_queries, queries) << "a plan call prepared again";
    EXPECT_EQ(state().library_loads, 1);
    // The free-function path finds the same record: no new load, launches under capture.
    rt.service.forward(forward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().library_loads, 1);
  }
}

TEST_F(FakeDriver, FastLaunchOffResolvesEveryCall) {
  ::setenv("CSA_FAST_LAUNCH", "0", 1);
  FakeRuntime rt;
  ::unsetenv("CSA_FAST_LAUNCH");
  rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
  const int queries = state().attribute_queries;
  rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
  EXPECT_GT(state().attribute_queries, queries) << "CSA_FAST_LAUNCH=0 reused a record";
  EXPECT_EQ(state().library_loads, 1) << "the module cache still serves the kernels";
  EXPECT_EQ(state().launches, 2);
}

// Two devices in one process (an sm_90 with 132 SMs and an sm_80 with 108): separate records,
// a module per arch, grids sized to each device, programmatic launch only where the arch has
// it, and a record used on the wrong device is rejected before any launch.
TEST_F(FakeDriver, TwoDevicesKeepSeparateRecords) {
  FakeRuntime rt;
  std::vector<unsigned> grid[2];
  bool programmatic[2] = {};
  for (int device : {0, 1}) {
    state().current_device = device;
    std::size_t first = 0;
    {
      std::lock_guard<std::mutex> lock(state().mutex);
      first = state().grids.size();
    }
    BackwardArgs b = backward_args(kShort);
    b.total_tokens = 65536;  // 16384 rows: many more than one wave of either device
    b.total_comp = 65536 / kShort.ratio;
    rt.service.backward(b, kStream, Family::kAuto);
    {
      std::lock_guard<std::mutex> lock(state().mutex);
      grid[device] = state().grids.at(first);  // the backward kernel (the reduction follows)
    }
    rt.service.forward(forward_args(kLong), kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    programmatic[device] = state().last_programmatic;
  }
  EXPECT_EQ(state().library_loads, 4) << "one module per configuration and arch";
  EXPECT_TRUE(programmatic[0]) << "sm_90 launches ask for programmatic serialization";
  EXPECT_FALSE(programmatic[1]) << "sm_80 has no programmatic dependent launch";
  ASSERT_EQ(grid[0].size(), 4u);
  ASSERT_EQ(grid[1].size(), 4u);
  EXPECT_NE(grid[0][0] * grid[0][1], grid[1][0] * grid[1][1])
      << "the backward grid is one wave of each device";
  const int launches = state().launches;
  auto record0 = rt.service.record(kShort, csa_kernel::kLayoutThdPacked, Family::kAuto, 0);
  state().current_device = 1;
  try {
    rt.service.forward_with(*record0, forward_args(kShort), kStream);
    FAIL() << "a record of device 0 launched on device 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("prepared for device 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(state().launches, launches);
}

TEST_F(FakeDriver, ProgrammaticLaunchCanBeTurnedOff) {
  ::setenv("CSA_PROGRAMMATIC_LAUNCH", "0", 1);
  FakeRuntime rt;
  ::unsetenv("CSA_PROGRAMMATIC_LAUNCH");
  rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
  std::lock_guard<std::mutex> lock(state().mutex);
  EXPECT_FALSE(state().last_programmatic);
}

}  // namespace
}  // namespace csa::test
