// The in-memory module cache: each cubin is loaded once per process as a context-independent
// CUlibrary; a call then only looks its kernels up.
#pragma once

#include <memory>
#include <vector>

#include "cache/kernel_store.hpp"
#include "driver/driver.hpp"

namespace csa::cache {

struct LoadedModule {
  CUlibrary library = nullptr;
  std::vector<CUkernel> kernels;  // in the order of the request's name expressions
  std::shared_ptr<const StoredCubin> cubin;
};

class ModuleCache {
 public:
  explicit ModuleCache(const driver::Driver& driver) : driver_(driver) {}
  ~ModuleCache();
  ModuleCache(const ModuleCache&) = delete;
  ModuleCache& operator=(const ModuleCache&) = delete;

  std::shared_ptr<const LoadedModule> get(const CacheKey& key,
                                          const std::shared_ptr<const StoredCubin>& cubin);
  bool contains(const CacheKey& key) const { return modules_.contains(key.hash); }

 private:
  const driver::Driver& driver_;
  OnceMap<std::shared_ptr<const LoadedModule>> modules_;
};

}  // namespace csa::cache
