// Short-window schedule rules and the backward grid.
#include <gtest/gtest.h>

#include "common/error.hpp"
#include "schedule/short_window.hpp"

namespace csa::test {
namespace {

TEST(ShortWindowSchedule, VectorisesEvenHeadDimsOnly) {
  EXPECT_EQ(schedule::select_short_window({4, 65, 2}).forward_vec, 1);
  EXPECT_EQ(schedule::select_short_window({4, 65, 2}).backward_vec, 1);
  EXPECT_EQ(schedule::select_short_window({4, 128, 2}).forward_vec, 2);
  EXPECT_EQ(schedule::select_short_window({4, 128, 2}).backward_vec, 2);
  EXPECT_EQ(schedule::select_short_window({16, 128, 2}).backward_vec, 1);  // wide window
}

TEST(ShortWindowSchedule, LargeForwardCallsUseWideVectors) {
  const auto s = schedule::select_short_window({4, 512, 2});
  EXPECT_EQ(schedule::forward_vec_for(s, {4, 512, 2}, 1024), 2);
  EXPECT_EQ(schedule::forward_vec_for(s, {4, 512, 2}, 6144), 4);
  EXPECT_EQ(schedule::forward_vec_for(s, {4, 512, 2}, s.forward_wide_min_elements / 512 - 1), 2);
  EXPECT_EQ(schedule::forward_vec_for(s, {4, 512, 2}, s.forward_wide_min_elements / 512 + 1), 4);
  const auto odd = schedule::select_short_window({4, 65, 2});
  EXPECT_EQ(schedule::forward_vec_for(odd, {4, 65, 2}, 1 << 20), 1);
  const auto two = schedule::select_short_window({4, 6, 2});  // 6 % 4 != 0
  EXPECT_EQ(schedule::forward_vec_for(two, {4, 6, 2}, 1 << 20), 2);
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
  EXPECT_THROW(schedule::select_short_window({4, 65, 2}, std::string("fv=2")), Error);
  EXPECT_THROW(schedule::select_short_window({4, 128, 2}, std::string("nope=1")), Error);
  EXPECT_THROW(schedule::select_short_window({4, 128, 2}, std::string("fv")), Error);
}

}  // namespace
}  // namespace csa::test
