// The cubin store. Layers, searched in order: the directory csa writes to ($CSA_CACHE_DIR,
// else $XDG_CACHE_HOME/csa, else ~/.cache/csa; owned by the current user, 0700, created on
// the first store), then read-only layers ($CSA_CACHE_PATH, the prebuilt kernels installed
// with the library; owned by the current user or root). Every layer is a TrustedDir. Entries
// are published by temp file + rename, so that readers never see a partial one and many
// processes may fill the directory at once; its size is bounded, least recently used entries
// going first. What cannot be written to disk is kept in memory, after one warning.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cache/entry.hpp"
#include "cache/trusted_dir.hpp"
#include "common/logger.hpp"
#include "csa/csa.hpp"

namespace csa::cache {

struct DiskCacheOptions {
  std::string directory;               // empty: memory only, silently (switched off)
  std::vector<std::string> read_only;  // searched after `directory`, never written
  std::int64_t max_bytes = 4LL << 30;  // bound of `directory`'s entries
};

// Entry file names: "<label>-<32 hex digits>.cubin"; temp files add ".tmp.<pid>.<8 hex>".
std::string entry_file_name(const CacheKey& key);
bool is_entry_file_name(const std::string& name);
bool is_temp_file_name(const std::string& name);

class DiskCache {
 public:
  DiskCache(DiskCacheOptions options, Logger& logger);

  struct Hit {
    CubinEntry entry;
    std::string source;  // the directory it was read from, or "memory"
  };
  // A valid entry for `key` holding `kernels` kernels, or nullopt. An entry that is not one
  // (corrupt, truncated, hostile, not a regular file, or refused by `check`, which returns
  // why) is reported and, in the directory csa writes to, removed; it will be rebuilt.
  using EntryCheck = std::function<std::string(const CubinEntry&)>;
  std::optional<Hit> load(const CacheKey& key, std::size_t kernels, const EntryCheck& check = {});
  // Where the entry went: the directory, or "memory".
  std::string store(const CacheKey& key, const CubinEntry& entry);

  CacheInfo info() const;  // creates nothing
  // Removes csa's own entries (name form and magic) and its stale temp files from the
  // directory csa writes to; throws Error(kCacheError) when that directory is refused.
  std::int64_t clear();
  bool persistent() const;

  static std::string default_directory();

 private:
  const TrustedDir* writable_dir();  // opens (creates) the directory on first use; or null
  void warn_memory_only(const std::string& why);
  void evict_beyond_bound(const TrustedDir& dir, const std::string& keep);

  DiskCacheOptions options_;
  Logger& logger_;
  mutable std::mutex dir_mutex_;
  std::unique_ptr<TrustedDir> primary_;  // set once, then never replaced
  std::string primary_refused_;          // why the directory is not used (empty: it is)
  bool primary_tried_ = false;           // creation was attempted
  std::vector<std::unique_ptr<TrustedDir>> layers_;
  std::vector<std::pair<std::string, std::string>> refused_layers_;  // path, why
  std::once_flag warned_;
  mutable std::mutex memory_mutex_;
  std::map<std::string, CubinEntry> memory_;
};

}  // namespace csa::cache
