#include "cache/module_cache.hpp"

#include "common/error.hpp"

namespace csa::cache {

ModuleCache::~ModuleCache() {
  for (const auto& module : modules_.ready_values()) {
    // Errors are ignored: at process exit the driver may already be shutting down.
    if (module && module->library != nullptr) driver_.api().cuLibraryUnload(module->library);
  }
}

std::shared_ptr<const LoadedModule> ModuleCache::get(
    const CacheKey& key, const std::shared_ptr<const StoredCubin>& cubin) {
  return modules_.get_or_create(key.hash, [&]() -> std::shared_ptr<const LoadedModule> {
    const auto& api = driver_.api();
    auto module = std::make_shared<LoadedModule>();
    module->cubin = cubin;
    driver_.check(api.cuLibraryLoadData(&module->library, cubin->entry.cubin.data(), nullptr,
                                        nullptr, 0, nullptr, nullptr, 0),
                  "cuLibraryLoadData");
    for (const auto& name : cubin->entry.lowered_names) {
      CUkernel kernel = nullptr;
      const CUresult rc = api.cuLibraryGetKernel(&kernel, module->library, name.c_str());
      if (rc != CUDA_SUCCESS) {
        api.cuLibraryUnload(module->library);
        fail(Status::kDriverError, "cuLibraryGetKernel({}) for {} failed: {}", name, key.label,
             driver_.error_text(rc));
      }
      module->kernels.push_back(kernel);
    }
    return module;
  });
}

}  // namespace csa::cache
