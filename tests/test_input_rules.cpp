// Nothing read from the environment, a schedule table, a cache entry's ptxas report or a call
// is trusted: out-of-range and non-integral numbers are rejected naming where they came from,
// and a value of the wrong form never silently changes behaviour.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/env.hpp"
#include "common/parse.hpp"
#include "nvrtc/compiler.hpp"
#include "schedule/short_window.hpp"
#include "schedule/table.hpp"
#include "csa/csa.hpp"

namespace csa::test {
namespace {

void expect_error(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

std::string table_with_entry(const std::string& entry) {
  return R"({"schema_version": 1, "arch": "sm_90", "entries": [)" + entry + "]}";
}

std::string entry_with_head_dim(const std::string& head_dim) {
  return R"({"family": "long_window", "direction": "forward", "coff": 1, "head_dim": )" + head_dim +
         R"(, "ratio": [17, 256], "buckets": [{"max_rows": null, "vec": 2, "cols": 32,
         "threads": 256, "serial": false, "fast_exp": false}]})";
}

TEST(InputRules, ScheduleTableNumbersAreCheckedNotConverted) {
  const auto parse = [](const std::string& text) {
    return [text] { schedule::parse_schedule_table(text, "t.json"); };
  };
  expect_error(parse(table_with_entry("[1]")), "t.json: entries[0]: must be an object");
  expect_error(parse(R"({"schema_version": 1e999, "arch": "sm_90", "entries": []})"),
               "t.json: (top level): not valid JSON");
  expect_error(parse(table_with_entry(entry_with_head_dim("[4294967297, 512]"))),
               "t.json: entries[0].head_dim[0]: 4294967297 is outside [1, 4096]");
  expect_error(parse(table_with_entry(entry_with_head_dim("[18446744073709551615, 512]"))),
               "entries[0].head_dim[0]: 18446744073709551615 is outside");
  expect_error(parse(table_with_entry(entry_with_head_dim("[1.0, 512]"))),
               "entries[0].head_dim[0]: must be an integer");
  expect_error(parse(table_with_entry(entry_with_head_dim("[512, 1]"))),
               "entries[0].head_dim: [512, 1]: min is above max");
  expect_error(parse(R"({"schema_version": 1, "arch": "sm_99999999999", "entries": []})"),
               "arch: 'sm_99999999999' is not an arch");
  EXPECT_NO_THROW(
      schedule::parse_schedule_table(table_with_entry(entry_with_head_dim("[1, 512]")), "t.json"));
}

TEST(InputRules, ShortWindowOverrideIsRangeChecked) {
  const Config c{4, 128, 2};
  const auto select = [&](const char* spec) {
    return [&c, spec] { schedule::select_short_window(c, std::string(spec)); };
  };
  expect_error(select("tx=65536,ty=65536"), "block shape out of range");
  expect_error(select("tx=99999999999"), "'tx=99999999999': value is not an integer");
  expect_error(select("ty=4x"), "'ty=4x': value is not an integer");
  expect_error(select("ty=-1"), "'ty=-1'");
  EXPECT_NO_THROW(schedule::select_short_window(c, std::string("tx=16,ty=8")));
}

TEST(InputRules, ArchNamesAreParsedWithoutOverflow) {
  expect_error([] { nvrtc::check_arch("sm_99999999999"); }, "sm_99999999999");
  expect_error([] { nvrtc::check_arch("sm_"); }, "is not of the form");
  EXPECT_NO_THROW(nvrtc::check_arch("sm_90a"));
  EXPECT_EQ(parse::compute_capability("sm_100f"), 100);
  EXPECT_FALSE(parse::compute_capability("sm_9x"));
  EXPECT_FALSE(parse::compute_capability("sm_-9"));
}

TEST(InputRules, PtxasReportsWithImpossibleNumbersAreMalformed) {
  bool malformed = false;
  const auto r = nvrtc::parse_ptxas_report(
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "ptxas info    : Used 123456789012 registers, used 0 barriers\n",
      &malformed);
  EXPECT_TRUE(malformed);
  ASSERT_EQ(r.size(), 1u);
  nvrtc::parse_ptxas_report(
      "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
      "ptxas info    : Function properties for k\n"
      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 40 registers, used 0 barriers\n",
      &malformed);
  EXPECT_FALSE(malformed);
}

TEST(InputRules, SegmentCountsNearInt32DoNotOverflow) {
  alignas(16) static std::uint16_t data[64];
  alignas(16) static float ape[64];
  alignas(16) static std::int32_t offsets[4];
  ForwardArgs a;
  a.kv = data;
  a.score = data;
  a.ape = ape;
  a.cu_seqlens = offsets;
  a.cu_seqlens_comp = offsets;
  a.out = data;
  a.total_tokens = 8;
  a.total_comp = 2;
  a.config = {4, 4, 1};
  RuntimeOptions o;
  o.disk_cache = false;
  Runtime rt(o);
  for (std::int32_t n : {std::numeric_limits<std::int32_t>::max(),
                         std::numeric_limits<std::int32_t>::max() - 1, (1 << 30) + 1}) {
    a.num_segments = n;
    expect_error([&] { rt.forward(a, nullptr); }, "num_segments is");
  }
  expect_error(
      [] {
        validate_shape({4, 4, 1}, 8, std::numeric_limits<std::int32_t>::max(), 2);
      },
      "num_segments");
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.empty()) {
      ::unsetenv(name_);
    } else {
      ::setenv(name_, old_.c_str(), 1);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
};

TEST(InputRules, BooleanVariablesTakeOneSpellingSetAndWarnOnTheRest) {
  for (const char* yes : {"1", "true", "TRUE", "Yes", "on"}) EXPECT_EQ(env::parse_flag(yes), true);
  for (const char* no : {"0", "false", "No", "OFF"}) EXPECT_EQ(env::parse_flag(no), false);
  EXPECT_FALSE(env::parse_flag("garbage"));
  {
    ScopedEnv upper("CSA_DISABLE_DISK_CACHE", "TRUE");
    EXPECT_FALSE(RuntimeOptions::from_environment().disk_cache);
  }
  ScopedEnv garbage("CSA_DISABLE_JIT", "garbage");
  const RuntimeOptions o = RuntimeOptions::from_environment();
  EXPECT_TRUE(o.jit_enabled);
  ASSERT_EQ(o.warnings.size(), 1u);
  EXPECT_NE(o.warnings[0].find("CSA_DISABLE_JIT='garbage' is not a boolean"), std::string::npos)
      << o.warnings[0];
  testing::internal::CaptureStderr();
  { Runtime rt(o); }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("CSA_DISABLE_JIT='garbage'"), std::string::npos) << log;
}

TEST(InputRules, IntegerVariablesAreRangeChecked) {
  for (const char* bad : {"12abc", "-5", "0", "99999999999999999999"}) {
    ScopedEnv v("CSA_CACHE_MAX_BYTES", bad);
    const RuntimeOptions o = RuntimeOptions::from_environment();
    EXPECT_EQ(o.cache_max_bytes, RuntimeOptions{}.cache_max_bytes) << bad;
    ASSERT_EQ(o.warnings.size(), 1u) << bad;
    EXPECT_NE(o.warnings[0].find("CSA_CACHE_MAX_BYTES"), std::string::npos);
  }
  ScopedEnv good("CSA_CACHE_MAX_BYTES", "1048576");
  EXPECT_EQ(RuntimeOptions::from_environment().cache_max_bytes, 1048576);
}

TEST(InputRules, UnknownLogLevelWarnsAndKeepsWarnings) {
  RuntimeOptions o;
  o.disk_cache = false;
  o.log_level = "bogus";
  o.warnings = {"a warning that must still be shown"};
  testing::internal::CaptureStderr();
  { Runtime rt(o); }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("log level 'bogus' is unknown"), std::string::npos) << log;
  EXPECT_NE(log.find("a warning that must still be shown"), std::string::npos) << log;
}

}  // namespace
}  // namespace csa::test
