// The cubin cache: key stability, self-validating entries, corrupt and truncated files rebuilt,
// unusable directories falling back to memory, 0700 creation, and many processes racing.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "cache/entry.hpp"
#include "cache/key.hpp"
#include "cache/once_map.hpp"
#include "cache_test_util.hpp"
#include "csa/csa.hpp"

namespace csa::test {
namespace {

TEST(CacheKey, StableAndSensitiveToEveryInput) {
  const auto a = cache::make_key("x", request(), "sources");
  EXPECT_EQ(a.hash, cache::make_key("x", request(), "sources").hash);
  EXPECT_EQ(a.hash.size(), 32u);
  auto r = request();
  r.arch = "sm_80";
  EXPECT_NE(a.hash, cache::make_key("x", r, "sources").hash);
  r = request();
  r.options.push_back("-lineinfo");
  EXPECT_NE(a.hash, cache::make_key("x", r, "sources").hash);
  r = request();
  std::reverse(r.options.begin(), r.options.end());  // option order is canonicalised
  EXPECT_EQ(a.hash, cache::make_key("x", r, "sources").hash);
  EXPECT_NE(a.hash, cache::make_key("x", request(), "other sources").hash);
  r = request();
  r.name_expressions[0] = "csa_kernel::short_window_forward<2,1,8,1,256>";
  EXPECT_NE(a.hash, cache::make_key("x", r, "sources").hash);
  // The register fitting rule's version (it changes the cubin too).
  EXPECT_NE(a.hash, cache::make_key("x", request(), "sources", 1).hash);
  EXPECT_NE(cache::make_key("x", request(), "sources", 2).hash,
            cache::make_key("x", request(), "sources", 1).hash);
  // No paths, no times: the record holds neither the working directory nor HOME.
  EXPECT_EQ(a.record.find(fs::current_path().string()), std::string::npos);
  if (const char* home = std::getenv("HOME")) {
    EXPECT_EQ(a.record.find(std::string(home) + "/"), std::string::npos);
  }
}

TEST(CacheEntry, RoundTripsAndRejectsDamage) {
  const auto key = cache::make_key("x", request(), "s");
  cache::CubinEntry entry{{'\x7f', 'E', 'L', 'F', 1, 2, 3}, {"_Z3foo"}, "ptxas log"};
  const auto bytes = cache::encode_entry(key, entry);
  std::string why;
  auto back = cache::decode_entry(bytes, key, 1, &why);
  ASSERT_TRUE(back) << why;
  EXPECT_EQ(back->cubin, entry.cubin);
  EXPECT_EQ(back->lowered_names, entry.lowered_names);
  EXPECT_EQ(back->log, entry.log);
  for (std::size_t cut : {std::size_t{0}, std::size_t{5}, bytes.size() / 2, bytes.size() - 1}) {
    std::vector<char> truncated(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_FALSE(cache::decode_entry(truncated, key, 1, &why)) << cut;
  }
  for (std::size_t pos : {std::size_t{3}, std::size_t{20}, bytes.size() - 12, bytes.size() - 2}) {
    auto flipped = bytes;
    flipped[pos] ^= 0x40;
    EXPECT_FALSE(cache::decode_entry(flipped, key, 1, &why)) << pos;
  }
  EXPECT_FALSE(cache::decode_entry(bytes, cache::make_key("x", request(), "other"), 1, &why));
  EXPECT_NE(why.find("another key"), std::string::npos);
}

TEST(DiskCache, CompilesOnceThenLoadsFromDisk) {
  TempDir dir;
  {
    Runtime rt(options_for(dir.path() / "nested" / "csa"));
    const auto r = rt.compile_for_arch(kConfig, "sm_90");
    EXPECT_TRUE(r.compiled);
    EXPECT_TRUE(rt.cache_info().persistent);
  }
  struct stat st {};
  ASSERT_EQ(::stat((dir.path() / "nested" / "csa").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  Runtime again(options_for(dir.path() / "nested" / "csa"));
  const auto r = again.compile_for_arch(kConfig, "sm_90");
  EXPECT_FALSE(r.compiled);
  EXPECT_EQ(again.cache_info().entries, 1);
  EXPECT_LT(r.seconds, 0.5);
}

void damage_and_expect_rebuild(const std::function<void(const fs::path&)>& damage) {
  TempDir dir;
  { Runtime(options_for(dir.path())).compile_for_arch(kConfig, "sm_90"); }
  auto entries = files_with(dir.path(), ".cubin");
  ASSERT_EQ(entries.size(), 1u);
  const auto good_size = fs::file_size(entries[0]);
  damage(entries[0]);
  testing::internal::CaptureStderr();
  Runtime rt(options_for(dir.path()));
  const auto r = rt.compile_for_arch(kConfig, "sm_90");
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(r.compiled) << "a damaged entry must be rebuilt";
  EXPECT_NE(log.find("discarding cache entry"), std::string::npos) << log;
  ASSERT_EQ(files_with(dir.path(), ".cubin").size(), 1u);
  EXPECT_EQ(fs::file_size(entries[0]), good_size);  // entries are reproducible byte for byte
  EXPECT_FALSE(Runtime(options_for(dir.path())).compile_for_arch(kConfig, "sm_90").compiled);
}

TEST(DiskCache, CorruptEntryIsRebuiltWithAWarning) {
  damage_and_expect_rebuild([](const fs::path& p) {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(p) / 2));
    f.put('\x55');
  });
}

TEST(DiskCache, TruncatedEntryIsRebuiltWithAWarning) {
  damage_and_expect_rebuild([](const fs::path& p) { fs::resize_file(p, fs::file_size(p) / 3); });
}

TEST(DiskCache, UnusableDirectoryFallsBackToMemoryWithOneWarning) {
  TempDir dir;
  const fs::path file = dir.path() / "plain-file";
  std::ofstream(file) << "x";
  std::vector<fs::path> unusable = {file / "csa"};  // below a regular file
  const fs::path shared = dir.path() / "shared";
  fs::create_directory(shared);
  fs::permissions(shared, fs::perms::all);  // group/world writable: refused
  unusable.push_back(shared);
  if (::geteuid() != 0) {  // root ignores mode bits
    const fs::path ro = dir.path() / "readonly";
    fs::create_directory(ro);
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    unusable.push_back(ro);
  }
  for (const auto& path : unusable) {
    testing::internal::CaptureStderr();
    Runtime rt(options_for(path));
    EXPECT_TRUE(rt.compile_for_arch(kConfig, "sm_90").compiled);
    EXPECT_FALSE(rt.compile_for_arch(kConfig, "sm_90").compiled);  // kept in memory
    EXPECT_TRUE(rt.compile_for_arch({1, 8, 1}, "sm_90").compiled);
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_FALSE(rt.cache_info().persistent) << path;
    EXPECT_EQ(rt.cache_info().entries, 2);
    std::size_t warnings = 0;
    for (auto pos = log.find("kept in memory only"); pos != std::string::npos;
         pos = log.find("kept in memory only", pos + 1))
      ++warnings;
    EXPECT_EQ(warnings, 1u) << path << ": " << log;
  }
}

TEST(DiskCache, EightProcessesRacingOneColdKey) {
  TempDir dir;
  std::vector<pid_t> children;
  for (int i = 0; i < 8; ++i) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int rc = 0;
      try {
        Runtime(options_for(dir.path())).compile_for_arch(kConfig, "sm_90");
      } catch (...) {
        rc = 1;
      }
      ::_exit(rc);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(files_with(dir.path(), ".cubin").size(), 1u);
  EXPECT_TRUE(files_with(dir.path(), ".tmp.").empty());
  EXPECT_FALSE(Runtime(options_for(dir.path())).compile_for_arch(kConfig, "sm_90").compiled);
}

TEST(DiskCache, DisabledJitServesOnlyPrewarmedEntries) {
  TempDir dir;
  RuntimeOptions no_jit = options_for(dir.path());
  no_jit.jit_enabled = false;
  try {
    Runtime(no_jit).compile_for_arch(kConfig, "sm_90");
    FAIL() << "compiled with JIT disabled";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kJitDisabled);
    EXPECT_NE(std::string(e.what()).find("csa prewarm"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(files_with(dir.path(), ".cubin").empty());
  EXPECT_TRUE(Runtime(options_for(dir.path())).compile_for_arch(kConfig, "sm_90").compiled);
  EXPECT_FALSE(Runtime(no_jit).compile_for_arch(kConfig, "sm_90").compiled);  // from the cache
}

TEST(DiskCache, ClearRemovesEntries) {
  TempDir dir;
  Runtime rt(options_for(dir.path()));
  rt.compile_for_arch(kConfig, "sm_90");
  EXPECT_EQ(rt.clear_disk_cache(), 1);
  EXPECT_TRUE(files_with(dir.path(), ".cubin").empty());
}

TEST(OnceMap, ComputesOncePerKeyUnderContention) {
  cache::OnceMap<int> map;
  std::atomic<int> calls{0};
  std::vector<std::thread> threads;
  std::vector<int> results(16);
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      results[t] = map.get_or_create("k", [&] {
        ++calls;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return 7;
      });
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls.load(), 1);
  for (int r : results) EXPECT_EQ(r, 7);
}

TEST(OnceMap, FailureIsNotKept) {
  cache::OnceMap<int> map;
  EXPECT_THROW(map.get_or_create("k", []() -> int { throw std::runtime_error("boom"); }),
               std::runtime_error);
  EXPECT_EQ(map.get_or_create("k", [] { return 3; }), 3);
}

}  // namespace
}  // namespace csa::test
