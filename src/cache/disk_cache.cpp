#include "cache/disk_cache.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/env.hpp"

namespace csa::cache {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSuffix = ".cubin";

// mkdir -p with mode 0700 for every directory it creates.
bool make_private_dirs(const fs::path& dir, std::string* why) {
  fs::path partial;
  for (const auto& part : dir) {
    partial /= part;
    if (partial.empty() || partial == partial.root_path()) continue;
    if (::mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) {
      *why = fmt::format("cannot create {}: {}", partial.string(), std::strerror(errno));
      return false;
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *why = fmt::format("{} is not a directory", dir.string());
    return false;
  }
  // NOTE: we load executable code from here; a directory others can write to is refused.
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    *why = fmt::format("{} is writable by group or others", dir.string());
    return false;
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    *why = fmt::format("{} is not writable: {}", dir.string(), std::strerror(errno));
    return false;
  }
  return true;
}

bool read_file(const std::string& path, std::vector<char>& bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

// Writes all of `bytes` to a new file and fsyncs it; false (errno kept) on failure.
bool write_and_sync(const std::string& path, const std::vector<char>& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      ::close(fd);
      errno = saved;
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  const bool ok = ::fsync(fd) == 0;
  const int saved = errno;
  ::close(fd);
  errno = saved;
  return ok;
}

}  // namespace

std::string DiskCache::default_directory() {
  if (auto dir = env::get("CSA_CACHE_DIR")) return *dir;
  if (auto xdg = env::get("XDG_CACHE_HOME")) return (fs::path(*xdg) / "csa").string();
  if (auto home = env::get("HOME")) return (fs::path(*home) / ".cache" / "csa").string();
  return {};
}

DiskCache::DiskCache(std::string directory, Logger& logger)
    : directory_(std::move(directory)), logger_(logger) {
  if (directory_.empty()) return;
  std::string why;
  if (make_private_dirs(directory_, &why)) {
    persistent_ = true;
  } else {
    fall_back_to_memory(why);
  }
}

void DiskCache::fall_back_to_memory(const std::string& why) {
  persistent_ = false;
  std::call_once(warned_, [&] {
    logger_.warn("kernel cache directory unusable ({}); compiled kernels are kept in memory only",
                 why);
  });
}

std::string DiskCache::path_of(const CacheKey& key) const {
  return (fs::path(directory_) / (key.label + "-" + key.hash + kSuffix)).string();
}

std::optional<CubinEntry> DiskCache::load(const CacheKey& key) {
  {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    auto it = memory_.find(key.hash);
    if (it != memory_.end()) return it->second;
  }
  if (!persistent()) return std::nullopt;
  const std::string path = path_of(key);
  std::vector<char> bytes;
  if (!read_file(path, bytes)) return std::nullopt;
  std::string why;
  auto entry = decode_entry(bytes, key, &why);
  if (!entry) {
    logger_.warn("discarding cache entry {}: {}; it will be rebuilt", path, why);
    ::unlink(path.c_str());
    return std::nullopt;
  }
  logger_.debug("cache hit {}", path);
  return entry;
}

void DiskCache::store(const CacheKey& key, const CubinEntry& entry) {
  if (persistent()) {
    const std::string path = path_of(key);
    std::random_device rd;
    const std::string tmp = fmt::format("{}.tmp.{}.{:08x}", path, ::getpid(), rd());
    const std::vector<char> bytes = encode_entry(key, entry);
    // NOTE: rename() within one directory is atomic on POSIX file systems: a reader sees the old
    // file, the new one, or none, never a partial one. Racing writers each publish a complete
    // entry (identical bytes: compiles are reproducible); the last rename wins, and every
    // writer's temp file is gone with its own rename.
    if (write_and_sync(tmp, bytes) && ::rename(tmp.c_str(), path.c_str()) == 0) {
      const int dir_fd = ::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dir_fd >= 0) {
        ::fsync(dir_fd);
        ::close(dir_fd);
      }
      logger_.debug("cache store {}", path);
      return;
    }
    const std::string why = fmt::format("cannot write {}: {}", tmp, std::strerror(errno));
    ::unlink(tmp.c_str());
    fall_back_to_memory(why);
  }
  std::lock_guard<std::mutex> lock(memory_mutex_);
  memory_[key.hash] = entry;
}

CacheInfo DiskCache::info() const {
  CacheInfo info;
  info.directory = directory_;
  info.persistent = persistent_;
  if (persistent_) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(directory_, ec)) {
      if (e.is_regular_file(ec) && e.path().extension() == kSuffix) {
        ++info.entries;
        info.bytes += static_cast<std::int64_t>(e.file_size(ec));
      }
    }
  }
  std::lock_guard<std::mutex> lock(memory_mutex_);
  for (const auto& [hash, entry] : memory_) {
    ++info.entries;
    info.bytes += static_cast<std::int64_t>(entry.cubin.size());
  }
  return info;
}

std::int64_t DiskCache::clear() {
  std::int64_t removed = 0;
  {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    removed += static_cast<std::int64_t>(memory_.size());
    memory_.clear();
  }
  if (directory_.empty()) return removed;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(directory_, ec)) {
    const std::string name = e.path().filename().string();
    const bool entry = e.path().extension() == kSuffix;
    const bool temp = name.find(std::string(kSuffix) + ".tmp.") != std::string::npos;
    if ((entry || temp) && fs::remove(e.path(), ec) && entry) ++removed;
  }
  return removed;
}

}  // namespace csa::cache
