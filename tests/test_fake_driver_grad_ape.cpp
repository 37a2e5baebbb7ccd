// The backward's scratch memory and grad_ape forms against the fake driver (no GPU): the
// per-stream workspace, the one-launch atomic form with claim words (eager, captured, set
// aside by prewarm), and the fixed-order reductions' grids.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "csa_params.h"
#include "fake_driver.hpp"
#include "schedule/short_window.hpp"
#include "schedule/table.hpp"

namespace csa::test {
namespace {

TEST_F(FakeDriver, BackwardWorkspaceIsKeptPerStreamAndContext) {
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    FakeRuntime rt;
    rt.service.prewarm(c, 0, Family::kAuto);
    rt.service.prewarm(c, 1, Family::kAuto);
    auto* const other = reinterpret_cast<CUstream>(0x6000);
    // Application streams: one workspace each, found again by the stream's id alone.
    for (int i = 0; i < 3; ++i) rt.service.backward(backward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().allocations, 1);
    rt.service.backward(backward_args(c), other, Family::kAuto);
    EXPECT_EQ(state().allocations, 2);
    // Only the first atomic call's slab of claim words for captured calls asked for one.
    EXPECT_EQ(state().context_id_queries, state().slab_allocations.load())
        << "an application stream needs no context id";
    // The NULL stream exists once per context: one workspace per context.
    for (int i = 0; i < 2; ++i) rt.service.backward(backward_args(c), nullptr, Family::kAuto);
    EXPECT_EQ(state().allocations, 3);
    state().current_device = 1;
    rt.service.backward(backward_args(c), nullptr, Family::kAuto);
    EXPECT_EQ(state().allocations, 4) << "device 1's NULL stream shared device 0's workspace";
    EXPECT_EQ(state().context_id_queries, 3 + state().slab_allocations);
  }
}

// The claim words of one captured call, rounded up: a slab serves this many calls.
constexpr int kCapturedCallsPerSlab = (64 << 10) / 256;

// coff * head_dim >= 512: the default backward sums grad_ape with atomics.
// The atomic backward of `wide` (its default): one launch eagerly, the kernel and the
// fixed-order reduction when deterministic. Captured, with `captured_claim_words` one launch
// with claim words of the call's own, as long as there are some, else (and when no claim words
// are left) a memset of grad_ape (and of the tail's grad_w) and the launch.
void expect_atomic_backward_in_one_launch(const Config& wide, bool captured_claim_words) {
  const auto args = [&](std::uint32_t flags) { return backward_args(wide, flags); };
  const int zeroed = wide.tail.norm ? 2 : 1;  // tensors a call without claim words memsets
  FakeRuntime rt;
  rt.service.prewarm(wide, 0, Family::kAuto);
  // Overwriting: the kernel zeroes grad_ape itself, with the stream's claim words, allocated
  // and zeroed once; then one launch a call. The first call also sets aside a slab of claim
  // words for captured calls, zeroed on the runtime's own stream, which it destroys.
  for (int i = 0; i < 3; ++i) rt.service.backward(args(0), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 3);
  EXPECT_EQ(state().allocations, 1);
  EXPECT_EQ(state().memsets, 1) << "the claim words are zeroed when allocated, not per call";
  EXPECT_EQ(state().slab_allocations, 1);
  EXPECT_EQ(state().slab_memsets, 1);
  EXPECT_EQ(state().own_streams_open, 0);
  // Accumulating: straight into grad_ape, no workspace.
  rt.service.backward(args(kAccumulateGradApe), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 4);
  EXPECT_EQ(state().memsets, 1);
  // Deterministic: the kernel and the fixed-order reduction, partials in their own workspace.
  rt.service.backward(args(kDeterministic), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 6);
  EXPECT_EQ(state().allocations, 2) << "the partials shared the claim words";
  // Another stream: its own claim words.
  rt.service.backward(args(0), reinterpret_cast<CUstream>(0x6000), Family::kAuto);
  EXPECT_EQ(state().launches, 7);
  EXPECT_EQ(state().allocations, 3);
  EXPECT_EQ(state().memsets, 2);
  // Under capture: one launch with the call's own claim words, as many calls as the slab
  // serves (or a memset of grad_ape before each); then a memset of grad_ape and the launch.
  state().capturing = true;
  for (int i = 0; i < kCapturedCallsPerSlab; ++i)
    rt.service.backward(args(0), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 7 + kCapturedCallsPerSlab);
  const int captured_memsets = captured_claim_words ? 0 : kCapturedCallsPerSlab * zeroed;
  EXPECT_EQ(state().memsets, 2 + captured_memsets);
  rt.service.backward(args(0), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 8 + kCapturedCallsPerSlab);
  EXPECT_EQ(state().memsets, 2 + zeroed + captured_memsets) << "no claim words were left";
  EXPECT_EQ(state().allocations, 3);
  EXPECT_EQ(state().slab_allocations, 1) << "a slab was allocated under capture";
  // The next eager call sets aside another slab (where captured calls took some), and captured
  // calls take one launch again.
  state().capturing = false;
  rt.service.backward(args(0), kStream, Family::kAuto);
  EXPECT_EQ(state().slab_allocations, captured_claim_words ? 2 : 1);
  state().capturing = true;
  rt.service.backward(args(0), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 10 + kCapturedCallsPerSlab);
  EXPECT_EQ(state().memsets, 2 + zeroed + captured_memsets + (captured_claim_words ? 0 : zeroed));
  EXPECT_EQ(state().own_streams_open, 0);
}

TEST_F(FakeDriver, ShortWindowAtomicBackwardIsOneLaunch) {
  expect_atomic_backward_in_one_launch({2, 512, 2}, /*captured_claim_words=*/true);
}

// 64 rows of 128,2,512: a bucket the shipped sm_90 table sums atomically.
TEST_F(FakeDriver, LongWindowAtomicBackwardIsOneLaunch) {
  const Config c{128, 512, 2};
  ASSERT_TRUE(schedule::ScheduleSet::embedded()
                  .select(c, Direction::kBackward, 64, "sm_90")
                  .schedule.atomic_ape);
  // 64 rows: 4 rows a CTA here (32 column slices, 16 row groups): claim words under capture.
  expect_atomic_backward_in_one_launch(c, /*captured_claim_words=*/true);
  // The atomic kernel (last template argument true) by default, accumulating and under
  // capture; its fixed-order twin and the reduction for the deterministic call.
  const std::string atomic = "ELb1ELb1EEEv", fixed = "ELb1ELb0EEEv";
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto& l = state().launched;
  ASSERT_EQ(l.size(), 10u + kCapturedCallsPerSlab);
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (i == 4 || i == 5) continue;
    EXPECT_NE(l[i].find("lane_window_backward"), std::string::npos) << l[i];
    EXPECT_NE(l[i].find(atomic), std::string::npos) << "launch " << i << ": " << l[i];
  }
  EXPECT_NE(l[4].find("lane_window_backward"), std::string::npos) << l[4];
  EXPECT_NE(l[4].find(fixed), std::string::npos) << l[4];
  EXPECT_NE(l[5].find("ape_reduce"), std::string::npos) << l[5];
}

// The fused tail's backward sums grad_ape and grad_w as the plain one sums grad_ape: one
// launch by default (both zeroed by the kernel, or memset first where no claim words are left),
// the kernel and the reduction when deterministic.
TEST_F(FakeDriver, TailBackwardIsOneLaunchInBothFamilies) {
  for (Config c : {Config{2, 256, 2}, Config{128, 512, 2}}) {
    SetUp();
    c.tail.norm = true;
    c.tail.rope_dim = 64;
    SCOPED_TRACE(tail_name(c.tail) + " at ratio " + std::to_string(c.ratio));
    expect_atomic_backward_in_one_launch(c, /*captured_claim_words=*/true);
  }
}

// One row lane a CTA (the short-window tail at head_dim 512): the fixed order by default, the
// kernel and the reduction; its module holds no atomic kernel.
TEST_F(FakeDriver, WideShortWindowTailBackwardTakesTheFixedOrder) {
  Config c{4, 512, 2};
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  FakeRuntime rt;
  rt.service.prewarm(c, 0, Family::kAuto);
  rt.service.backward(backward_args(c), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 2);
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto& l = state().launched;
  ASSERT_EQ(l.size(), 2u);
  EXPECT_NE(l[0].find("short_window_backward"), std::string::npos) << l[0];
  EXPECT_NE(l[1].find("ape_reduce"), std::string::npos) << l[1];
}

// The production long-window tail (128,1,512 with the norm and RoPE 64), and a runtime whose
// sm_90 table serves its `direction` ("forward" or "backward") with one bucket of `fields`.
Config production_long_tail() {
  Config c{128, 512, 1};
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  return c;
}
void serve_long_tail_with(FakeRuntime& rt, const std::string& direction,
                          const std::string& fields) {
  rt.service.set_schedule_table(schedule::parse_schedule_table(
      R"({"schema_version": 1, "arch": "sm_90", "entries": [{"family": "long_window",
          "direction": ")" +
          direction + R"(", "coff": 1, "head_dim": [512, 512], "ratio": [128, 128],
          "tail": "norm+rope64", "buckets": [{"max_rows": null, )" +
          fields + "}]}]}",
      "tail table"));
}

// A long-window tail backward whose bucket takes the row-stats form: tail_row_stats first (a warp
// a row), then the row-stats backward, both programmatic and with the row scalars at one place:
// the stream's workspace, after the fixed order's partials when deterministic (then the
// reduction follows).
TEST_F(FakeDriver, LongWindowRowStatsBackwardWritesTheRowScalarsFirst) {
  const Config c = production_long_tail();
  FakeRuntime rt;
  serve_long_tail_with(rt, "backward", R"("vec": 1, "cols": 64, "threads": 512, "stages": 3,
      "serial": false, "fast_exp": true, "rows_per_cta": 0, "grad_ape": "atomic",
      "tail_backward": "row_stats")");
  const BackwardArgs a = backward_args(c);
  ASSERT_EQ(a.total_comp, 64);
  for (const std::uint32_t flags : {0U, static_cast<std::uint32_t>(kDeterministic)}) {
    SCOPED_TRACE(flags == 0 ? "atomic" : "deterministic");
    SetUp();
    BackwardArgs call = a;
    call.flags = flags;
    rt.service.backward(call, kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    const auto& l = state().launched;
    ASSERT_EQ(l.size(), flags == 0 ? 2U : 3U);
    EXPECT_NE(l[0].find("tail_row_stats"), std::string::npos) << l[0];
    EXPECT_EQ(state().grids[0][0], 8U);  // 64 rows, 8 warps a CTA
    EXPECT_EQ(state().grids[0][2], static_cast<unsigned>(compressor::kRowStatsThreads));
    EXPECT_NE(l[1].find("lane_window_backward"), std::string::npos) << l[1];
    const std::string policy = fmt::format(
        "IoILi0ELi0ELi{}E",
        csa_kernel::tail_row_stats_code(csa_kernel::tail_epilogue(true, true, 64, true, false)));
    EXPECT_NE(l[0].find(policy), std::string::npos) << l[0];
    EXPECT_NE(l[1].find(policy), std::string::npos) << l[1];
    const auto& b = state().backward_launches;
    ASSERT_EQ(b.size(), 2U);
    EXPECT_NE(b[0].row_stats, 0U);
    EXPECT_EQ(b[1].row_stats, b[0].row_stats);
    EXPECT_TRUE(b[0].programmatic && b[1].programmatic);
    if (flags == 0) continue;
    EXPECT_NE(l[2].find("ape_reduce"), std::string::npos) << l[2];
    // The row scalars follow the partials: one block of grad_ape's and grad_w's a row group.
    const std::uintptr_t partials =
        static_cast<std::uintptr_t>(state().grids[1][0]) * (128 * 512 + 512) * sizeof(float);
    EXPECT_EQ(b[1].row_stats, b[1].workspace + partials);
  }
}

// A long-window tail forward whose bucket takes the row-kernel form: the pooling, then
// tail_rows_forward over whole rows (2 of head_dim 512 a CTA), programmatic; no arrival words.
TEST_F(FakeDriver, LongWindowRowKernelForwardRunsTheTailInASecondKernel) {
  const Config c = production_long_tail();
  FakeRuntime rt;
  serve_long_tail_with(rt, "forward", R"("vec": 2, "cols": 64, "threads": 256, "serial": false,
      "fast_exp": true, "tail_forward": "row_kernel")");
  ForwardArgs a = forward_args(c);
  const BackwardArgs tail = backward_args(c);
  a.tail = tail.tail;
  a.pooled = fake_ptr<float>(0xc00000);
  ASSERT_EQ(a.total_comp, 64);
  rt.service.forward(a, kStream, Family::kAuto);
  EXPECT_EQ(state().memsets, 0);
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto& l = state().launched;
  ASSERT_EQ(l.size(), 2U);
  const std::string policy = fmt::format(
      "IoILi0ELi0ELi{}E",
      csa_kernel::tail_row_kernel_code(csa_kernel::tail_epilogue(true, true, 64, true, false)));
  EXPECT_NE(l[0].find("lane_window_forward"), std::string::npos) << l[0];
  EXPECT_NE(l[0].find(policy), std::string::npos) << l[0];
  EXPECT_NE(l[1].find("tail_rows_forward"), std::string::npos) << l[1];
  EXPECT_NE(l[1].find(policy), std::string::npos) << l[1];
  EXPECT_EQ(state().grids[0][0], 64U * 8);  // rows x column slices
  EXPECT_EQ(state().grids[1][0], 32U);      // 2 rows a CTA
  EXPECT_EQ(state().grids[1][2], static_cast<unsigned>(compressor::kTailRowsThreads));
  EXPECT_TRUE(state().last_programmatic);
}

// Prewarm (and a plan's prepare) on the current context's device sets aside claim words, so
// that a graph captured before any eager backward launches the atomic backward alone.
TEST_F(FakeDriver, PrewarmSetsAsideClaimWordsForCapturedCalls) {
  const Config wide{2, 512, 2};
  {
    FakeRuntime rt;
    state().current_device = 1;
    rt.service.prewarm(wide, 0, Family::kAuto);
    EXPECT_EQ(state().slab_allocations, 0) << "device 0 is not the current context's";
    state().current_device = 0;
    rt.service.prewarm(wide, 0, Family::kAuto);
    EXPECT_EQ(state().slab_allocations, 1);
    EXPECT_EQ(state().slab_memsets, 1);
    rt.service.prewarm(wide, 0, Family::kAuto);
    EXPECT_EQ(state().slab_allocations, 1) << "a slab with room was replaced";
    state().capturing = true;
    rt.service.backward(backward_args(wide), kStream, Family::kAuto);
    EXPECT_EQ(state().launches, 1);
    EXPECT_EQ(state().memsets, 0) << "the captured call had no claim words";
  }
  SetUp();
  FakeRuntime rt;
  const auto plan = rt.service.record(wide, csa_kernel::kLayoutThdPacked, Family::kAuto, 0);
  EXPECT_EQ(state().slab_allocations, 1);
  state().capturing = true;
  rt.service.backward_with(*plan, backward_args(wide), kStream);
  EXPECT_EQ(state().launches, 1);
  EXPECT_EQ(state().memsets, 0);
}

// Captured, the long-window atomic backward takes claim words of its own however few rows a
// CTA has (one or two here): no memset of grad_ape.
TEST_F(FakeDriver, LongWindowCapturedBackwardTakesClaimWords) {
  const Config c{128, 512, 2};
  FakeRuntime rt;
  rt.service.prewarm(c, 0, Family::kAuto);
  rt.service.backward(backward_args(c), kStream, Family::kAuto);  // eager: sets aside a slab
  ASSERT_EQ(state().slab_allocations, 1);
  const int memsets = state().memsets;
  state().capturing = true;
  for (const std::int64_t rows : {32, 64}) {
    BackwardArgs a = backward_args(c);
    a.total_tokens = rows * c.ratio;
    a.total_comp = rows;
    ASSERT_TRUE(schedule::ScheduleSet::embedded()
                    .select(c, Direction::kBackward, rows, "sm_90")
                    .schedule.atomic_ape);
    // 32 column slices over one wave of 528 CTAs here: 16 row groups, 2 or 4 rows a CTA.
    rt.service.backward(a, kStream, Family::kAuto);
  }
  EXPECT_EQ(state().memsets, memsets);
}

// coff * head_dim < 512: the fixed order by default, yet one launch (one_launch): the atomic
// kernel with claim words, the stream's or, captured, the call's own. Deterministic calls and
// calls captured when no claim words are left run the fixed-order kernel and the reduction.
TEST_F(FakeDriver, NarrowShortWindowBackwardTakesOneLaunchWithClaimWords) {
  const auto s = schedule::select_short_window(kShort);
  ASSERT_TRUE(s.fixed_order_default);
  FakeRuntime rt;
  rt.service.prewarm(kShort, 0, Family::kAuto);
  // 2048 rows (backward_args): 8 rows a CTA (one wave of 4 CTAs per SM at 64 registers);
  // 16384 rows: 32 rows a CTA. Both take one launch while claim words are left.
  BackwardArgs many = backward_args(kShort);
  many.total_tokens = std::int64_t{16384} * kShort.ratio;
  many.total_comp = 16384;
  ASSERT_EQ(s.captured_one_launch_min, 0);
  for (int i = 0; i < 2; ++i) rt.service.backward(backward_args(kShort), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 2);
  EXPECT_EQ(state().memsets, 1) << "the claim words are zeroed once, when allocated";
  rt.service.backward(backward_args(kShort, kDeterministic), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 4);
  state().capturing = true;
  rt.service.backward(backward_args(kShort), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 5) << "one launch under capture, however little work a CTA has";
  for (int i = 1; i < kCapturedCallsPerSlab; ++i) rt.service.backward(many, kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 4 + kCapturedCallsPerSlab);
  rt.service.backward(many, kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 6 + kCapturedCallsPerSlab) << "no claim words were left";
  EXPECT_EQ(state().memsets, 1) << "the captured fixed order needs no memset of grad_ape";
  // The kernel's last three template arguments are FIXED_ORDER, MIN_CTAS and FORM (0 by
  // default).
  const std::string atomic = "ELb0ELi0ELi0EEEv", fixed = "ELb1ELi0ELi0EEEv";
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto& l = state().launched;
  ASSERT_EQ(l.size(), 6u + kCapturedCallsPerSlab);
  for (std::size_t i = 0; i < l.size(); ++i) {
    const bool fixed_order = i == 2 || i + 2 == l.size();
    const bool reduction = i == 3 || i + 1 == l.size();
    if (reduction) {
      EXPECT_NE(l[i].find("ape_reduce"), std::string::npos) << l[i];
      continue;
    }
    EXPECT_NE(l[i].find("short_window_backward"), std::string::npos) << l[i];
    EXPECT_NE(l[i].find(fixed_order ? fixed : atomic), std::string::npos) << i << ": " << l[i];
  }
}

// The grad_ape reduction lets the next kernel in before its programmatic wait only on a grid
// of one wave (132 SMs here, a CTA counted at half an SM's threads at most).
TEST_F(FakeDriver, ReductionLetsTheNextKernelInEarlyOnlyOnOneWave) {
  FakeRuntime rt;
  struct Case {
    Config config;
    std::int64_t rows;
    int one_wave;  // -1: whatever the grid says
  };
  // 4,2,64: 512 elements, 16 CTAs; 16,2,512: 16384 elements in 512 CTAs of 512 threads.
  for (const Case& k : {Case{kShort, 2048, 1}, Case{{16, 512, 2}, 512, 0},
                        Case{{128, 512, 2}, 32, -1}, Case{{128, 512, 1}, 1024, -1}}) {
    BackwardArgs a = backward_args(k.config, kDeterministic);
    a.total_tokens = k.rows * k.config.ratio;
    a.total_comp = k.rows;
    rt.service.backward(a, kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    ASSERT_FALSE(state().reduce_grids.empty());
    const auto& grid = state().reduce_grids.back();
    const unsigned threads = grid[2] * grid[3];
    const int expected = grid[0] <= 132u * std::max(1u, 1024u / threads) ? 1 : 0;
    SCOPED_TRACE("ratio " + std::to_string(k.config.ratio) + ", head_dim " +
                 std::to_string(k.config.head_dim) + ", grid " + std::to_string(grid[0]) + " x " +
                 std::to_string(threads) + " threads");
    EXPECT_EQ(state().reduce_dependents_first.back(), expected);
    if (k.one_wave >= 0) {
      EXPECT_EQ(expected, k.one_wave);
    }
  }
}

// The grad_ape reduction after a long-window backward: the 16-byte kernel (256 threads, 1 or 2
// lanes) up to 16 row groups, the scalar one (32 x 8) beyond; either covers every element.
TEST_F(FakeDriver, LongWindowReductionFitsTheRowGroups) {
  FakeRuntime rt;
  bool scalar = false, quads = false;
  for (const auto& [c, rows] : std::vector<std::pair<Config, std::int64_t>>{
           {{128, 512, 2}, 8}, {{128, 512, 2}, 32}, {{128, 128, 1}, 1024}}) {
    const std::int64_t elements = static_cast<std::int64_t>(c.ratio) * c.coff * c.head_dim;
    BackwardArgs a = backward_args(c, kDeterministic);  // the fixed order, whatever the default
    a.total_tokens = rows * c.ratio;
    a.total_comp = rows;
    rt.service.backward(a, kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    ASSERT_GE(state().grids.size(), 2u);
    const auto& kernel = state().grids[state().grids.size() - 2];
    const auto& reduce = state().grids.back();
    const unsigned groups = kernel[0];
    SCOPED_TRACE("rows " + std::to_string(rows) + ", groups " + std::to_string(groups));
    if (groups <= 16) {
      quads = true;
      EXPECT_EQ(reduce[2] * reduce[3], 256u);
      EXPECT_EQ(reduce[3], groups <= 8 ? 1u : 2u);
      EXPECT_GE(static_cast<std::int64_t>(reduce[0]) * reduce[2] * 4, elements);
    } else {
      scalar = true;
      EXPECT_EQ(reduce[2], 32u);
      EXPECT_EQ(reduce[3], static_cast<unsigned>(compressor::kApeReduceLanes));
      EXPECT_GE(static_cast<std::int64_t>(reduce[0]) * 32, elements);
    }
  }
  EXPECT_TRUE(scalar && quads) << "both kernels should have been chosen once";
}

}  // namespace
}  // namespace csa::test
