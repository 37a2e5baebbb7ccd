// The prepared records of a service, one per (configuration, kernel layout, family, device):
// looked up on every call, replaced wholesale when the schedule tables change (the old ones
// stay alive for callers that hold them, and are never handed out again).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "compressor/prepared.hpp"

namespace csa::compressor {

class RecordCache {
 public:
  // ratio, coff, head_dim, dtype, kernel layout, family, device, epilogue (the tail's code)
  using Key = std::tuple<int, int, int, int, int, int, int, int>;
  static Key key(const Config& config, int kernel_layout, Family family, int device);

  std::shared_ptr<const Prepared> find(const Key& key) const;
  // Keeps `record` unless one was inserted first; returns the one kept.
  std::shared_ptr<const Prepared> insert(const Key& key, std::shared_ptr<const Prepared> record);
  void retire_all();

 private:
  mutable std::mutex mutex_;
  std::map<Key, std::shared_ptr<const Prepared>> records_;
  std::vector<std::shared_ptr<const Prepared>> retired_;
};

}  // namespace csa::compressor
