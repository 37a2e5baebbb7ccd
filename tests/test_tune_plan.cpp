// `csa tune` planning without a GPU: candidates are valid table buckets, the choice rule, the
// buckets and the merged table.
#include <algorithm>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tune_plan.hpp"

namespace csa::test {
namespace {

using tools::Candidate;
using tools::Measurement;

std::string table_with(const nlohmann::json& entry) {
  return nlohmann::json{{"schema_version", 1}, {"arch", "sm_90"}, {"entries", {entry}}}.dump();
}

TEST(TunePlan, EveryCandidateIsAValidBucket) {
  for (const Config c : {Config{128, 512, 1}, Config{128, 65, 2}, Config{32, 128, 2}})
    for (Direction d : {Direction::kForward, Direction::kBackward}) {
      const auto candidates = tools::tune_candidates(c, d);
      ASSERT_GE(candidates.size(), 4u);
      for (const auto& cand : candidates) {
        nlohmann::json b = cand.bucket;
        b["max_rows"] = nullptr;
        EXPECT_NO_THROW(validate_schedule_table(
            table_with(tools::make_entry(c, d, nlohmann::json::array({b}))), cand.name))
            << cand.name;
        EXPECT_EQ(c.head_dim % cand.bucket["vec"].get<int>(), 0) << cand.name;
      }
      // Backward: the ring (stages 2, and 3 at 512 threads) is a candidate where head_dim
      // allows it, with unique names.
      const auto ring = std::count_if(candidates.begin(), candidates.end(), [](const auto& cand) {
        return cand.bucket.value("stages", 1) == 2;
      });
      EXPECT_EQ(ring > 0, d == Direction::kBackward && c.head_dim % 8 == 0) << c.head_dim;
      for (const auto& cand : candidates) {
        if (cand.bucket.value("stages", 1) == 3) {
          EXPECT_EQ(cand.bucket["threads"], 512) << cand.name;
        }
      }
      const auto three = std::count_if(candidates.begin(), candidates.end(), [](const auto& cand) {
        return cand.bucket.value("stages", 1) == 3;
      });
      EXPECT_EQ(three > 0, d == Direction::kBackward && c.head_dim % 8 == 0) << c.head_dim;
      // Backward: each chunked-fast kernel is measured with grad_ape by atomics too.
      const auto atomic = std::count_if(candidates.begin(), candidates.end(), [](const auto& cand) {
        return cand.bucket.value("grad_ape", "fixed_order") == "atomic";
      });
      EXPECT_EQ(atomic > 0, d == Direction::kBackward);
      for (std::size_t i = 0; i < candidates.size(); ++i)
        for (std::size_t j = i + 1; j < candidates.size(); ++j)
          EXPECT_NE(candidates[i].name, candidates[j].name);
    }
}

TEST(TunePlan, CandidatesAreMeasuredAsTheLoaderRunsThem) {
  // At ratio 128, coff 2 the loader raises "v1 c32 t256" to 512 threads (at most 16 window
  // values a thread): it runs as "v1 c32 t512", which is measured once, under that name; and
  // "v1 c64 t512 s2" runs as "v1 c32 t512 s2".
  const Config c{128, 128, 2};
  const auto candidates = tools::tune_candidates(c, Direction::kBackward);
  RuntimeOptions options;
  options.disk_cache = false;  // nothing is compiled here
  std::vector<std::string> fitted;
  for (const auto& cand : candidates) {
    Runtime rt(options);
    nlohmann::json b = cand.bucket;
    b["max_rows"] = nullptr;
    rt.set_schedule_table(
        table_with(tools::make_entry(c, Direction::kBackward, nlohmann::json::array({b}))),
        cand.name);
    fitted.push_back(rt.select_schedule(c, Direction::kBackward, 1, "sm_90").schedule);
  }
  const auto run = tools::as_fitted(candidates, fitted, Direction::kBackward);
  EXPECT_LT(run.size(), candidates.size());
  auto count = [&](const std::string& name) {
    return std::count_if(run.begin(), run.end(),
                         [&](const Candidate& r) { return r.name == name; });
  };
  EXPECT_EQ(count("lanes-chunked-fast v1 c32 t512"), 1);
  EXPECT_EQ(count("lanes-chunked-fast v1 c32 t256"), 0);
  // 16 window values a thread: the 512-thread ring takes one CTA per SM and keeps its name.
  EXPECT_EQ(count("lanes-chunked-fast v1 c32 t512 s2"), 1);
  // 64 columns would hold 32 values a thread: fitted to 32 columns and 512 threads.
  EXPECT_EQ(count("lanes-chunked-fast v1 c64 t512 s2"), 0);
  EXPECT_EQ(count("lanes-chunked-fast v1 c16 t256 s2"), 1);
  EXPECT_EQ(count("lanes-chunked-fast v1 c32 t512 atomic"), 1);
  EXPECT_EQ(count("lanes-chunked-fast v1 c16 t256 s2 atomic"), 1);
  for (const auto& r : run) {
    const int stages = r.bucket["stages"].get<int>();
    EXPECT_EQ(stages > 1, r.name.find(fmt::format(" s{}", stages)) != std::string::npos);
    EXPECT_EQ(r.bucket["grad_ape"] == "atomic", r.name.find(" atomic") != std::string::npos);
    EXPECT_FALSE(r.bitwise);
  }
  EXPECT_EQ(count("lanes-chunked v1 c16 t256"), 1);  // the exact exp keeps its own name
  // A fitted description that names no field keeps the candidate as it is.
  EXPECT_EQ(tools::as_fitted({candidates[0]}, {""}, Direction::kBackward)[0].name,
            candidates[0].name);
}

TEST(TunePlan, ChoosesTheFastestOrTheBitwiseOneWithinTheMargin) {
  std::vector<Candidate> c(3);
  c[0].name = "fast";
  c[1].name = "bitwise";
  c[1].bitwise = true;
  c[2].name = "failed";
  const std::vector<Measurement> m = {
      {32, {10.0, 10.9, -1.0}},   // bitwise within 10 %: bitwise
      {64, {10.0, 11.5, 5.0}},    // candidate 2 fastest
      {128, {10.0, 12.0, -1.0}},  // bitwise 20 % slower: fast
      {256, {-1.0, -1.0, -1.0}},  // nothing passed
  };
  EXPECT_EQ(tools::choose(c, m, 1.10), (std::vector<int>{1, 2, 0, -1}));
}

TEST(TunePlan, BucketsMergeNeighboursAndSplitAtTheGeometricMean) {
  std::vector<Candidate> c(2);
  c[0].bucket = {{"vec", 2}};
  c[1].bucket = {{"vec", 1}};
  const std::vector<Measurement> m = {{32, {}}, {64, {}}, {256, {}}, {1024, {}}, {4096, {}}};
  const auto b = tools::make_buckets(c, m, {0, 0, 1, -1, 0});
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0]["vec"], 2);
  EXPECT_EQ(b[0]["max_rows"], 128);  // sqrt(64 * 256)
  EXPECT_EQ(b[1]["vec"], 1);
  EXPECT_EQ(b[1]["max_rows"], 1024);  // sqrt(256 * 4096); 1024 measured nothing
  EXPECT_TRUE(b[2]["max_rows"].is_null());
}

TEST(TunePlan, MergedTablePutsTunedEntriesFirstAndStaysValid) {
  const Config c{128, 512, 1};
  const auto candidates = tools::tune_candidates(c, Direction::kForward);
  nlohmann::json bucket = candidates[0].bucket;
  bucket["max_rows"] = nullptr;
  const auto tuned = tools::make_entry(c, Direction::kForward, nlohmann::json::array({bucket}));
  nlohmann::json base = {
      {"schema_version", 1},
      {"arch", "sm_90"},
      {"entries",
       {tuned, tools::make_entry(c, Direction::kBackward, nlohmann::json::array({bucket}))}}};
  base["entries"][1]["buckets"][0]["rows_per_cta"] = 0;
  const auto merged = tools::merge_entries(base, {tuned}, c, "test");
  ASSERT_EQ(merged["entries"].size(), 2u);  // the old forward entry was replaced
  EXPECT_EQ(merged["entries"][0]["direction"], "forward");
  EXPECT_EQ(merged["origin"], "test");
  EXPECT_NO_THROW(validate_schedule_table(merged.dump(), "merged"));
}

TEST(TunePlan, EntriesOfAnotherTypeOrLayoutAreKeyedAndReplaceOnlyTheirOwn) {
  Config c{128, 512, 1};
  const auto candidates = tools::tune_candidates(c, Direction::kForward);
  nlohmann::json bucket = candidates[0].bucket;
  bucket["max_rows"] = nullptr;
  const auto plain = tools::make_entry(c, Direction::kForward, nlohmann::json::array({bucket}));
  EXPECT_FALSE(plain.contains("dtype"));
  EXPECT_FALSE(plain.contains("layout"));
  c.dtype = DType::kF32;
  c.layout = Layout::kSbhd;
  const auto keyed = tools::make_entry(c, Direction::kForward, nlohmann::json::array({bucket}));
  EXPECT_EQ(keyed["dtype"], "fp32");
  EXPECT_EQ(keyed["layout"], "sbhd");
  const nlohmann::json base = {{"schema_version", 1}, {"arch", "sm_90"}, {"entries", {plain}}};
  const auto merged = tools::merge_entries(base, {keyed}, c, "test");
  ASSERT_EQ(merged["entries"].size(), 2u);  // the unkeyed entry still serves other calls
  EXPECT_EQ(merged["entries"][0], keyed);
  EXPECT_EQ(tools::merge_entries(merged, {keyed}, c, "again")["entries"].size(), 2u);
  EXPECT_NO_THROW(validate_schedule_table(merged.dump(), "merged"));
}

// A tail's measurement is keyed on the tail (it serves only calls with it) and replaces only
// the entry of the same tail; its candidates, as the loader fits them, all take the lanes form,
// the only one that runs the tail, in both grad_ape forms.
TEST(TunePlan, TailEntriesAreKeyedOnTheTailAndFitTheTailsForms) {
  Config c{128, 512, 1};
  c.tail.norm = true;
  c.tail.rope_dim = 64;
  for (Direction dir : {Direction::kForward, Direction::kBackward}) {
    const auto candidates = tools::tune_candidates(c, dir);
    RuntimeOptions options;
    options.disk_cache = false;  // nothing is compiled here
    std::vector<std::string> fitted;
    for (const auto& cand : candidates) {
      Runtime rt(options);
      nlohmann::json b = cand.bucket;
      b["max_rows"] = nullptr;
      const auto entry = tools::make_entry(c, dir, nlohmann::json::array({b}));
      EXPECT_EQ(entry["tail"], "norm+rope64");
      rt.set_schedule_table(table_with(entry), cand.name);
      const ScheduleChoice choice = rt.select_schedule(c, dir, 1, "sm_90");
      EXPECT_EQ(choice.entry_tail, "norm+rope64");
      fitted.push_back(choice.schedule);
    }
    const auto run = tools::as_fitted(candidates, fitted, dir);
    EXPECT_LT(run.size(), candidates.size()) << "staged forms fit to the lanes form";
    int atomic = 0;
    for (const auto& r : run) {
      EXPECT_EQ(r.bucket["form"], "lanes") << r.name;
      if (dir == Direction::kBackward && r.bucket["grad_ape"] == "atomic") ++atomic;
    }
    if (dir == Direction::kBackward) {
      EXPECT_GT(atomic, 0) << "the atomic form runs the tail too";
    }
  }
  nlohmann::json bucket = tools::tune_candidates(c, Direction::kForward)[0].bucket;
  bucket["max_rows"] = nullptr;
  const auto tail = tools::make_entry(c, Direction::kForward, nlohmann::json::array({bucket}));
  Config plain_config = c;
  plain_config.tail = TailShape{};
  const auto plain =
      tools::make_entry(plain_config, Direction::kForward, nlohmann::json::array({bucket}));
  EXPECT_FALSE(plain.contains("tail"));
  const nlohmann::json base = {{"schema_version", 1}, {"arch", "sm_90"}, {"entries", {plain}}};
  const auto merged = tools::merge_entries(base, {tail}, c, "test");
  ASSERT_EQ(merged["entries"].size(), 2u);  // the plain entry still serves plain calls
  EXPECT_EQ(merged["entries"][0], tail);
  EXPECT_EQ(tools::merge_entries(merged, {tail}, c, "again")["entries"].size(), 2u);
  EXPECT_NO_THROW(validate_schedule_table(merged.dump(), "merged"));

  // A base tail entry keyed on bf16 THD would outrank the (unkeyed) bf16 THD measurement on the
  // very calls it measured, so it goes; one keyed on another type stays.
  nlohmann::json bf16_thd = tail, fp16 = tail;
  bf16_thd["dtype"] = "bf16";
  bf16_thd["layout"] = "thd";
  fp16["dtype"] = "fp16";
  const nlohmann::json keyed_base = {
      {"schema_version", 1}, {"arch", "sm_90"}, {"entries", {bf16_thd, fp16, plain}}};
  const auto retuned = tools::merge_entries(keyed_base, {tail}, c, "test");
  ASSERT_EQ(retuned["entries"].size(), 3u);
  EXPECT_EQ(retuned["entries"][0], tail);
  EXPECT_EQ(retuned["entries"][1], fp16);
  EXPECT_EQ(retuned["entries"][2], plain);
}

TEST(TunePlan, SmallForwardOutputsKeepTheBitwiseBuckets) {
  EXPECT_EQ(tools::bitwise_row_limit({128, 512, 1}), 31);   // 31 * 512 < 16384 <= 32 * 512
  EXPECT_EQ(tools::bitwise_row_limit({128, 128, 2}), 127);  // 127 * 128 < 16384
  std::vector<tools::Candidate> c(3);
  c[0].name = "fast";
  c[0].bucket = {{"form", "lanes"}, {"serial", false}, {"cols", 64}};
  c[1].name = "serial-a";
  c[1].bucket = {{"form", "lanes"}, {"serial", true}, {"cols", 16}};
  c[1].bitwise = true;
  c[2].name = "serial-b";
  c[2].bucket = {{"form", "lanes"}, {"serial", true}, {"cols", 64}};
  c[2].bitwise = true;
  // Serial a wins at 32 rows, b at 64, a again at 512 (past the limit: ignored); -1: failed.
  const std::vector<tools::Measurement> m = {
      {32, {1.0, 2.0, 3.0}}, {64, {1.0, 4.0, 3.0}}, {512, {1.0, 2.0, -1.0}}};
  const auto bitwise = tools::bitwise_buckets(c, m, 127);
  ASSERT_EQ(bitwise.size(), 2u);
  EXPECT_EQ(bitwise[0]["cols"], 16);
  EXPECT_EQ(bitwise[0]["max_rows"], 45);  // floor(sqrt(32 * 64))
  EXPECT_EQ(bitwise[1]["cols"], 64);
  EXPECT_EQ(bitwise[1]["max_rows"], 127);
  // The smallest measured count lies above the limit (head_dim 512: 31 rows): its fastest
  // bitwise candidate serves the rows up to the limit.
  const auto above = tools::bitwise_buckets(c, {{32, {1.0, 2.0, 3.0}}, {64, {1.0, 4.0, 3.0}}}, 31);
  ASSERT_EQ(above.size(), 1u);
  EXPECT_EQ(above[0]["cols"], 16);
  EXPECT_EQ(above[0]["max_rows"], 31);
  // No bitwise candidate passed: nothing.
  EXPECT_TRUE(tools::bitwise_buckets(c, {{32, {1.0, -1.0, -1.0}}}, 127).empty());

  const nlohmann::json fast = {{"form", "lanes"}, {"serial", false}, {"max_rows", 45}};
  const nlohmann::json mid = {{"form", "lanes"}, {"serial", false}, {"max_rows", 128}};
  const nlohmann::json last = {{"form", "lanes"}, {"serial", false}, {"max_rows", nullptr}};
  const auto b = tools::with_bitwise_small_rows({fast, mid, last}, bitwise, 127);
  ASSERT_EQ(b.size(), 4u);  // the 45-row bucket lies inside the bitwise range
  EXPECT_EQ(b[0]["serial"], true);
  EXPECT_EQ(b[0]["max_rows"], 45);
  EXPECT_EQ(b[1]["max_rows"], 127);
  EXPECT_EQ(b[2]["max_rows"], 128);
  EXPECT_TRUE(b[3]["max_rows"].is_null());
}

}  // namespace
}  // namespace csa::test
