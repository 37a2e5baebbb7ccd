// Helpers of the disk-cache tests: temporary directories, runtimes over one directory, child
// processes, and entries forged with a valid checksum (so that what lies behind the checksum
// is what gets tested).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "csa/csa.hpp"
#include "nvrtc/compiler.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace csa::test {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/csa-cache-test-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

inline RuntimeOptions options_for(const fs::path& dir) {
  RuntimeOptions o;
  o.cache_dir = dir.string();
  o.disk_cache = true;
  o.prebuilt_kernels = false;
  return o;
}

inline const Config kConfig{2, 8, 1};  // small and quick to compile

inline std::vector<fs::path> files_with(const fs::path& dir, const std::string& needle) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().find(needle) != std::string::npos) out.push_back(e.path());
  return out;
}

inline nvrtc::CompileRequest request() {
  nvrtc::CompileRequest r;
  r.source = "#include \"short_window.cuh\"\n";
  r.name_expressions = {"csa_kernel::short_window_forward<2,1,8,2,256>"};
  r.options = {"-std=c++17", "--fmad=false"};
  r.arch = "sm_90";
  return r;
}

// Runs `body` in a child process; its exit code (0: passed), or -1 when it died.
inline int in_child(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = body();
    } catch (...) {
      rc = 3;
    }
    ::_exit(rc);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// An entry's parts (see cache/entry.hpp) and forged entries with a valid checksum.
struct EntryParts {
  nlohmann::json header;
  std::vector<char> cubin;
};

inline EntryParts split_entry(const std::vector<char>& bytes) {
  std::uint32_t header_size = 0;
  std::memcpy(&header_size, bytes.data() + 8, 4);
  EntryParts parts;
  parts.header = nlohmann::json::parse(bytes.begin() + 12, bytes.begin() + 12 + header_size);
  const std::size_t cubin_at = 12 + header_size + 8;
  parts.cubin.assign(bytes.begin() + static_cast<std::ptrdiff_t>(cubin_at), bytes.end() - 8);
  return parts;
}

// `tail` replaces the cubin-size field and the cubin when given.
inline std::vector<char> forge(const nlohmann::json& header, const std::vector<char>& cubin,
                               const std::vector<char>* tail = nullptr) {
  const std::string text = header.dump();
  std::vector<char> out = {'C', 'S', 'A', 'C', 'U', 'B', '0', '1'};
  const auto put64 = [&](std::uint64_t v) {
    const char* p = reinterpret_cast<const char*>(&v);
    out.insert(out.end(), p, p + 8);
  };
  const auto size = static_cast<std::uint32_t>(text.size());
  out.insert(out.end(), reinterpret_cast<const char*>(&size),
             reinterpret_cast<const char*>(&size) + 4);
  out.insert(out.end(), text.begin(), text.end());
  if (tail != nullptr) {
    out.insert(out.end(), tail->begin(), tail->end());
  } else {
    put64(cubin.size());
    out.insert(out.end(), cubin.begin(), cubin.end());
  }
  put64(XXH3_64bits(out.data(), out.size()));
  return out;
}

}  // namespace csa::test
