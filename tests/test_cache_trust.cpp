// The disk cache trusts nothing on disk: directories someone else owns or may write to, a link
// swapped in after start-up, foreign files in `clear`, clears racing writers, hostile entries
// of every kind, read-only mounts, and the size bound.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cache_test_util.hpp"

namespace csa::test {
namespace {

constexpr uid_t kOtherUser = 2002;

// chown -R to another user; false when this process may not (not root).
bool give_away(const fs::path& dir) {
  if (::geteuid() != 0) return false;
  if (::chown(dir.c_str(), kOtherUser, kOtherUser) != 0) return false;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (::lchown(e.path().c_str(), kOtherUser, kOtherUser) != 0) return false;
  return true;
}

fs::path only_entry(const fs::path& dir) {
  const auto entries = files_with(dir, ".cubin");
  EXPECT_EQ(entries.size(), 1u) << dir;
  return entries.empty() ? fs::path() : entries[0];
}

// A real entry of kConfig in `dir`, and its path.
fs::path prewarmed(const fs::path& dir) {
  Runtime(options_for(dir)).compile_for_arch(kConfig, "sm_90");
  return only_entry(dir);
}

// A runtime over `dir` compiles kConfig while the entry is in the state `damage` left:
// rebuilt (compiled), with a warning naming the entry, no abort and no hang.
void expect_rebuilt(const std::string& kind, const std::function<void(const fs::path&)>& damage,
                    bool stays_on_disk = true) {
  SCOPED_TRACE(kind);
  TempDir dir;
  const fs::path entry = prewarmed(dir.path());
  const auto good = read_bytes(entry);
  damage(entry);
  testing::internal::CaptureStderr();
  Runtime rt(options_for(dir.path()));
  const PrewarmReport r = rt.compile_for_arch(kConfig, "sm_90");
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(r.compiled) << "a hostile entry must be rebuilt";
  EXPECT_NE(log.find("discarding cache entry"), std::string::npos) << log;
  EXPECT_NE(log.find(entry.filename().string()), std::string::npos) << log;
  if (stays_on_disk) {
    EXPECT_EQ(r.source, dir.path().string());
    EXPECT_EQ(read_bytes(entry), good);  // rebuilt byte for byte
    EXPECT_FALSE(Runtime(options_for(dir.path())).compile_for_arch(kConfig, "sm_90").compiled);
  } else {
    EXPECT_EQ(r.source, "memory");
  }
}

TEST(CacheTrust, HostileEntriesAreRebuilt) {
  const auto parts_of = [](const fs::path& p) { return split_entry(read_bytes(p)); };
  expect_rebuilt("cubin size beyond the file", [&](const fs::path& p) {
    const EntryParts e = parts_of(p);
    std::vector<char> tail(8 + e.cubin.size());
    const std::uint64_t size = e.cubin.size() + 4096;
    std::memcpy(tail.data(), &size, 8);
    std::copy(e.cubin.begin(), e.cubin.end(), tail.begin() + 8);
    write_bytes(p, forge(e.header, e.cubin, &tail));
  });
  expect_rebuilt("cubin size field overlapping the checksum", [&](const fs::path& p) {
    const std::vector<char> tail = {'\xff', '\xff', '\xff', '\xff'};
    write_bytes(p, forge(parts_of(p).header, {}, &tail));
  });
  expect_rebuilt("hash that is not a string", [&](const fs::path& p) {
    EntryParts e = parts_of(p);
    e.header["hash"] = 12345;
    write_bytes(p, forge(e.header, e.cubin));
  });
  expect_rebuilt("ptxas report with a 12-digit register count", [&](const fs::path& p) {
    EntryParts e = parts_of(p);
    e.header["log"] =
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
        "ptxas info    : Used 123456789012 registers, used 0 barriers\n";
    write_bytes(p, forge(e.header, e.cubin));
  });
  expect_rebuilt("fewer lowered names than kernels", [&](const fs::path& p) {
    EntryParts e = parts_of(p);
    e.header["lowered_names"] = nlohmann::json::array();
    write_bytes(p, forge(e.header, e.cubin));
  });
  expect_rebuilt("an empty directory", [](const fs::path& p) {
    fs::remove(p);
    fs::create_directory(p);
  });
  expect_rebuilt(
      "a directory with a file in it",
      [](const fs::path& p) {
        fs::remove(p);
        fs::create_directory(p);
        std::ofstream(p / "x") << "x";
      },
      /*stays_on_disk=*/false);
  expect_rebuilt("a FIFO", [](const fs::path& p) {
    fs::remove(p);
    ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0);
  });
  expect_rebuilt("a link to /dev/zero", [](const fs::path& p) {
    fs::remove(p);
    fs::create_symlink("/dev/zero", p);
  });
  expect_rebuilt("a link to a valid entry elsewhere", [](const fs::path& p) {
    const fs::path moved = p.parent_path().parent_path() / (p.filename().string() + ".moved");
    fs::rename(p, moved);
    fs::create_symlink(moved, p);
  });
}

TEST(CacheTrust, ForeignOwnedDirectoryIsRefused) {
  TempDir t;
  const fs::path foreign = t.path() / "foreign";
  prewarmed(foreign);
  if (!give_away(foreign)) GTEST_SKIP() << "needs root to give a directory to another user";
  testing::internal::CaptureStderr();
  Runtime rt(options_for(foreign));
  const PrewarmReport r = rt.compile_for_arch(kConfig, "sm_90");
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(r.compiled) << "a cubin from a directory another user owns was loaded";
  EXPECT_EQ(r.source, "memory");
  EXPECT_NE(log.find("owned by uid 2002"), std::string::npos) << log;
  const CacheInfo info = rt.cache_info();
  EXPECT_FALSE(info.persistent);
  ASSERT_FALSE(info.layers.empty());
  EXPECT_EQ(info.layers[0].state.rfind("refused", 0), 0u) << info.layers[0].state;
  EXPECT_THROW(rt.clear_disk_cache(), Error);
  EXPECT_EQ(files_with(foreign, ".cubin").size(), 1u) << "clear deleted in a refused directory";

  // As a read-only layer, too.
  RuntimeOptions o = options_for(t.path() / "mine");
  o.cache_layers = {foreign.string()};
  testing::internal::CaptureStderr();
  EXPECT_TRUE(Runtime(o).compile_for_arch(kConfig, "sm_90").compiled);
  testing::internal::GetCapturedStderr();
}

TEST(CacheTrust, ReadOnlyLayersMustBeOwnedAndClosed) {
  TempDir t;
  const fs::path layer = t.path() / "layer";
  prewarmed(layer);
  fs::permissions(layer, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                             fs::perms::others_read | fs::perms::others_exec);
  RuntimeOptions o = options_for(t.path() / "mine");
  o.cache_layers = {(t.path() / "absent").string(), layer.string()};
  o.jit_enabled = false;
  const PrewarmReport r = Runtime(o).compile_for_arch(kConfig, "sm_90");
  EXPECT_FALSE(r.compiled);
  EXPECT_EQ(r.source, layer.string());
  EXPECT_TRUE(files_with(t.path() / "mine", ".cubin").empty());  // served, not copied

  fs::permissions(layer, fs::perms::group_write, fs::perm_options::add);
  testing::internal::CaptureStderr();
  Runtime rt(o);
  EXPECT_THROW(rt.compile_for_arch(kConfig, "sm_90"), Error);  // refused: a miss, JIT off
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("writable by group or others"), std::string::npos) << log;
  const CacheInfo info = rt.cache_info();
  ASSERT_EQ(info.layers.size(), 3u);
  EXPECT_EQ(info.layers[1].state, "absent");
  EXPECT_EQ(info.layers[2].state.rfind("refused", 0), 0u) << info.layers[2].state;
}

TEST(CacheTrust, LinkSwappedInAfterStartUpIsNotFollowed) {
  TempDir t;
  const fs::path dir = t.path() / "cache";
  fs::create_directory(dir);
  fs::permissions(dir, fs::perms::owner_all);
  const fs::path elsewhere = t.path() / "elsewhere";
  const fs::path planted = prewarmed(elsewhere);
  const auto planted_bytes = read_bytes(planted);
  give_away(elsewhere);  // where possible: another user's cubins
  Runtime rt(options_for(dir));
  fs::rename(dir, t.path() / "cache.old");
  fs::create_directory_symlink(elsewhere, dir);
  const PrewarmReport r = rt.compile_for_arch(kConfig, "sm_90");
  EXPECT_TRUE(r.compiled) << "the cubin behind the swapped-in link was loaded";
  EXPECT_EQ(files_with(t.path() / "cache.old", ".cubin").size(), 1u)
      << "the entry must land in the directory opened at start-up";
  EXPECT_EQ(read_bytes(planted), planted_bytes);
}

TEST(CacheTrust, ClearRemovesOnlyCsaEntries) {
  TempDir dir;
  const fs::path entry = prewarmed(dir.path());
  const std::string name = entry.filename().string();
  const std::string lookalike = "short-r9-0123456789abcdef0123456789abcdef.cubin";
  std::ofstream(dir.path() / "model.cubin") << "someone else's";
  std::ofstream(dir.path() / "notes.txt") << "notes";
  std::ofstream(dir.path() / lookalike) << "not a csa entry";
  const fs::path young = dir.path() / (name + ".tmp.123.deadbeef");
  const fs::path old = dir.path() / (name + ".tmp.456.cafef00d");
  std::ofstream(young) << "a writer at work";
  std::ofstream(old) << "a writer that died";
  const timeval two_hours_ago[2] = {{std::time(nullptr) - 7200, 0}, {std::time(nullptr) - 7200, 0}};
  ASSERT_EQ(::utimes(old.c_str(), two_hours_ago), 0);

  Runtime rt(options_for(dir.path()));
  EXPECT_EQ(rt.clear_disk_cache(), 1);
  EXPECT_FALSE(fs::exists(entry));
  EXPECT_FALSE(fs::exists(old));
  for (const char* kept : {"model.cubin", "notes.txt"}) EXPECT_TRUE(fs::exists(dir.path() / kept));
  EXPECT_TRUE(fs::exists(dir.path() / lookalike));
  EXPECT_TRUE(fs::exists(young));
}

TEST(CacheTrust, ClearRacingEightWritersLeavesEveryWriterOnDisk) {
  TempDir dir;
  const fs::path stop = dir.path().parent_path() / (dir.path().filename().string() + ".stop");
  const pid_t clearer = ::fork();
  ASSERT_GE(clearer, 0);
  if (clearer == 0) {
    Runtime rt(options_for(dir.path()));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(3);
    while (!fs::exists(stop) && std::chrono::steady_clock::now() < deadline) {
      rt.clear_disk_cache();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ::_exit(0);
  }
  std::vector<pid_t> writers;
  for (int i = 0; i < 8; ++i) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int rc = 1;
      try {
        Runtime rt(options_for(dir.path()));
        const PrewarmReport r = rt.compile_for_arch({1 + i, 8, 1}, "sm_90");
        rc = r.compiled && r.source == dir.path().string() && rt.cache_info().persistent ? 0 : 2;
      } catch (...) {
        rc = 3;
      }
      ::_exit(rc);
    }
    writers.push_back(pid);
  }
  for (pid_t pid : writers) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "a writer lost its cache to the clear (status " << status << ")";
  }
  std::ofstream(stop) << "stop";
  int status = 0;
  ASSERT_EQ(::waitpid(clearer, &status, 0), clearer);
  fs::remove(stop);
  EXPECT_TRUE(files_with(dir.path(), ".tmp.").empty());
}

TEST(CacheTrust, ReadOnlyMountServesWithJitDisabled) {
  TempDir t;
  const fs::path prewarm_dir = t.path() / "prewarmed";
  const fs::path mount_point = t.path() / "mnt";
  prewarmed(prewarm_dir);
  fs::create_directory(mount_point);
  fs::permissions(mount_point, fs::perms::owner_all);
  const int rc = in_child([&]() -> int {
    // A private mount namespace: the bind mount dies with this process.
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount(prewarm_dir.c_str(), mount_point.c_str(), nullptr, MS_BIND, nullptr) != 0 ||
        ::mount(nullptr, mount_point.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) !=
            0)
      return 77;
    const auto check = [](bool ok, int line) {
      if (!ok) std::fprintf(stderr, "child check failed at line %d\n", line);
      return ok;
    };
#define CHILD_CHECK(cond) \
  if (!check((cond), __LINE__)) return 1
    // The directory csa writes to, read-only, through the environment as a trainer sets it.
    ::setenv("CSA_CACHE_DIR", mount_point.c_str(), 1);
    ::setenv("CSA_DISABLE_JIT", "1", 1);
    {
      Runtime rt;
      const PrewarmReport r = rt.compile_for_arch(kConfig, "sm_90");
      CHILD_CHECK(!r.compiled && r.source == mount_point.string());
      CHILD_CHECK(!rt.cache_info().persistent);
      CHILD_CHECK(rt.cache_info().layers.at(0).state == "read-only");
      try {
        rt.compile_for_arch({1, 8, 1}, "sm_90");
        return 1;
      } catch (const Error& e) {
        CHILD_CHECK(e.code() == Status::kJitDisabled);
      }
    }
    // A read-only layer below an empty directory of the user's.
    ::setenv("CSA_CACHE_DIR", (t.path() / "home-cache").c_str(), 1);
    ::setenv("CSA_CACHE_PATH", mount_point.c_str(), 1);
    {
      Runtime rt;
      const PrewarmReport r = rt.compile_for_arch(kConfig, "sm_90");
      CHILD_CHECK(!r.compiled && r.source == mount_point.string());
    }
    // With JIT on, what is compiled goes to memory with one warning; nothing is written.
    ::unsetenv("CSA_DISABLE_JIT");
    ::setenv("CSA_CACHE_DIR", mount_point.c_str(), 1);
    ::unsetenv("CSA_CACHE_PATH");
    {
      Runtime rt;
      CHILD_CHECK(rt.compile_for_arch({1, 8, 1}, "sm_90").source == "memory");
      CHILD_CHECK(rt.compile_for_arch({3, 8, 1}, "sm_90").source == "memory");
    }
#undef CHILD_CHECK
    return 0;
  });
  if (rc == 77) GTEST_SKIP() << "needs root for a read-only bind mount in a mount namespace";
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(files_with(prewarm_dir, ".cubin").size(), 1u);
}

TEST(CacheTrust, SizeBoundEvictsLeastRecentlyUsedFirst) {
  TempDir dir;
  const Config a{1, 8, 1}, b{2, 8, 1}, c{3, 8, 1};
  std::int64_t total = 0;
  {
    Runtime rt(options_for(dir.path()));
    for (const Config& x : {a, b, c}) rt.compile_for_arch(x, "sm_90");
    total = rt.cache_info().bytes;
  }
  RuntimeOptions bounded = options_for(dir.path());
  bounded.cache_max_bytes = total - 1;  // all three do not fit
  const auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); };
  Runtime(options_for(dir.path())).clear_disk_cache();
  {
    Runtime rt(bounded);
    rt.compile_for_arch(a, "sm_90");
    pause();
    rt.compile_for_arch(b, "sm_90");
    pause();
  }
  EXPECT_FALSE(Runtime(bounded).compile_for_arch(a, "sm_90").compiled);  // a used again
  pause();
  Runtime rt(bounded);
  EXPECT_TRUE(rt.compile_for_arch(c, "sm_90").compiled);
  EXPECT_LE(rt.cache_info().bytes, bounded.cache_max_bytes);
  EXPECT_EQ(files_with(dir.path(), "-r2-").size(), 0u) << "b was least recently used";
  EXPECT_EQ(files_with(dir.path(), ".cubin").size(), 2u);
  EXPECT_FALSE(Runtime(bounded).compile_for_arch(a, "sm_90").compiled);
  EXPECT_FALSE(Runtime(bounded).compile_for_arch(c, "sm_90").compiled);
}

}  // namespace
}  // namespace csa::test
