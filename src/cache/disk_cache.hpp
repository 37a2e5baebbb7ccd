// The cubin store: one file per entry in a 0700 directory, published by temp file + rename so
// that readers never see a partial entry and many processes may fill it at once. When no
// directory is usable it keeps entries in memory, after one warning.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "cache/entry.hpp"
#include "common/logger.hpp"
#include "csa/csa.hpp"

namespace csa::cache {

class DiskCache {
 public:
  // `directory` empty: memory only, silently (persistence was switched off).
  DiskCache(std::string directory, Logger& logger);

  // A valid entry for `key`, or nullopt. A corrupt or truncated file is removed with a warning.
  std::optional<CubinEntry> load(const CacheKey& key);
  void store(const CacheKey& key, const CubinEntry& entry);

  CacheInfo info() const;
  std::int64_t clear();  // entries removed
  bool persistent() const { return persistent_.load(); }
  std::string path_of(const CacheKey& key) const;

  // $CSA_CACHE_DIR, else $XDG_CACHE_HOME/csa, else $HOME/.cache/csa (empty if none is set).
  static std::string default_directory();

 private:
  void fall_back_to_memory(const std::string& why);

  std::string directory_;
  Logger& logger_;
  std::atomic<bool> persistent_{false};
  std::once_flag warned_;
  mutable std::mutex memory_mutex_;
  std::map<std::string, CubinEntry> memory_;
};

}  // namespace csa::cache
