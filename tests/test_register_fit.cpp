// Register fitting's rule (src/compressor/register_fit.hpp) on made-up reports: which kernels
// it compiles again, with which residency, and when it leaves a module alone. The compile
// tests check it on real modules (NvrtcCompile.RegisterFitting*).
#include <gtest/gtest.h>

#include "compressor/register_fit.hpp"

namespace csa::compressor {
namespace {

nvrtc::KernelResources kernel(std::string name, int registers, int spill, int stack) {
  nvrtc::KernelResources k;
  k.name = std::move(name);
  k.registers = registers;
  k.spill_store_bytes = spill;
  k.spill_load_bytes = spill;
  k.stack_bytes = stack;
  return k;
}

Residency at(std::string prefix, int min_ctas, int threads = 256) {
  return Residency{std::move(prefix), threads, min_ctas};
}

TEST(RegisterFit, BoundCtasFollowTheRegisterFileAndTheThreadLimit) {
  EXPECT_EQ(register_bound_ctas(48, 256, 2048), 5);
  EXPECT_EQ(register_bound_ctas(60, 256, 2048), 4);  // allocated as 64
  EXPECT_EQ(register_bound_ctas(64, 256, 2048), 4);
  EXPECT_EQ(register_bound_ctas(80, 256, 2048), 3);
  EXPECT_EQ(register_bound_ctas(128, 256, 2048), 2);
  EXPECT_EQ(register_bound_ctas(255, 256, 2048), 1);
  EXPECT_EQ(register_bound_ctas(32, 256, 2048), 8);
  EXPECT_EQ(register_bound_ctas(32, 256, 1536), 6);
  EXPECT_EQ(register_bound_ctas(16, 32, 2048), 32);    // the CTA limit
  EXPECT_EQ(register_bound_ctas(255, 1024, 2048), 1);  // never below one
}

TEST(RegisterFit, ThreadLimitPerArch) {
  EXPECT_EQ(max_threads_per_sm("sm_80"), 2048);
  EXPECT_EQ(max_threads_per_sm("sm_86"), 1536);
  EXPECT_EQ(max_threads_per_sm("sm_89"), 1536);
  EXPECT_EQ(max_threads_per_sm("sm_90a"), 2048);
  EXPECT_EQ(max_threads_per_sm("sm_100"), 2048);
  EXPECT_EQ(max_threads_per_sm("sm_120"), 1536);
}

TEST(RegisterFit, PinsSpilledChoicesOnly) {
  const std::vector<std::string> names = {"k<A,0>", "k<B,0>", "k<A,3>", "k<C,3>", "other"};
  const ResidencyTable residency = {at("k<A,", 0), at("k<B,", 0), at("k<A,", 3), at("k<C,", 3),
                                    std::nullopt};
  const std::vector<std::string> lowered = {"a0", "b0", "a3", "c3", "o"};
  const std::vector<nvrtc::KernelResources> report = {
      kernel("a0", 48, 12, 16), kernel("b0", 64, 0, 0), kernel("a3", 80, 4, 8),
      kernel("c3", 80, 8, 8), kernel("o", 40, 8, 8)};
  const auto fitted = fitted_names(names, residency, lowered, report, "sm_90");
  ASSERT_TRUE(fitted.has_value());
  // a0: ptxas chose 48 registers (five 256-thread CTAs) and spilled: asked for five.
  // b0: no local memory, unchanged. a3 and c3 spill at a residency the schedule named: they
  // stay. `other` has no residency argument and stays.
  EXPECT_EQ(*fitted, (std::vector<std::string>{"k<A,5>", "k<B,0>", "k<A,3>", "k<C,3>", "other"}));
  // Named residencies alone that spill: nothing to fit.
  EXPECT_FALSE(
      fitted_names({"k<A,3>"}, {at("k<A,", 3)}, {"a3"}, {kernel("a3", 80, 4, 8)}, "sm_90"));
}

TEST(RegisterFit, TheFirstRungPinsTheBoundAndRungsRenderNames) {
  const std::vector<std::string> names = {"k<A,0>", "k<B,0>", "k<A,3>", "other"};
  const ResidencyTable residency = {at("k<A,", 0), at("k<B,", 0), at("k<A,", 3), std::nullopt};
  const std::vector<std::string> lowered = {"a0", "b0", "a3", "o"};
  const auto pinned = first_rung(residency, lowered,
                                 {kernel("a0", 128, 16, 16), kernel("b0", 64, 0, 0),
                                  kernel("a3", 80, 4, 8), kernel("o", 40, 8, 8)},
                                 "sm_90");
  ASSERT_TRUE(pinned.has_value());
  EXPECT_EQ(*pinned, (std::vector<int>{2, 0, 0, 0}));
  // The next rungs: one CTA fewer, rendered where pinned only.
  EXPECT_EQ(rung_names(names, residency, {1, 0, 0, 0}),
            (std::vector<std::string>{"k<A,1>", "k<B,0>", "k<A,3>", "other"}));
  EXPECT_EQ(rung_names(names, residency, {0, 4, 2, 7}),
            (std::vector<std::string>{"k<A,0>", "k<B,4>", "k<A,2>", "other"}));
  EXPECT_EQ(rung_names(names, residency, {0, 0, 0, 0}), names);
}

TEST(RegisterFit, LeavesModulesWithoutLocalMemoryOrReportsAlone) {
  const std::vector<std::string> names = {"k<A,0>", "k<A,3>"};
  const ResidencyTable residency = {at("k<A,", 0), at("k<A,", 3)};
  const std::vector<std::string> lowered = {"a0", "a3"};
  EXPECT_FALSE(fitted_names(names, residency, lowered,
                            {kernel("a0", 100, 0, 0), kernel("a3", 80, 0, 0)}, "sm_90"));
  // A kernel at ptxas's choice the report does not name (ptxas -v off) or whose registers it
  // lacks: no fitting.
  EXPECT_FALSE(fitted_names(names, residency, lowered, {kernel("a3", 80, 8, 8)}, "sm_90"));
  EXPECT_FALSE(fitted_names(names, residency, lowered,
                            {kernel("a0", -1, 8, 8), kernel("a3", 80, 0, 0)}, "sm_90"));
  // Tables that do not match the names.
  EXPECT_FALSE(fitted_names(names, {at("k<A,", 0)}, lowered,
                            {kernel("a0", 48, 8, 8), kernel("a3", 80, 0, 0)}, "sm_90"));
}

TEST(RegisterFit, OtherFormsAreTriedWhereLocalMemoryRemains) {
  Residency formed = at("k<A,", 0);
  formed.forms = 3;
  Residency named = at("k<B,", 3);
  named.forms = 2;
  const std::vector<std::string> names = {"k<A,2,0>", "k<B,3,0>", "k<A,0>", "other"};
  const ResidencyTable residency = {formed, named, at("k<A,", 0), std::nullopt};
  // Local memory left in the first two (a rung's residency, a named one) and the third (no
  // forms); the fourth has no residency argument.
  const std::vector<int> ctas = {2, 3, 0, 0};
  EXPECT_EQ(*form_names(names, residency, ctas, {16, 8, 8, 8}, 1),
            (std::vector<std::string>{"k<A,2,1>", "k<B,3,1>", "k<A,0>", "other"}));
  // Form 2: only the kernel that has it.
  EXPECT_EQ(*form_names(names, residency, ctas, {16, 8, 8, 8}, 2),
            (std::vector<std::string>{"k<A,2,2>", "k<B,3,0>", "k<A,0>", "other"}));
  EXPECT_FALSE(form_names(names, residency, ctas, {16, 8, 8, 8}, 3));
  // None left, or not reported (-1): nothing to compile.
  EXPECT_FALSE(form_names(names, residency, ctas, {0, -1, 8, 8}, 1));
  // Tables that do not match the names, and form 0 (the default, not a step).
  EXPECT_FALSE(form_names(names, residency, {2, 3}, {16, 8, 8, 8}, 1));
  EXPECT_FALSE(form_names(names, residency, ctas, {16, 8, 8, 8}, 0));
}

TEST(RegisterFit, ThePinnedResidencyRespectsTheArchsThreadLimit) {
  const std::vector<std::string> names = {"k<A,0>"};
  const ResidencyTable residency = {at("k<A,", 0)};
  const std::vector<nvrtc::KernelResources> report = {kernel("a0", 32, 4, 8)};
  EXPECT_EQ(*fitted_names(names, residency, {"a0"}, report, "sm_90"),
            std::vector<std::string>{"k<A,8>"});
  EXPECT_EQ(*fitted_names(names, residency, {"a0"}, report, "sm_89"),
            std::vector<std::string>{"k<A,6>"});
}

}  // namespace
}  // namespace csa::compressor
