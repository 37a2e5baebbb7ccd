#include "compressor/record_cache.hpp"

#include "compressor/kernel_spec.hpp"

namespace csa::compressor {

RecordCache::Key RecordCache::key(const Config& c, int kernel_layout, Family family, int device) {
  return {c.ratio,       c.coff,
          c.head_dim,    static_cast<int>(c.dtype),
          kernel_layout, static_cast<int>(family),
          device,        epilogue_code(c.tail)};
}

std::shared_ptr<const Prepared> RecordCache::find(const Key& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = records_.find(key);
  return it == records_.end() ? nullptr : it->second;
}

std::shared_ptr<const Prepared> RecordCache::insert(const Key& key,
                                                    std::shared_ptr<const Prepared> record) {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_.emplace(key, std::move(record)).first->second;
}

void RecordCache::retire_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [key, record] : records_) retired_.push_back(std::move(record));
  records_.clear();
}

}  // namespace csa::compressor
