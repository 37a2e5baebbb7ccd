// A thread-safe map from key to a value computed once. The first caller computes outside the
// lock; concurrent callers of the same key wait for that result; other keys never wait.
// A failed computation is not kept: the next caller tries again.
#pragma once

#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace csa::cache {

template <typename Value>
class OnceMap {
 public:
  // `created` (optional) is set to true when this call ran `make`.
  Value get_or_create(const std::string& key, const std::function<Value()>& make,
                      bool* created = nullptr) {
    std::promise<Value> promise;
    std::shared_future<Value> future;
    bool owner = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = entries_.find(key);
      if (it == entries_.end()) {
        future = promise.get_future().share();
        entries_.emplace(key, future);
        owner = true;
      } else {
        future = it->second;
      }
    }
    if (created != nullptr) *created = owner;
    if (!owner) return future.get();
    try {
      promise.set_value(make());
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        entries_.erase(key);
      }
      promise.set_exception(std::current_exception());
    }
    return future.get();
  }

  // Drops a computed value, so that the next caller computes it again (a pending one stays).
  void forget(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(key);
    if (it != entries_.end() &&
        it->second.wait_for(std::chrono::seconds(0)) == std::future_status::ready)
      entries_.erase(it);
  }

  bool contains(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.count(key) != 0;
  }

  // Ready values only (for teardown and statistics).
  std::vector<Value> ready_values() const {
    std::vector<Value> out;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [key, future] : entries_) {
      if (future.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        try {
          out.push_back(future.get());
        } catch (...) {  // NOLINT(bugprone-empty-catch): failed entries are being retried
        }
      }
    }
    return out;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_future<Value>> entries_;
};

}  // namespace csa::cache
