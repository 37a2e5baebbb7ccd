#include "cache/kernel_store.hpp"

#include <chrono>

#include "common/error.hpp"

namespace csa::cache {

std::shared_ptr<const StoredCubin> KernelStore::get(const CacheKey& key,
                                                    const nvrtc::CompileRequest& request,
                                                    bool* compiled) {
  bool created = false;
  auto stored_cubin = entries_.get_or_create(
      key.hash,
      [&]() -> std::shared_ptr<const StoredCubin> {
        auto stored = std::make_shared<StoredCubin>();
        const auto start = std::chrono::steady_clock::now();
        if (auto entry = disk_.load(key)) {
          stored->entry = std::move(*entry);
          stored->seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          return stored;
        }
        if (!jit_enabled_) {
          fail(Status::kJitDisabled,
               "{} is not in the kernel cache and JIT is disabled (CSA_DISABLE_JIT); prewarm it "
               "first "
               "with `csa prewarm` or Runtime::prewarm",
               key.label);
        }
        nvrtc::CompileResult result = compiler_.compile(request);
        logger_.info("compiled {} in {:.2f} s", key.label, result.seconds);
        stored->entry.cubin = std::move(result.cubin);
        stored->entry.lowered_names = std::move(result.lowered_names);
        stored->entry.log = std::move(result.log);
        stored->compiled = true;
        stored->seconds = result.seconds;
        disk_.store(key, stored->entry);
        return stored;
      },
      &created);
  if (compiled != nullptr) *compiled = created && stored_cubin->compiled;
  return stored_cubin;
}

}  // namespace csa::cache
