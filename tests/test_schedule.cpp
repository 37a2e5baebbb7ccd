// Short-window schedule rules and the backward grid.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include "compressor/grad_ape_policy.hpp"
#include "common/error.hpp"
#include "csa/csa.hpp"
#include "csa_params.h"
#include "schedule/short_window.hpp"

namespace csa::test {
namespace {

// The tail's backward holds whole rows: one column block, at most 8 row lanes within the
// static shared memory; grad_ape (and grad_w) in the plain rule's form (one launch by default)
// where the CTA has row lanes, else the fixed order.
TEST(ShortWindowSchedule, TailBackwardHoldsWholeRowsAndFoldsRowLanesBeforeAtomics) {
  Config c{4, 512, 2};
  c.tail.norm = true;
  auto s = schedule::select_short_window(c);
  EXPECT_EQ(s.backward_tx * s.backward_vec, 512);
  EXPECT_EQ(s.backward_ty, 1);
  EXPECT_FALSE(compressor::short_window_grad_ape(s).atomic);
  c.head_dim = 128;
  s = schedule::select_short_window(c);
  EXPECT_EQ(s.backward_tx, 64);
  EXPECT_EQ(s.backward_ty, 4);
  Config plain = c;
  plain.tail = TailShape{};
  const auto p = schedule::select_short_window(plain);
  EXPECT_EQ(s.fixed_order_default, p.fixed_order_default);
  EXPECT_EQ(s.one_launch, p.one_launch);
  EXPECT_TRUE(compressor::short_window_grad_ape(s).atomic);
  c.head_dim = 512;
  EXPECT_THROW(schedule::select_short_window(c, std::string("ty=2")), Error);
  c.tail = TailShape{};
  EXPECT_EQ(schedule::select_short_window(c, std::string("ty=2")).backward_ty, 2);
}

// A tail row that fills the CTA (head_dim 512, 2 columns a thread) takes 4 columns a thread
// where that gives two row lanes within the shared memory (windows of up to 6 slots): grad_ape
// and grad_w folded in the CTA, then atomics in one launch. Named bv or ty keep theirs.
TEST(ShortWindowSchedule, TailBackwardWidensItsVectorForTwoRowLanesWhereTheyFit) {
  for (const Config shape : {Config{2, 512, 2}, Config{3, 512, 2}, Config{4, 512, 1}}) {
    Config c = shape;
    c.tail.norm = true;
    c.tail.rope_dim = 64;
    const auto s = schedule::select_short_window(c);
    SCOPED_TRACE(s.describe());
    EXPECT_EQ(s.backward_vec, 4);
    EXPECT_EQ(s.backward_tx, 128);
    EXPECT_EQ(s.backward_ty, 2);
    EXPECT_TRUE(compressor::short_window_grad_ape(s).atomic);
    EXPECT_EQ(schedule::select_short_window(c, std::string("bv=2")).backward_ty, 1);
    const auto one_lane = schedule::select_short_window(c, std::string("ty=1"));
    EXPECT_EQ(one_lane.backward_vec, 2);
    EXPECT_EQ(one_lane.backward_ty, 1);
  }
  // Windows of 7 slots and more: two lanes' folds exceed 48 KB, one row lane a CTA stays.
  for (const Config shape : {Config{4, 512, 2}, Config{8, 512, 1}}) {
    Config c = shape;
    c.tail.norm = true;
    const auto s = schedule::select_short_window(c);
    EXPECT_EQ(s.backward_vec, 2) << s.describe();
    EXPECT_EQ(s.backward_ty, 1) << s.describe();
    EXPECT_FALSE(compressor::short_window_grad_ape(s).atomic);
  }
}

TEST(ShortWindowSchedule, VectorisesEvenHeadDimsOnly) {
  EXPECT_EQ(schedule::select_short_window({4, 65, 2}).forward_vec, 1);
  EXPECT_EQ(schedule::select_short_window({4, 65, 2}).backward_vec, 1);
  EXPECT_EQ(schedule::select_short_window({4, 128, 2}).forward_vec, 2);
  EXPECT_EQ(schedule::select_short_window({4, 128, 2}).backward_vec, 2);
  EXPECT_EQ(schedule::select_short_window({16, 128, 2}).backward_vec, 1);  // wide window
}

TEST(ShortWindowSchedule, ReductionLanesFollowTheMeasuredRuleAndCanBeOverridden) {
  EXPECT_EQ(schedule::select_short_window({4, 128, 2}).reduce_lanes, 16);
  EXPECT_EQ(schedule::select_short_window({2, 128, 2}).reduce_lanes, 16);
  EXPECT_EQ(schedule::select_short_window({4, 512, 2}).reduce_lanes, 16);
  EXPECT_EQ(schedule::select_short_window({2, 512, 2}).reduce_lanes, 8);
  EXPECT_EQ(schedule::select_short_window({4, 128, 2}, std::string("rl=32")).reduce_lanes, 32);
  EXPECT_THROW(schedule::select_short_window({4, 128, 2}, std::string("rl=3")), Error);
  EXPECT_THROW(schedule::select_short_window({4, 128, 2}, std::string("rl=64")), Error);
  // The tail's fixed order at one row lane a CTA reads one partial per CTA: 32 lanes.
  Config tail{4, 512, 2};
  tail.tail.norm = true;
  EXPECT_EQ(schedule::select_short_window(tail).reduce_lanes, 32);
  EXPECT_EQ(schedule::select_short_window(tail, std::string("rl=8")).reduce_lanes, 8);
}

TEST(ShortWindowSchedule, BackwardResidencyTargetIsTheCompilersUnlessOverridden) {
  EXPECT_EQ(schedule::select_short_window({4, 512, 2}).backward_min_ctas, 0);
  const auto s = schedule::select_short_window({4, 512, 2}, std::string("bmin=3"));
  EXPECT_EQ(s.backward_min_ctas, 3);
  EXPECT_NE(s.describe().find("bmin=3"), std::string::npos) << s.describe();
  // 256 threads a CTA: at most 8 fit one SM's 2048 threads.
  EXPECT_NO_THROW(schedule::select_short_window({4, 512, 2}, std::string("bmin=8")));
  EXPECT_THROW(schedule::select_short_window({4, 512, 2}, std::string("bmin=9")), Error);
  EXPECT_THROW(schedule::select_short_window({4, 512, 2}, std::string("tx=32,ty=32,bmin=3")),
               Error);
}

TEST(ShortWindowSchedule, LargeBackwardCallsOfOtherLayoutsAndTypesTakeTheResidentKernel) {
  const Config c{4, 512, 2};  // a window of 8 slots
  const auto s = schedule::select_short_window(c);
  EXPECT_EQ(s.backward_resident_ctas, 3);
  EXPECT_EQ(schedule::select_short_window({2, 512, 2}).backward_resident_ctas, 0);  // 4 slots
  EXPECT_EQ(schedule::select_short_window({8, 512, 2}).backward_resident_ctas, 0);  // 16 slots
  EXPECT_EQ(schedule::select_short_window({8, 128, 1}).backward_resident_ctas, 3);
  // Packed bf16 keeps one backward kernel; every other type and layout gets the second.
  EXPECT_EQ(schedule::backward_resident_ctas_for(s, c, csa_kernel::kLayoutThdPacked), 0);
  for (int layout : {csa_kernel::kLayoutThdStrided, csa_kernel::kLayoutSbhd})
    EXPECT_EQ(schedule::backward_resident_ctas_for(s, c, layout), 3);
  Config f16 = c;
  f16.dtype = DType::kF16;
  EXPECT_EQ(schedule::backward_resident_ctas_for(s, f16, csa_kernel::kLayoutThdPacked), 3);
  Config f32 = c;
  f32.dtype = DType::kF32;
  for (int layout : {csa_kernel::kLayoutThdPacked, csa_kernel::kLayoutSbhd})
    EXPECT_EQ(schedule::backward_resident_ctas_for(s, f32, layout), 0);
  // By elements: 4,2,512 at 1x4096 tokens (1024 rows) takes it; 4,2,128 at 1x8192 does not.
  EXPECT_TRUE(schedule::backward_takes_resident(s, c, 1024));
  EXPECT_TRUE(schedule::backward_takes_resident(s, c, 6144));
  EXPECT_FALSE(schedule::backward_takes_resident(s, c, s.backward_resident_min_elements / 512 - 1));
  EXPECT_FALSE(schedule::backward_takes_resident(schedule::select_short_window({4, 128, 2}),
                                                 {4, 128, 2}, 2048));
  // Overrides: bres=0 turns it off, bresmin moves the bound; both in describe().
  const auto off = schedule::select_short_window(c, std::string("bres=0"));
  EXPECT_FALSE(schedule::backward_takes_resident(off, c, 1 << 20));
  const auto always = schedule::select_short_window(c, std::string("bresmin=0"));
  EXPECT_TRUE(schedule::backward_takes_resident(always, c, 1));
  EXPECT_NE(always.describe().find("bres=3,bresmin=0"), std::string::npos) << always.describe();
  EXPECT_THROW(schedule::select_short_window(c, std::string("bres=9")), Error);  // 9 x 256 > 2048
  // The rule's target follows an overridden block: 1024 threads fit two CTAs.
  EXPECT_EQ(schedule::select_short_window(c, std::string("tx=32,ty=32")).backward_resident_ctas, 2);
  EXPECT_THROW(schedule::select_short_window(c, std::string("tx=32,ty=32,bres=3")), Error);
}

TEST(ShortWindowSchedule, LargeForwardCallsUseWideVectors) {
  const Config c{4, 512, 2};
  const auto s = schedule::select_short_window(c);
  EXPECT_EQ(schedule::forward_choice(s, c, 1024).vec, 2);
  EXPECT_EQ(schedule::forward_choice(s, c, 6144).vec, 4);
  const auto below = schedule::forward_choice(s, c, s.forward_wide_min_elements / 512 - 1);
  const auto above = schedule::forward_choice(s, c, s.forward_wide_min_elements / 512 + 1);
  EXPECT_FALSE(below.wide);
  EXPECT_EQ(below.vec, 2);
  EXPECT_EQ(below.threads, s.forward_narrow_threads);
  EXPECT_TRUE(above.wide);
  EXPECT_EQ(above.vec, 4);
  EXPECT_EQ(above.threads, s.forward_threads);
  const auto odd = schedule::select_short_window({4, 65, 2});
  EXPECT_EQ(schedule::forward_choice(odd, {4, 65, 2}, 1 << 20).vec, 1);
  const auto two = schedule::select_short_window({4, 6, 2});  // 6 % 4 != 0
  EXPECT_EQ(schedule::forward_choice(two, {4, 6, 2}, 1 << 20).vec, 2);
  // Small CTAs for the narrow forward only.
  EXPECT_EQ(schedule::select_short_window(c, std::string("fnt=256")).forward_narrow_threads, 256);
  EXPECT_THROW(schedule::select_short_window(c, std::string("fnt=16")), Error);
}

// The tail's narrow forward where a row spans two warps: 256 threads below 8 window slots,
// from 8 slots the plain rule's threads; one row where that is more.
TEST(ShortWindowSchedule, TailNarrowForwardThreadsFollowTheWindow) {
  auto threads = [](int ratio, int d, int coff, std::optional<std::string> overrides = {}) {
    Config c{ratio, d, coff};
    c.tail.norm = true;
    c.tail.rope_dim = 64;
    return schedule::select_short_window(c, overrides).forward_narrow_threads;
  };
  const int plain = schedule::select_short_window({4, 128, 2}).forward_narrow_threads;
  EXPECT_EQ(threads(4, 128, 2), plain);
  EXPECT_EQ(threads(2, 128, 2), 256);
  EXPECT_EQ(threads(4, 512, 2), 256);
  EXPECT_EQ(threads(2, 512, 2), 256);
  EXPECT_EQ(threads(4, 128, 2, "fnt=64"), 64);
  EXPECT_EQ(threads(2, 128, 2, "fnt=128"), 128);
}

TEST(ShortWindowSchedule, BlocksStayWithinLimits) {
  for (int d : {1, 2, 65, 128, 512, 4095, 4096})
    for (int ratio : {1, 4, 16})
      for (int coff : {1, 2}) {
        const auto s = schedule::select_short_window({ratio, d, coff});
        EXPECT_LE(s.backward_tx * s.backward_ty, 1024);
        EXPECT_LE(s.backward_tx, d / s.backward_vec);
        EXPECT_EQ(d % s.forward_vec, 0);
        EXPECT_EQ(d % s.forward_wide_vec, 0);
        EXPECT_EQ(d % s.backward_vec, 0);
      }
}

TEST(ShortWindowSchedule, BackwardGridCoversEveryRow) {
  for (std::int64_t rows : {0LL, 1LL, 7LL, 1024LL, 6144LL, 100000LL, (1LL << 31) / 4096})
    for (int d : {65, 128, 4096}) {
      const auto s = schedule::select_short_window({4, d, 2});
      const auto g = schedule::backward_grid(s, {4, d, 2}, rows, 132, 3);
      EXPECT_GE(static_cast<std::int64_t>(g.grid_y) * g.rows_per_cta, rows);
      EXPECT_LE(g.grid_y, 65535);
      EXPECT_GE(g.grid_y, 1);
      EXPECT_EQ(g.rows_per_cta % s.backward_ty, 0);
      EXPECT_GE(static_cast<std::int64_t>(g.grid_x) * s.backward_tx * s.backward_vec, d);
    }
}

TEST(ShortWindowSchedule, ResidentCtasFollowTheTightestLimit) {
  const schedule::SmLimits h100;  // 64K registers, 2048 threads, 32 CTAs, 228 KB
  EXPECT_EQ(schedule::resident_ctas(h100, 256, 32, 0), 8);  // threads
  EXPECT_EQ(schedule::resident_ctas(h100, 256, 80, 0), 3);  // registers: 80*256 = 20480
  EXPECT_EQ(schedule::resident_ctas(h100, 256, 255, 0), 1);
  EXPECT_EQ(schedule::resident_ctas(h100, 64, 16, 0), 32);       // CTA slots
  EXPECT_EQ(schedule::resident_ctas(h100, 128, 32, 100000), 2);  // shared memory
}

TEST(ShortWindowSchedule, OverrideIsValidated) {
  const auto s =
      schedule::select_short_window({4, 128, 2}, std::string("fv=4,bv=1,tx=32,ty=8,fixed=1"));
  EXPECT_EQ(s.forward_vec, 4);
  EXPECT_EQ(s.backward_vec, 1);
  EXPECT_EQ(s.backward_tx, 32);
  EXPECT_EQ(s.backward_ty, 8);
  EXPECT_TRUE(s.fixed_order_default);
  EXPECT_TRUE(s.one_launch);  // the rule's choice stays where the override is silent
  const auto two_launches = schedule::select_short_window({4, 128, 2}, std::string("one=0"));
  EXPECT_FALSE(two_launches.one_launch);
  EXPECT_NE(two_launches.describe().find("one=0"), std::string::npos);
  EXPECT_THROW(schedule::select_short_window({4, 65, 2}, std::string("fv=2")), Error);
  EXPECT_THROW(schedule::select_short_window({4, 128, 2}, std::string("nope=1")), Error);
  EXPECT_THROW(schedule::select_short_window({4, 128, 2}, std::string("fv")), Error);
}

// `csa schedule select` reports how a short-window backward sums grad_ape: atomically in one
// launch by default; the head_dim-128 configurations (fixed order by default) only where the
// call has claim words (and, captured, a CTA has `cap` rows x slots of work: 0 by default).
TEST(ShortWindowSchedule, SelectionSaysHowGradApeIsSummed) {
  RuntimeOptions options;
  options.disk_cache = false;  // nothing is compiled here
  Runtime rt(options);
  const ScheduleChoice narrow =
      rt.select_schedule({4, 128, 2}, Direction::kBackward, 1024, "sm_90");
  EXPECT_TRUE(narrow.grad_ape_atomic);
  EXPECT_TRUE(narrow.grad_ape_atomic_needs_claim_words);
  EXPECT_NE(narrow.schedule.find("one=1,cap=0"), std::string::npos) << narrow.schedule;
  const ScheduleChoice wide = rt.select_schedule({4, 512, 2}, Direction::kBackward, 1024, "sm_90");
  EXPECT_TRUE(wide.grad_ape_atomic);
  EXPECT_FALSE(wide.grad_ape_atomic_needs_claim_words);
  const ScheduleChoice forward =
      rt.select_schedule({4, 128, 2}, Direction::kForward, 1024, "sm_90");
  EXPECT_FALSE(forward.grad_ape_atomic);
  EXPECT_FALSE(forward.grad_ape_atomic_needs_claim_words);
}

}  // namespace
}  // namespace csa::test

// The JSON schedule table: embedded tables, every rejection, bucket boundaries, launch-only
// fields outside the cache key.
#include "csa_params.h"
#include "compressor/kernel_spec.hpp"
#include "compressor/kernel_templates.hpp"
#include "schedule/table.hpp"

namespace csa::test {
namespace {

std::string table_text(const std::string& bucket_override = "", const std::string& extra = "") {
  const std::string bucket = bucket_override.empty()
                                 ? R"({"max_rows": null, "vec": 2, "cols": 32, "threads": 256,
                                       "serial": false, "fast_exp": true, "rows_per_cta": 0})"
                                 : bucket_override;
  return R"({"schema_version": 1, "arch": "sm_90", "origin": "test",)" + extra +
         R"( "entries": [{"family": "long_window", "direction": "backward", "coff": 2,
             "head_dim": [1, 4096], "ratio": [17, 256], "buckets": [)" +
         bucket + "]}]}";
}

void expect_rejected(const std::string& text, const std::string& fragment) {
  try {
    schedule::parse_schedule_table(text, "t.json");
    ADD_FAILURE() << "accepted; expected an error naming " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("t.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(ScheduleTable, EmbeddedTablesLoadForEveryShippedArch) {
  const auto set = schedule::ScheduleSet::embedded();
  for (const char* arch : {"sm_80", "sm_90", "sm_100"}) {
    const auto* t = set.table_for(arch);
    ASSERT_NE(t, nullptr) << arch;
    EXPECT_EQ(t->arch, arch);
    EXPECT_FALSE(t->entries.empty());
  }
  EXPECT_EQ(set.table_for("sm_89")->arch, "sm_80");  // newest older table
  EXPECT_EQ(set.table_for("sm_120")->arch, "sm_100");
  const auto again =
      schedule::parse_schedule_table(schedule::to_json(*set.table_for("sm_90")), "x");
  EXPECT_EQ(schedule::to_json(again), schedule::to_json(*set.table_for("sm_90")));
}

TEST(ScheduleTable, RejectsMalformedTablesNamingTheField) {
  EXPECT_NO_THROW(schedule::parse_schedule_table(table_text(), "t.json"));
  expect_rejected("{", "not valid JSON");
  expect_rejected(R"({"arch": "sm_90", "entries": []})", "schema_version: missing");
  expect_rejected(R"({"schema_version": 2, "arch": "sm_90", "entries": []})", "schema_version");
  expect_rejected(R"({"schema_version": 1, "arch": "gpu", "entries": []})", "arch");
  expect_rejected(table_text("", R"( "colour": 1,)"), "colour: unknown field");
  auto bucket = [](const std::string& fields) { return R"({"max_rows": null, )" + fields + "}"; };
  const std::string rest = R"("serial": false, "fast_exp": false)";
  expect_rejected(table_text(bucket(R"("vec": 3, "cols": 32, "threads": 256, )" + rest)),
                  "entries[0].buckets[0].vec");
  expect_rejected(table_text(bucket(R"("vec": 2, "cols": 24, "threads": 256, )" + rest)),
                  "entries[0].buckets[0].cols");
  expect_rejected(table_text(bucket(R"("vec": 2, "cols": 64, "threads": 32, )" + rest)),
                  "entries[0].buckets[0].threads");
  expect_rejected(
      table_text(
          bucket(R"("vec": 2, "cols": 32, "threads": 256, "serial": true, "fast_exp": false)")),
      "serial backward needs");
  EXPECT_NO_THROW(schedule::parse_schedule_table(
      table_text(bucket(
          R"("form": "staged", "vec": 2, "cols": 32, "threads": 256, "serial": true, "fast_exp": false)")),
      "t.json"));
  expect_rejected(
      table_text(bucket(R"("form": "tiles", "vec": 2, "cols": 32, "threads": 256, )" + rest)),
      "entries[0].buckets[0].form");
  expect_rejected(
      table_text(bucket(R"("vec": 2, "cols": 32, "threads": 256, "serial": 1, "fast_exp": false)")),
      "entries[0].buckets[0].serial");
  expect_rejected(table_text(bucket(R"("vec": 2, "cols": 32, "threads": 256)")),
                  "entries[0].buckets[0].serial: missing");
  expect_rejected(
      table_text(bucket(R"("vec": 2, "cols": 32, "threads": 256, "rows_per_cta": -1, )" + rest)),
      "rows_per_cta");
  // A valid bucket with one more field, `key`: `value` (JSON text).
  auto with_field = [&](const std::string& key, const std::string& value) {
    return table_text(
        bucket(R"("vec": 2, "cols": 32, "threads": 256, ")" + key + "\": " + value + ", " + rest));
  };
  for (const char* stages : {"0", "5", "true"})
    expect_rejected(with_field("stages", stages), "entries[0].buckets[0].stages");
  expect_rejected(
      table_text(bucket(R"("form": "staged", "vec": 2, "cols": 32, "threads": 256, "stages": 2, )" +
                        rest)),
      "the staged form has no ring");
  EXPECT_NO_THROW(schedule::parse_schedule_table(
      table_text(bucket(R"("vec": 2, "cols": 32, "threads": 256, "stages": 2, )" + rest)),
      "t.json"));
  for (const char* form : {"\"atomics\"", "true", "1"})
    expect_rejected(with_field("grad_ape", form), "entries[0].buckets[0].grad_ape");
  expect_rejected(
      table_text(bucket(
          R"("form": "staged", "vec": 2, "cols": 32, "threads": 256, "grad_ape": "atomic", )" +
          rest)),
      "the staged form has no atomic grad_ape");
  for (const char* form : {"atomic", "fixed_order"}) {
    const auto t = schedule::parse_schedule_table(
        with_field("grad_ape", std::string("\"") + form + "\""), "t.json");
    EXPECT_EQ(t.entries.at(0).buckets.at(0).schedule.atomic_ape, std::string(form) == "atomic");
  }
  const std::string b = R"("vec": 2, "cols": 32, "threads": 256, )" + rest;
  expect_rejected(table_text(R"({"max_rows": 64, )" + b + "}"), "last bucket must be unbounded");
  expect_rejected(table_text(R"({"max_rows": null, )" + b + R"(}, {"max_rows": null, )" + b + "}"),
                  "entries[0].buckets[0].max_rows");
  expect_rejected(table_text(R"({"max_rows": 64, )" + b + R"(}, {"max_rows": 64, )" + b +
                             R"(}, {"max_rows": null, )" + b + "}"),
                  "entries[0].buckets[1].max_rows: must increase");
  std::string t = table_text();
  expect_rejected(std::string(t).replace(t.find("\"backward\""), 10, "\"sideways\""), "direction");
  expect_rejected(std::string(t).replace(t.find("\"long_window\""), 13, "\"short_window\""),
                  "entries[0].family");
  expect_rejected(std::string(t).replace(t.find("[1, 4096]"), 9, "[9, 4]"), "entries[0].head_dim");
  expect_rejected(std::string(t).replace(t.find("[17, 256]"), 9, "[17, 300]"), "entries[0].ratio");
  expect_rejected(table_text("", R"( "routing": [{"coff": 1, "head_dim": [1, 4096],
                                     "long_window_min_ratio": 40}],)"),
                  "routing[0].long_window_min_ratio");
}

TEST(ScheduleTable, SelectsBucketsAtEveryBoundary) {
  const std::string b =
      R"("vec": 2, "cols": 32, "threads": 256, "serial": false, "fast_exp": false)";
  auto set = schedule::ScheduleSet::embedded();
  set.add(schedule::parse_schedule_table(
      table_text(R"({"max_rows": 0, )" + b + R"(}, {"max_rows": 64, )" + b +
                 R"(}, {"max_rows": 256, )" + b + R"(}, {"max_rows": null, )" + b + "}"),
      "t.json"));
  const Config c{128, 512, 2};
  const std::vector<std::pair<std::int64_t, int>> expected = {
      {0, 0}, {1, 1}, {64, 1}, {65, 2}, {256, 2}, {257, 3}, {1 << 20, 3}};
  for (const auto& [rows, bucket] : expected) {
    const auto sel = set.select(c, Direction::kBackward, rows, "sm_90");
    EXPECT_EQ(sel.bucket, bucket) << rows << " rows";
    EXPECT_LE(sel.rows_min, rows);
    EXPECT_TRUE(sel.rows_max < 0 || rows <= sel.rows_max);
  }
  // No forward entry in this table: the built-in rule.
  EXPECT_EQ(set.select(c, Direction::kForward, 10, "sm_90").entry, -1);
  // Routing: ratio 16 stays short-window, 17 goes long.
  EXPECT_EQ(set.route({16, 512, 2}, "sm_90"), Family::kShortWindow);
  EXPECT_EQ(set.route({17, 512, 2}, "sm_90"), Family::kLongWindow);
}

// Entries keyed on element type and layout win over unkeyed ones for the calls they name, in
// any table order; other calls keep the unkeyed entry.
TEST(ScheduleTable, EntriesKeyedOnElementTypeAndLayoutServeTheirCallsOnly) {
  auto entry = [](const std::string& keys, int cols) {
    return R"({"family": "long_window", "direction": "forward", "coff": 1, "head_dim": [1, 4096],
               "ratio": [17, 256],)" +
           keys + R"( "buckets": [{"max_rows": null, "vec": 2, "cols": )" + std::to_string(cols) +
           R"(, "threads": 256, "serial": false, "fast_exp": true}]})";
  };
  const std::string table = R"({"schema_version": 1, "arch": "sm_90", "entries": [)" +
                            entry(R"("dtype": "fp32",)", 16) + ", " + entry("", 64) + ", " +
                            entry(R"("dtype": "fp32", "layout": "sbhd",)", 8) + ", " +
                            entry(R"("layout": "sbhd",)", 32) + "]}";
  auto set = schedule::ScheduleSet::embedded();
  set.add(schedule::parse_schedule_table(table, "t.json"));
  auto cols = [&](DType dtype, Layout layout) {
    Config c{128, 512, 1};
    c.dtype = dtype;
    c.layout = layout;
    return set.select(c, Direction::kForward, 1000, "sm_90").schedule.cols;
  };
  EXPECT_EQ(cols(DType::kBf16, Layout::kThd), 64);
  EXPECT_EQ(cols(DType::kF16, Layout::kThd), 64);
  EXPECT_EQ(cols(DType::kF32, Layout::kThd), 16);
  EXPECT_EQ(cols(DType::kBf16, Layout::kSbhd), 32);
  EXPECT_EQ(cols(DType::kF32, Layout::kSbhd), 8);
  // The keys survive a round trip, and unkeyed entries stay unkeyed.
  const auto again =
      schedule::parse_schedule_table(schedule::to_json(*set.table_for("sm_90")), "round trip");
  ASSERT_EQ(again.entries.size(), 4U);
  EXPECT_EQ(again.entries[0].dtype, DType::kF32);
  EXPECT_FALSE(again.entries[0].layout.has_value());
  EXPECT_FALSE(again.entries[1].dtype.has_value());
  EXPECT_EQ(again.entries[3].layout, Layout::kSbhd);
  // Unknown values are refused by name.
  std::string t = table_text();
  const auto at = t.find("\"ratio\"");
  expect_rejected(std::string(t).insert(at, R"("dtype": "fp8", )"), "entries[0].dtype");
  expect_rejected(std::string(t).insert(at, R"("dtype": 2, )"), "entries[0].dtype");
  expect_rejected(std::string(t).insert(at, R"("layout": "bshd", )"), "entries[0].layout");
}

// Entries keyed on a fused tail serve tail calls only: the exact tail over "any", "any" over
// an unkeyed entry; plain calls never take a tail entry.
TEST(ScheduleTable, EntriesKeyedOnATailServeTailCallsOnly) {
  auto entry = [](const std::string& keys, int cols) {
    return R"({"family": "long_window", "direction": "backward", "coff": 1, "head_dim": [1, 4096],
               "ratio": [17, 256],)" +
           keys + R"( "buckets": [{"max_rows": null, "vec": 2, "cols": )" + std::to_string(cols) +
           R"(, "threads": 256, "serial": false, "fast_exp": true}]})";
  };
  const std::string table = R"({"schema_version": 1, "arch": "sm_90", "entries": [)" +
                            entry(R"("tail": "norm+rope64",)", 16) + ", " +
                            entry(R"("tail": "any",)", 8) + ", " + entry("", 64) + ", " +
                            entry(R"("tail": "any", "dtype": "fp32",)", 4) + "]}";
  auto set = schedule::ScheduleSet::embedded();
  set.add(schedule::parse_schedule_table(table, "t.json"));
  auto select = [&](const TailShape& tail, DType dtype) {
    Config c{128, 512, 1};
    c.dtype = dtype;
    c.tail = tail;
    return set.select(c, Direction::kBackward, 1000, "sm_90");
  };
  TailShape norm_rope;
  norm_rope.norm = true;
  norm_rope.rope_dim = 64;
  TailShape norm_only;
  norm_only.norm = true;
  TailShape half = norm_rope;
  half.rope_interleaved = false;
  EXPECT_EQ(select(TailShape{}, DType::kBf16).schedule.cols, 64);
  EXPECT_EQ(select(TailShape{}, DType::kF32).schedule.cols, 64);  // "any" needs a tail
  EXPECT_EQ(select(norm_rope, DType::kBf16).schedule.cols, 16);
  EXPECT_EQ(select(norm_only, DType::kBf16).schedule.cols, 8);
  EXPECT_EQ(select(half, DType::kBf16).schedule.cols, 8);       // "norm+rope64-half" is not named
  EXPECT_EQ(select(norm_rope, DType::kF32).schedule.cols, 16);  // the exact tail ranks first
  EXPECT_EQ(select(norm_only, DType::kF32).schedule.cols, 4);
  // The key survives a round trip; unkeyed entries stay unkeyed.
  const auto again =
      schedule::parse_schedule_table(schedule::to_json(*set.table_for("sm_90")), "round trip");
  ASSERT_EQ(again.entries.size(), 4U);
  EXPECT_EQ(again.entries[0].tail, std::optional<std::string>("norm+rope64"));
  EXPECT_EQ(again.entries[1].tail, std::optional<std::string>("any"));
  EXPECT_FALSE(again.entries[2].tail.has_value());
  // A tail key that is not a tail name is refused by name.
  std::string t = table_text();
  const auto at = t.find("\"ratio\"");
  expect_rejected(std::string(t).insert(at, R"("tail": "none", )"), "entries[0].tail");
  expect_rejected(std::string(t).insert(at, R"("tail": "", )"), "entries[0].tail");
  expect_rejected(std::string(t).insert(at, R"("tail": true, )"), "entries[0].tail");
  expect_rejected(std::string(t).insert(at, R"("tail": "rope63", )"), "entries[0].tail");
  expect_rejected(std::string(t).insert(at, R"("tail": "hadamard+norm", )"), "entries[0].tail");
  expect_rejected(std::string(t).insert(at, R"("tail": "norm+", )"), "entries[0].tail");
  expect_rejected(std::string(t).insert(at, R"("tail": "rmsnorm", )"), "entries[0].tail");
  EXPECT_NO_THROW(schedule::parse_schedule_table(
      std::string(t).insert(at, R"("tail": "norm-bf16+rope64-half+hadamard", )"), "t.json"));
}

TEST(KernelTemplates, NameExpressionsComeFromTheTemplateDescriptions) {
  namespace kt = compressor::kernel_templates;
  compressor::ModuleBuilder m("csa_kernel::Io<0,0,0>,4,2,128");
  EXPECT_EQ(m.add(kt::kShortWindowBackward, 2, 32, 8, true, 0, 0), 0);
  EXPECT_EQ(m.add(kt::kApeReduce, 8), 1);
  EXPECT_EQ(m.add(kt::kShortWindowBackward, 2, 32, 8, true, 0, 0), 0);  // named twice: one slot
  EXPECT_EQ(m.add(kt::kReferenceForward), 2);
  ASSERT_EQ(m.names().size(), 3u);
  EXPECT_EQ(m.names()[0],
            "csa_kernel::short_window_backward<csa_kernel::Io<0,0,0>,4,2,128,2,32,8,true,0,0>");
  EXPECT_EQ(m.names()[1], "csa_kernel::ape_reduce<8>");  // unshaped
  EXPECT_EQ(m.names()[2], "csa_kernel::reference_forward<csa_kernel::Io<0,0,0>,4,2,128>");
  EXPECT_EQ(m.source(),
            "#include \"short_window.cuh\"\n#include \"ape_reduce.cuh\"\n"
            "#include \"reference.cuh\"\n");
  // A resident instance is named in its default form; fitting renders the rest from its prefix.
  compressor::ModuleBuilder resident("csa_kernel::Io<0,0,0>,4,2,128");
  EXPECT_EQ(resident.add_resident(kt::kShortWindowBackward, 256, 2, 2, 32, 8, true), 0);
  EXPECT_EQ(resident.names()[0],
            "csa_kernel::short_window_backward<csa_kernel::Io<0,0,0>,4,2,128,2,32,8,true,2,0>");
  const auto residency = resident.residency();
  ASSERT_EQ(residency.size(), 1u);
  ASSERT_TRUE(residency[0].has_value());
  EXPECT_EQ(residency[0]->prefix,
            "csa_kernel::short_window_backward<csa_kernel::Io<0,0,0>,4,2,128,2,32,8,true,");
  EXPECT_EQ(residency[0]->min_ctas, 2);
  EXPECT_EQ(residency[0]->threads, 256);
  EXPECT_EQ(residency[0]->forms, csa_kernel::kShortWindowBackwardForms);
  resident.add_resident(kt::kShortWindowForward, 128, 0, 4, 128);
  EXPECT_EQ(resident.residency()[1]->prefix,
            "csa_kernel::short_window_forward<csa_kernel::Io<0,0,0>,4,2,128,4,128,");
  EXPECT_EQ(resident.residency()[1]->forms, 1);
  compressor::ModuleBuilder utility;
  utility.add(kt::kCheckOffsets);
  EXPECT_EQ(utility.names().front(), "csa_kernel::check_offsets");  // not a template
}

TEST(KernelTemplates, ModulesNameEveryKernelTheirLaunchesTake) {
  const Config c{4, 128, 2};
  const auto& names_of = [](const compressor::ModuleSpec& s) { return s.request.name_expressions; };
  const auto sw = compressor::make_module_spec(c, csa_kernel::kLayoutSbhd, Family::kShortWindow,
                                               schedule::select_short_window(c), "sm_90", {});
  const auto& s = sw.slots.short_window;
  const auto names = names_of(sw);
  for (int slot : {s.forward, s.forward_wide, s.backward_fixed, s.backward_atomic, s.ape_reduce}) {
    ASSERT_GE(slot, 0);
    ASSERT_LT(slot, static_cast<int>(names.size()));
  }
  EXPECT_NE(names[static_cast<std::size_t>(s.backward_fixed)].find(",true,0,0>"),
            std::string::npos);
  EXPECT_NE(names[static_cast<std::size_t>(s.backward_atomic)].find(",false,0,0>"),
            std::string::npos);
  EXPECT_NE(names[static_cast<std::size_t>(s.forward)].find("Io<0,2,0>,4,2,128"),
            std::string::npos);  // the SBHD policy
  const auto ref = compressor::make_module_spec(c, csa_kernel::kLayoutThdPacked, Family::kReference,
                                                {}, "sm_90", {});
  EXPECT_EQ(names_of(ref)[static_cast<std::size_t>(ref.slots.reference.grad_ape)],
            "csa_kernel::reference_grad_ape<csa_kernel::Io<0,0,0>,4,2,128>");

  // Long window: a slot for every bucket's kernel, both 16-byte reductions.
  const Config lc{128, 512, 1};
  const auto set = schedule::ScheduleSet::embedded();
  const auto fwd = set.kernels(lc, Direction::kForward, "sm_90");
  const auto bwd = set.kernels(lc, Direction::kBackward, "sm_90");
  const auto lw =
      compressor::make_long_window_spec(lc, csa_kernel::kLayoutThdPacked, fwd, bwd, "sm_90", {});
  for (const auto& f : fwd)
    EXPECT_GE(
        compressor::long_window_slot(lw, lc, csa_kernel::kLayoutThdPacked, f, Direction::kForward),
        0);
  for (const auto& b : bwd)
    EXPECT_GE(
        compressor::long_window_slot(lw, lc, csa_kernel::kLayoutThdPacked, b, Direction::kBackward),
        0);
  EXPECT_EQ(compressor::long_window_slot(lw, lc, csa_kernel::kLayoutSbhd, fwd.front(),
                                         Direction::kForward),
            -1);  // another layout's kernel is not in it
  for (int slot : lw.slots.long_window.ape_reduce_quads) EXPECT_GE(slot, 0);
  EXPECT_GE(lw.slots.long_window.ape_reduce, 0);
}

// The long-window tail backward's row-stats form is a field of backward buckets: parsed and
// written back, named in the schedule, kept by fitting only where it applies (a lanes-form
// backward of a tail with the norm and without the Hadamard transform), and compiled with its
// own I/O policy beside tail_row_stats.
TEST(ScheduleTable, TheLongWindowTailBackwardTakesTheRowStatsFormByTable) {
  auto bucket = [](const std::string& field) {
    return R"({"max_rows": null, "vec": 1, "cols": 64, "threads": 512, "stages": 3,
               "serial": false, "fast_exp": true, "grad_ape": "atomic")" +
           field + "}";
  };
  const auto t = schedule::parse_schedule_table(
      table_text(bucket(R"(, "tail_backward": "row_stats")")), "t.json");
  const schedule::LongWindowSchedule rows = t.entries.at(0).buckets.at(0).schedule;
  EXPECT_TRUE(rows.row_stats);
  EXPECT_NE(rows.describe().find("tail_backward=row_stats"), std::string::npos);
  EXPECT_FALSE(schedule::parse_schedule_table(
                   table_text(bucket(R"(, "tail_backward": "whole_rows")")), "t.json")
                   .entries.at(0)
                   .buckets.at(0)
                   .schedule.row_stats);
  const auto again = schedule::parse_schedule_table(schedule::to_json(t), "round trip");
  EXPECT_TRUE(again.entries.at(0).buckets.at(0).schedule.row_stats);
  for (const char* form : {"\"rows\"", "true", "1"})
    expect_rejected(table_text(bucket(std::string(R"(, "tail_backward": )") + form)),
                    "entries[0].buckets[0].tail_backward");
  expect_rejected(table_text(R"({"max_rows": null, "form": "staged", "vec": 1, "cols": 64,
                                 "threads": 512, "serial": false, "fast_exp": false,
                                 "tail_backward": "row_stats"})"),
                  "the staged form runs no tail");
  std::string forward = table_text(bucket(R"(, "tail_backward": "row_stats")"));
  forward.replace(forward.find("\"backward\""), 10, "\"forward\"");
  expect_rejected(forward, "unknown field");

  Config c{128, 512, 1};
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  const auto bwd = Direction::kBackward;
  EXPECT_TRUE(schedule::fit_long_window(c, rows, "sm_90", bwd).row_stats);
  EXPECT_FALSE(schedule::fit_long_window(c, rows, "sm_90", Direction::kForward).row_stats);
  Config hadamard = c;
  hadamard.tail.hadamard = true;
  EXPECT_FALSE(schedule::fit_long_window(hadamard, rows, "sm_90", bwd).row_stats);
  Config rope_only = c;
  rope_only.tail.norm = false;
  EXPECT_FALSE(schedule::fit_long_window(rope_only, rows, "sm_90", bwd).row_stats);
  EXPECT_FALSE(schedule::fit_long_window(Config{128, 512, 1}, rows, "sm_90", bwd).row_stats);
  // A row-stats kernel is another kernel than its whole-row twin.
  schedule::LongWindowSchedule whole = rows;
  whole.row_stats = false;
  const auto fitted = schedule::fit_long_window(c, rows, "sm_90", bwd);
  EXPECT_FALSE(fitted.same_kernel(schedule::fit_long_window(c, whole, "sm_90", bwd)));

  // The module: the row-stats backward under its I/O policy and tail_row_stats beside it; none
  // where no bucket takes the form.
  const auto set = schedule::ScheduleSet::embedded();
  const auto fwd = set.kernels(c, Direction::kForward, "sm_90");
  const int layout = csa_kernel::kLayoutThdPacked;
  const auto module = compressor::make_long_window_spec(c, layout, fwd, {fitted}, "sm_90", {});
  const auto& names = module.request.name_expressions;
  const int slot = compressor::long_window_slot(module, c, layout, fitted, bwd);
  ASSERT_GE(slot, 0);
  ASSERT_GE(module.slots.long_window.row_stats, 0);
  const std::string policy = fmt::format(
      "csa_kernel::Io<0,0,{}>",
      csa_kernel::tail_row_stats_code(csa_kernel::tail_epilogue(true, true, 64, true, false)));
  EXPECT_NE(names[static_cast<std::size_t>(slot)].find(policy), std::string::npos)
      << names[static_cast<std::size_t>(slot)];
  EXPECT_NE(names[static_cast<std::size_t>(module.slots.long_window.row_stats)].find(
                "tail_row_stats<" + policy),
            std::string::npos);
  const auto whole_module = compressor::make_long_window_spec(
      c, layout, fwd, {schedule::fit_long_window(c, whole, "sm_90", bwd)}, "sm_90", {});
  EXPECT_EQ(whole_module.slots.long_window.row_stats, -1);
  EXPECT_EQ(compressor::long_window_slot(whole_module, c, layout, fitted, bwd), -1);
}

// The sm_90 long-window module of `c` (THD packed) with the forward kernel `forward` and the
// shipped backward ones; `slot` is set to the forward kernel's.
compressor::ModuleSpec module_with_forward(const Config& c,
                                           const schedule::LongWindowSchedule& forward, int& slot) {
  const int layout = csa_kernel::kLayoutThdPacked;
  const auto bwd = schedule::ScheduleSet::embedded().kernels(c, Direction::kBackward, "sm_90");
  auto module = compressor::make_long_window_spec(c, layout, {forward}, bwd, "sm_90", {});
  slot = compressor::long_window_slot(module, c, layout, forward, Direction::kForward);
  return module;
}

// The long-window tail forward's row-kernel form is a field of forward buckets, as the
// backward's row-stats form is of backward ones: tail_rows_forward sits beside its pooling.
TEST(ScheduleTable, TheLongWindowTailForwardTakesTheRowKernelFormByTable) {
  auto table = [](const std::string& direction, const std::string& field) {
    return R"({"schema_version": 1, "arch": "sm_90", "entries": [{"family": "long_window",
               "direction": ")" +
           direction + R"(", "coff": 1, "head_dim": [1, 4096], "ratio": [17, 256],
               "buckets": [{"max_rows": null, "vec": 2, "cols": 64, "threads": 256,
               "serial": false, "fast_exp": true)" +
           field + "}]}]}";
  };
  const auto t =
      schedule::parse_schedule_table(table("forward", R"(, "tail_forward": "row_kernel")"), "t");
  const schedule::LongWindowSchedule split = t.entries.at(0).buckets.at(0).schedule;
  EXPECT_TRUE(split.row_kernel());
  EXPECT_NE(split.describe().find("tail_forward=row_kernel"), std::string::npos);
  EXPECT_TRUE(schedule::parse_schedule_table(schedule::to_json(t), "round trip")
                  .entries.at(0)
                  .buckets.at(0)
                  .schedule.row_kernel());
  EXPECT_FALSE(
      schedule::parse_schedule_table(table("forward", R"(, "tail_forward": "last_slice")"), "t")
          .entries.at(0)
          .buckets.at(0)
          .schedule.row_kernel());
  expect_rejected(table("forward", R"(, "tail_forward": "rows")"),
                  "entries[0].buckets[0].tail_forward");
  expect_rejected(table("backward", R"(, "tail_forward": "row_kernel")"), "unknown field");

  Config c{128, 512, 1};
  c.tail.rope_dim = 64;
  c.tail.hadamard = false;
  const auto fwd = Direction::kForward;
  const auto fitted = schedule::fit_long_window(c, split, "sm_90", fwd);
  EXPECT_TRUE(fitted.row_kernel());  // any tail, the norm or not
  EXPECT_FALSE(schedule::fit_long_window(c, split, "sm_90", Direction::kBackward).row_kernel());
  EXPECT_FALSE(schedule::fit_long_window(Config{128, 512, 1}, split, "sm_90", fwd).row_kernel());
  schedule::LongWindowSchedule last = split;
  last.tail_forward = schedule::LongWindowSchedule::TailForward::kLastSlice;
  EXPECT_FALSE(fitted.same_kernel(schedule::fit_long_window(c, last, "sm_90", fwd)));

  int slot = -1;
  const auto module = module_with_forward(c, fitted, slot);
  ASSERT_GE(slot, 0);
  ASSERT_GE(module.slots.long_window.rows_forward, 0);
  const std::string policy = fmt::format(
      "csa_kernel::Io<0,0,{}>",
      csa_kernel::tail_row_kernel_code(csa_kernel::tail_epilogue(false, true, 64, true, false)));
  const auto& names = module.request.name_expressions;
  EXPECT_NE(names[static_cast<std::size_t>(slot)].find(policy), std::string::npos);
  EXPECT_NE(names[static_cast<std::size_t>(module.slots.long_window.rows_forward)].find(
                "tail_rows_forward<" + policy),
            std::string::npos);
  const auto whole = module_with_forward(c, schedule::fit_long_window(c, last, "sm_90", fwd), slot);
  EXPECT_EQ(whole.slots.long_window.rows_forward, -1);
}

// The cluster form is a forward bucket's field too: kept where a row's column slices make a
// portable cluster (2 to 8) on sm_90 and newer, fitted to the last-slice form elsewhere; its
// kernel takes the cluster code's I/O policy and needs no row kernel.
TEST(ScheduleTable, TheLongWindowTailForwardTakesTheClusterFormWhereClustersRun) {
  const std::string text = R"({"schema_version": 1, "arch": "sm_90", "entries": [{"family":
      "long_window", "direction": "forward", "coff": 1, "head_dim": [1, 4096], "ratio": [17, 256],
      "buckets": [{"max_rows": null, "vec": 2, "cols": 64, "threads": 256, "serial": false,
      "fast_exp": true, "tail_forward": "cluster"}]}]})";
  const auto t = schedule::parse_schedule_table(text, "t");
  const schedule::LongWindowSchedule cluster = t.entries.at(0).buckets.at(0).schedule;
  EXPECT_TRUE(cluster.cluster());
  EXPECT_NE(cluster.describe().find("tail_forward=cluster"), std::string::npos);
  EXPECT_TRUE(schedule::parse_schedule_table(schedule::to_json(t), "round trip")
                  .entries.at(0)
                  .buckets.at(0)
                  .schedule.cluster());

  Config c{128, 512, 1};
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  const auto fwd = Direction::kForward;
  const auto fitted = schedule::fit_long_window(c, cluster, "sm_90", fwd);
  EXPECT_TRUE(fitted.cluster());  // 8 slices of 64 columns
  EXPECT_TRUE(schedule::fit_long_window(c, cluster, "sm_100", fwd).cluster());
  EXPECT_FALSE(schedule::fit_long_window(c, cluster, "sm_80", fwd).cluster());
  schedule::LongWindowSchedule narrow = cluster;
  narrow.cols = 32;  // 16 slices: more than a portable cluster
  EXPECT_FALSE(schedule::fit_long_window(c, narrow, "sm_90", fwd).cluster());
  EXPECT_FALSE(schedule::fit_long_window(Config{128, 64, 1}, cluster, "sm_90", fwd).cluster())
      << "one slice, and no tail";
  Config one_slice = c;
  one_slice.head_dim = 64;
  EXPECT_FALSE(schedule::fit_long_window(one_slice, cluster, "sm_90", fwd).cluster());
  schedule::LongWindowSchedule last = cluster;
  last.tail_forward = schedule::LongWindowSchedule::TailForward::kLastSlice;
  EXPECT_FALSE(fitted.same_kernel(schedule::fit_long_window(c, last, "sm_90", fwd)));

  int slot = -1;
  const auto module = module_with_forward(c, fitted, slot);
  ASSERT_GE(slot, 0);
  EXPECT_EQ(module.slots.long_window.rows_forward, -1);
  const std::string policy = fmt::format(
      "csa_kernel::Io<0,0,{}>",
      csa_kernel::tail_cluster_code(csa_kernel::tail_epilogue(true, true, 64, true, false)));
  EXPECT_NE(module.request.name_expressions[static_cast<std::size_t>(slot)].find(policy),
            std::string::npos);
}

TEST(KernelTemplates, OnlyModulesWithAResidencyTargetCompileTheResidentBackward) {
  const Config c{4, 512, 2};
  const auto s = schedule::select_short_window(c);
  const auto packed = compressor::make_module_spec(c, csa_kernel::kLayoutThdPacked,
                                                   Family::kShortWindow, s, "sm_90", {});
  EXPECT_EQ(packed.slots.short_window.backward_atomic_resident, -1);
  EXPECT_EQ(packed.slots.short_window.backward_fixed_resident, -1);
  const auto sbhd = compressor::make_module_spec(c, csa_kernel::kLayoutSbhd, Family::kShortWindow,
                                                 s, "sm_90", {});
  const auto& names = sbhd.request.name_expressions;
  const auto& slots = sbhd.slots.short_window;
  ASSERT_GE(slots.backward_atomic_resident, 0);
  ASSERT_GE(slots.backward_fixed_resident, 0);
  EXPECT_NE(names[static_cast<std::size_t>(slots.backward_atomic_resident)].find(",false,3,0>"),
            std::string::npos);
  EXPECT_NE(names[static_cast<std::size_t>(slots.backward_fixed_resident)].find(",true,3,0>"),
            std::string::npos);
  EXPECT_EQ(names.size(), packed.request.name_expressions.size() + 2);
}

// The tail's backward (104-124 registers a thread) at windows of 5..8 slots: a resident kernel
// in every module but fp32's and row-strided THD's, in the grad_ape forms the module holds,
// from 2^20 elements.
TEST(KernelTemplates, TheTailsResidentBackwardServesLargeCalls) {
  Config c{4, 512, 2};
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  const auto s = schedule::select_short_window(c);
  EXPECT_EQ(s.backward_resident_ctas, 3);
  EXPECT_EQ(s.backward_resident_min_elements, schedule::kTailResidentMinElements);
  EXPECT_FALSE(schedule::backward_takes_resident(s, c, 1024));  // 1x4096 tokens
  EXPECT_TRUE(schedule::backward_takes_resident(s, c, 2048));   // 1x8192
  const auto spec = compressor::make_module_spec(c, csa_kernel::kLayoutThdPacked,
                                                 Family::kShortWindow, s, "sm_90", {});
  const auto& slots = spec.slots.short_window;
  ASSERT_GE(slots.backward_fixed_resident, 0);
  EXPECT_EQ(slots.backward_atomic_resident, -1);  // one row lane: the fixed order only
  EXPECT_NE(
      spec.request.name_expressions[static_cast<std::size_t>(slots.backward_fixed_resident)].find(
          ",true,3,0>"),
      std::string::npos);
  c.head_dim = 128;  // row lanes: both forms
  const auto narrow = schedule::select_short_window(c);
  const auto both = compressor::make_module_spec(c, csa_kernel::kLayoutThdPacked,
                                                 Family::kShortWindow, narrow, "sm_90", {});
  EXPECT_GE(both.slots.short_window.backward_atomic_resident, 0);
  EXPECT_GE(both.slots.short_window.backward_fixed_resident, 0);
  Config f32 = c;
  f32.dtype = DType::kF32;
  EXPECT_EQ(schedule::backward_resident_ctas_for(narrow, f32, csa_kernel::kLayoutThdPacked), 0);
  // Row-strided THD tails have none (slower there); SBHD tails have it, in every element type
  // but fp32.
  for (DType dtype : {DType::kBf16, DType::kF16}) {
    Config typed = c;
    typed.dtype = dtype;
    EXPECT_EQ(schedule::backward_resident_ctas_for(narrow, typed, csa_kernel::kLayoutThdStrided),
              0);
    EXPECT_EQ(schedule::backward_resident_ctas_for(narrow, typed, csa_kernel::kLayoutSbhd), 3);
    const auto strided = compressor::make_module_spec(typed, csa_kernel::kLayoutThdStrided,
                                                      Family::kShortWindow, narrow, "sm_90", {});
    EXPECT_EQ(strided.slots.short_window.backward_atomic_resident, -1);
    EXPECT_EQ(strided.slots.short_window.backward_fixed_resident, -1);
  }
  Config wide = c;  // 2 slots a window: none
  wide.ratio = 1;
  EXPECT_EQ(schedule::select_short_window(wide).backward_resident_ctas, 0);
}

TEST(ShortWindowSchedule, TheFp16WideForwardHasTheResidencyTarget) {
  Config c{4, 512, 2};
  EXPECT_EQ(schedule::select_short_window(c).forward_wide_min_ctas, 0);  // bf16
  c.dtype = DType::kF16;
  const auto s = schedule::select_short_window(c);
  EXPECT_EQ(s.forward_wide_min_ctas, 3);
  const auto spec = compressor::make_module_spec(c, csa_kernel::kLayoutThdPacked,
                                                 Family::kShortWindow, s, "sm_90", {});
  const auto& names = spec.request.name_expressions;
  EXPECT_NE(names[static_cast<std::size_t>(spec.slots.short_window.forward_wide)].find(",4,256,3>"),
            std::string::npos);  // the wide forward only
  EXPECT_NE(names[static_cast<std::size_t>(spec.slots.short_window.forward)].find(",2,128,0>"),
            std::string::npos);
  EXPECT_EQ(schedule::select_short_window({8, 512, 2, DType::kF16}).forward_wide_min_ctas, 0);
  EXPECT_THROW(schedule::select_short_window(c, std::string("fwctas=9")), Error);  // 9 x 256
  EXPECT_EQ(schedule::select_short_window(c, std::string("ft=1024")).forward_wide_min_ctas, 2);
  EXPECT_NE(schedule::select_short_window(c, std::string("fwctas=2")).describe().find("fwctas=2"),
            std::string::npos);
}

TEST(ScheduleTable, LaunchOnlyFieldsKeepTheCacheKey) {
  const std::string b1 = R"({"max_rows": 100, "vec": 2, "cols": 32, "threads": 256, "serial": false,
                              "fast_exp": true, "rows_per_cta": 0})";
  const std::string b2 = R"({"max_rows": 900, "vec": 2, "cols": 32, "threads": 256, "serial": false,
                              "fast_exp": true, "rows_per_cta": 7})";
  const std::string tail = R"({"max_rows": null, "vec": 2, "cols": 16, "threads": 256,
                                "serial": false, "fast_exp": true})";
  auto key_of = [&](const std::string& first) {
    auto set = schedule::ScheduleSet::embedded();
    set.add(schedule::parse_schedule_table(table_text(first + ", " + tail), "t.json"));
    const Config c{128, 512, 2};
    return compressor::make_long_window_spec(
               c, csa_kernel::kLayoutThdPacked, set.kernels(c, Direction::kForward, "sm_90"),
               set.kernels(c, Direction::kBackward, "sm_90"), "sm_90", {})
        .key.hash;
  };
  EXPECT_EQ(key_of(b1), key_of(b2));
  const std::string b3 = R"({"max_rows": 100, "vec": 2, "cols": 32, "threads": 256, "serial": false,
                              "fast_exp": false, "rows_per_cta": 0})";
  EXPECT_NE(key_of(b1), key_of(b3));  // a compile-time field
  const std::string b4 = R"({"max_rows": 100, "vec": 2, "cols": 32, "threads": 256, "serial": false,
                              "fast_exp": true, "rows_per_cta": 0, "grad_ape": "atomic"})";
  EXPECT_NE(key_of(b1), key_of(b4));  // another kernel, and its fixed-order twin beside it
}

TEST(ScheduleTable, FittingKeepsEveryScheduleLaunchable) {
  schedule::LongWindowSchedule s;
  s.vec = 4;
  s.cols = 64;
  s.threads = 256;
  const auto fwd = Direction::kForward;
  const auto bwd = Direction::kBackward;
  EXPECT_EQ(schedule::fit_long_window({128, 65, 1}, s, "sm_90", fwd).vec, 1);
  EXPECT_EQ(schedule::fit_long_window({128, 6, 1}, s, "sm_90", fwd).vec, 2);
  EXPECT_EQ(schedule::fit_long_window({128, 6, 1}, s, "sm_90", fwd).cols, 8);
  s.staged = true;
  for (const char* arch : {"sm_80", "sm_86", "sm_90", "sm_120"}) {
    const Config big{256, 4096, 2};
    const auto f = schedule::fit_long_window(big, s, arch, bwd);
    EXPECT_LE(schedule::long_window_shared_bytes(big, f), schedule::shared_limit_for_arch(arch));
    EXPECT_EQ(f.threads % f.cols, 0);
  }
  // Lanes form: at least vec window lanes, bounded registers and static shared memory.
  s.staged = false;
  for (int ratio : {17, 32, 128, 256})
    for (int coff : {1, 2})
      for (int d : {1, 65, 128, 4096})
        for (Direction dir : {fwd, bwd}) {
          const auto f = schedule::fit_long_window({ratio, d, coff}, s, "sm_90", dir);
          const int lanes = f.window_lanes();
          const int values = (coff * ratio + lanes - 1) / lanes * f.vec;
          EXPECT_GE(lanes, f.vec);
          EXPECT_LE(values, dir == fwd ? 32 : 16) << ratio << "," << coff << "," << d;
          EXPECT_LE(f.threads, 512);
          EXPECT_EQ(d % f.vec, 0);
        }
}

TEST(ScheduleTable, TunedEntriesRunAsWritten) {
  // Entries for one head_dim and one ratio (the tuned ones) name exactly what the loader runs:
  // no bucket whose vector width, columns, threads or ring the fitting would change.
  const auto set = schedule::ScheduleSet::embedded();
  for (const char* arch : {"sm_80", "sm_90", "sm_100"}) {
    const auto* table = set.table_for(arch);
    ASSERT_NE(table, nullptr) << arch;
    for (std::size_t e = 0; e < table->entries.size(); ++e) {
      const auto& entry = table->entries[e];
      if (entry.head_dim_min != entry.head_dim_max || entry.ratio_min != entry.ratio_max) continue;
      const Config c{entry.ratio_min, entry.head_dim_min, entry.coff};
      for (std::size_t b = 0; b < entry.buckets.size(); ++b) {
        const auto& written = entry.buckets[b].schedule;
        const auto fitted = schedule::fit_long_window(c, written, arch, entry.direction);
        EXPECT_EQ(fitted.vec, written.vec) << arch << " entries[" << e << "].buckets[" << b << "]";
        EXPECT_EQ(fitted.cols, written.cols)
            << arch << " entries[" << e << "].buckets[" << b << "]";
        EXPECT_EQ(fitted.threads, written.threads)
            << arch << " entries[" << e << "].buckets[" << b << "]";
        EXPECT_EQ(fitted.stages, written.stages)
            << arch << " entries[" << e << "].buckets[" << b << "]";
      }
    }
  }
}

TEST(ScheduleTable, TheRingFitsTheHeadDimTheRegistersAndSharedMemory) {
  schedule::LongWindowSchedule s;
  s.vec = 1;
  s.cols = 16;
  s.threads = 256;
  s.stages = 2;
  const auto bwd = Direction::kBackward;
  // 16-byte chunks: head_dim % 8 and at least 8 columns per CTA.
  EXPECT_EQ(schedule::fit_long_window({128, 512, 2}, s, "sm_90", bwd).stages, 2);
  EXPECT_EQ(schedule::fit_long_window({128, 65, 2}, s, "sm_90", bwd).stages, 1);
  EXPECT_EQ(schedule::fit_long_window({128, 4, 2}, s, "sm_90", bwd).stages, 1);
  EXPECT_EQ(schedule::fit_long_window({128, 512, 2}, s, "sm_90", Direction::kForward).stages, 1);
  // 512 threads keep the ring: two CTAs per SM (64 registers) up to 8 values a thread, one
  // (128 registers, ape in registers) above.
  s.threads = 512;
  EXPECT_EQ(schedule::fit_long_window({128, 512, 1}, s, "sm_90", bwd).stages, 2);  // 4 values
  s.cols = 32;
  const auto sixteen = schedule::fit_long_window({128, 512, 2}, s, "sm_90", bwd);
  ASSERT_EQ(sixteen.stages, 2);  // 32 columns, 16 lanes: 16 values a thread
  EXPECT_EQ(schedule::long_window_shared_bytes({128, 512, 2}, sixteen),
            2 * (2 * (256 + 16) * 32 + 32) * 2);
  // Dynamic shared memory: the ring and each thread's ape values; within every arch's limit.
  s.cols = 16;
  s.threads = 256;
  const Config c{128, 512, 2};
  const auto f = schedule::fit_long_window(c, s, "sm_90", bwd);
  // 2 stages x (2 x (256 + 16 rows) x 16 + 16) bf16; ape stays in registers at 256 threads.
  EXPECT_EQ(schedule::long_window_shared_bytes(c, f), 2 * (2 * 272 * 16 + 16) * 2);
  auto wide = s;
  wide.threads = 512;
  const auto w = schedule::fit_long_window(c, wide, "sm_90", bwd);
  ASSERT_EQ(w.stages, 2);  // 16 columns, 32 lanes: 8 values a thread
  // ... plus, above 256 threads, each thread's 8 ape values in shared memory.
  EXPECT_EQ(schedule::long_window_shared_bytes(c, w),
            2 * (2 * (256 + 32) * 16 + 16) * 2 + 8 * 512 * 4);
  s.stages = 4;
  s.cols = 32;
  for (const char* arch : {"sm_80", "sm_86", "sm_90", "sm_120"}) {
    const Config big{256, 4096, 2};
    const auto g = schedule::fit_long_window(big, s, arch, bwd);
    EXPECT_LE(schedule::long_window_shared_bytes(big, g) + g.threads * g.vec * 24,
              schedule::shared_limit_for_arch(arch))
        << arch;
    EXPECT_GE(g.stages, 1);
  }
  // The compile-time stage count names a different kernel.
  ASSERT_EQ(f.stages, 2);
  auto b = f;
  b.stages = 1;
  EXPECT_FALSE(f.same_kernel(b));
}

TEST(ScheduleTable, TheForwardPrefetchesEarlyOnSmallGridsOnly) {
  // 132 SMs, 5 resident CTAs: a wave is 660 CTAs; up to three waves prefetch.
  EXPECT_TRUE(schedule::forward_prefetches_early(1, 132, 5));
  EXPECT_TRUE(schedule::forward_prefetches_early(std::int64_t{3} * 660, 132, 5));
  EXPECT_FALSE(schedule::forward_prefetches_early(std::int64_t{3} * 660 + 1, 132, 5));
  // A kernel reported as holding no CTA counts as one a SM.
  EXPECT_TRUE(schedule::forward_prefetches_early(std::int64_t{3} * 132, 132, 0));
  EXPECT_FALSE(schedule::forward_prefetches_early(std::int64_t{3} * 132 + 1, 132, 0));
}

}  // namespace
}  // namespace csa::test
