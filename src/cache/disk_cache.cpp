#include "cache/disk_cache.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <regex>

#include "common/env.hpp"
#include "common/error.hpp"

namespace csa::cache {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSuffix = ".cubin";
// A temp file younger than this may belong to a writer that is still running: never removed.
constexpr auto kStaleTempAge = std::chrono::hours(1);

const std::regex& entry_pattern() {
  static const std::regex pattern("[A-Za-z0-9_.-]+-[0-9a-f]{32}\\.cubin");
  return pattern;
}

const std::regex& temp_pattern() {
  static const std::regex pattern(
      "[A-Za-z0-9_.-]+-[0-9a-f]{32}\\.cubin\\.tmp\\.[0-9]+\\.[0-9a-f]{8}");
  return pattern;
}

std::string make_temp_name(const std::string& name) {
  thread_local std::mt19937 random(std::random_device{}());
  return fmt::format("{}.tmp.{}.{:08x}", name, ::getpid(), random());
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Usage {
  std::int64_t entries = 0;
  std::int64_t bytes = 0;
};

Usage usage_of(const TrustedDir& dir) {
  Usage u;
  for (const auto& f : dir.list()) {
    if (!f.regular || !is_entry_file_name(f.name)) continue;
    ++u.entries;
    u.bytes += f.bytes;
  }
  return u;
}

}  // namespace

std::string entry_file_name(const CacheKey& key) {
  return key.label + "-" + key.hash + kSuffix;
}

bool is_entry_file_name(const std::string& name) {
  return std::regex_match(name, entry_pattern());
}

bool is_temp_file_name(const std::string& name) {
  return std::regex_match(name, temp_pattern());
}

std::string DiskCache::default_directory() {
  if (auto dir = env::get("CSA_CACHE_DIR")) return *dir;
  if (auto xdg = env::get("XDG_CACHE_HOME")) return (fs::path(*xdg) / "csa").string();
  if (auto home = env::get("HOME")) return (fs::path(*home) / ".cache" / "csa").string();
  return {};
}

DiskCache::DiskCache(DiskCacheOptions options, Logger& logger)
    : options_(std::move(options)), logger_(logger) {
  if (!options_.directory.empty()) {
    // Opened now if it exists (and checked once, on the descriptor); created on the first store
    // otherwise, so that read-only commands create nothing.
    bool absent = false;
    std::string why;
    primary_ = TrustedDir::open(options_.directory, Owner::kCurrentUser, false, &why, &absent);
    if (!primary_ && !absent) primary_refused_ = why;
    if (primary_ && !primary_->writable()) {
      logger_.info("kernel cache directory {} is read-only: it serves loads only",
                   options_.directory);
    }
    if (!primary_refused_.empty()) warn_memory_only(primary_refused_);
  }
  for (const auto& path : options_.read_only) {
    if (path.empty()) continue;
    std::string why;
    bool absent = false;
    auto layer = TrustedDir::open(path, Owner::kCurrentUserOrRoot, false, &why, &absent);
    if (layer) {
      layers_.push_back(std::move(layer));
      continue;
    }
    refused_layers_.emplace_back(path, absent ? "absent" : "refused: " + why);
    if (absent) {
      logger_.debug("read-only kernel cache layer {} does not exist", path);
    } else {
      logger_.warn("read-only kernel cache layer refused ({}); it is not searched", why);
    }
  }
}

void DiskCache::warn_memory_only(const std::string& why) {
  std::call_once(warned_, [&] {
    logger_.warn("kernel cache directory unusable ({}); compiled kernels are kept in memory only",
                 why);
  });
}

const TrustedDir* DiskCache::writable_dir() {
  std::lock_guard<std::mutex> lock(dir_mutex_);
  if (!primary_ && primary_refused_.empty() && !primary_tried_ && !options_.directory.empty()) {
    primary_tried_ = true;
    std::string why;
    primary_ = TrustedDir::open(options_.directory, Owner::kCurrentUser, true, &why);
    if (!primary_) primary_refused_ = why;
  }
  return primary_ ? primary_.get() : nullptr;
}

bool DiskCache::persistent() const {
  std::lock_guard<std::mutex> lock(dir_mutex_);
  if (options_.directory.empty() || !primary_refused_.empty()) return false;
  return primary_ ? primary_->writable() : !primary_tried_;
}

std::optional<DiskCache::Hit> DiskCache::load(const CacheKey& key, std::size_t kernels,
                                              const EntryCheck& check) {
  {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    auto it = memory_.find(key.hash);
    if (it != memory_.end()) return Hit{it->second, "memory"};
  }
  const std::string name = entry_file_name(key);
  const TrustedDir* primary = nullptr;
  {
    std::lock_guard<std::mutex> lock(dir_mutex_);
    primary = primary_.get();
  }
  std::vector<const TrustedDir*> search;
  if (primary != nullptr) search.push_back(primary);
  for (const auto& layer : layers_) search.push_back(layer.get());
  for (const TrustedDir* dir : search) {
    std::vector<char> bytes;
    std::string why;
    const bool ours = dir == primary && dir->writable();
    const TrustedDir::Read read = dir->read(name, kMaxEntryBytes, ours, bytes, &why);
    if (read == TrustedDir::Read::kMissing) continue;
    std::optional<CubinEntry> entry;
    if (read == TrustedDir::Read::kOk) entry = decode_entry(bytes, key, kernels, &why);
    if (entry && check) {
      why = check(*entry);
      if (!why.empty()) entry.reset();
    }
    if (entry) {
      logger_.debug("cache hit {}/{}", dir->path(), name);
      return Hit{std::move(*entry), dir->path()};
    }
    if (ours) {
      logger_.warn("discarding cache entry {}/{}: {}; it will be rebuilt", dir->path(), name, why);
      dir->remove(name);
    } else {
      logger_.warn("ignoring cache entry {}/{}: {}", dir->path(), name, why);
    }
  }
  return std::nullopt;
}

std::string DiskCache::store(const CacheKey& key, const CubinEntry& entry) {
  if (!options_.directory.empty()) {
    std::string why;
    const TrustedDir* dir = writable_dir();
    const std::string name = entry_file_name(key);
    if (dir == nullptr) {
      std::lock_guard<std::mutex> lock(dir_mutex_);
      why = primary_refused_;
    } else if (!dir->writable()) {
      why = fmt::format("{} is read-only", dir->path());
    } else if (dir->publish(name, encode_entry(key, entry), make_temp_name, &why)) {
      logger_.debug("cache store {}/{}", dir->path(), name);
      evict_beyond_bound(*dir, name);
      return dir->path();
    }
    warn_memory_only(why);
  }
  std::lock_guard<std::mutex> lock(memory_mutex_);
  memory_[key.hash] = entry;
  return "memory";
}

void DiskCache::evict_beyond_bound(const TrustedDir& dir, const std::string& keep) {
  std::vector<TrustedDir::File> entries;
  std::int64_t total = 0;
  for (auto& f : dir.list()) {
    if (!f.regular || !is_entry_file_name(f.name)) continue;
    total += f.bytes;
    entries.push_back(std::move(f));
  }
  if (total <= options_.max_bytes) return;
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.mtime_ns < b.mtime_ns; });
  for (const auto& f : entries) {
    if (total <= options_.max_bytes) break;
    if (f.name == keep) continue;
    if (dir.remove(f.name)) {
      total -= f.bytes;
      logger_.info("evicted cache entry {}/{} (the cache holds at most {} bytes)", dir.path(),
                   f.name, options_.max_bytes);
    }
  }
}

CacheInfo DiskCache::info() const {
  CacheInfo info;
  info.directory = options_.directory;
  info.persistent = persistent();
  info.max_bytes = options_.max_bytes;
  if (!options_.directory.empty()) {
    CacheLayer layer;
    layer.directory = options_.directory;
    std::lock_guard<std::mutex> lock(dir_mutex_);
    if (primary_) {
      const Usage u = usage_of(*primary_);
      layer.entries = u.entries;
      layer.bytes = u.bytes;
      layer.state = primary_->writable() ? "writable" : "read-only";
    } else {
      layer.state = primary_refused_.empty() ? "absent (created on the first compile)"
                                             : "refused: " + primary_refused_;
    }
    info.entries += layer.entries;
    info.bytes += layer.bytes;
    info.layers.push_back(std::move(layer));
  }
  for (const auto& dir : layers_) {
    CacheLayer layer;
    layer.directory = dir->path();
    layer.read_only_layer = true;
    layer.state = "read-only";
    const Usage u = usage_of(*dir);
    layer.entries = u.entries;
    layer.bytes = u.bytes;
    info.layers.push_back(std::move(layer));
  }
  for (const auto& [path, state] : refused_layers_) {
    CacheLayer layer;
    layer.directory = path;
    layer.read_only_layer = true;
    layer.state = state;
    info.layers.push_back(std::move(layer));
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
  if (options_.directory.empty()) return removed;
  const TrustedDir* dir = nullptr;
  {
    std::lock_guard<std::mutex> lock(dir_mutex_);
    if (!primary_refused_.empty()) {
      fail(Status::kCacheError, "refusing to clear the kernel cache directory: {}",
           primary_refused_);
    }
    dir = primary_.get();
  }
  if (dir == nullptr) return removed;  // absent: nothing to clear
  if (!dir->writable()) {
    fail(Status::kCacheError, "cannot clear the kernel cache directory {}: it is read-only",
         dir->path());
  }
  const std::int64_t stale_before =
      now_ns() - std::chrono::duration_cast<std::chrono::nanoseconds>(kStaleTempAge).count();
  for (const auto& f : dir->list()) {
    if (!f.regular) continue;
    if (is_entry_file_name(f.name)) {
      // NOTE: a name of csa's form is not enough: only files that are csa entries go.
      if (dir->starts_with(f.name, entry_magic(), kEntryMagicBytes) && dir->remove(f.name))
        ++removed;
    } else if (is_temp_file_name(f.name) && f.mtime_ns < stale_before) {
      dir->remove(f.name);  // a writer that died before its rename
    }
  }
  return removed;
}

}  // namespace csa::cache
