#include "cache/kernel_store.hpp"

#include <chrono>

#include "common/error.hpp"

namespace csa::cache {

std::shared_ptr<const StoredCubin> KernelStore::compile(const CacheKey& key,
                                                        const nvrtc::CompileRequest& request,
                                                        const CompileFn& compile_fn) {
  if (!jit_enabled_) {
    fail(Status::kJitDisabled,
         "{} is not in the kernel cache and JIT is disabled (CSA_DISABLE_JIT); prewarm it first "
         "with `csa prewarm` or Runtime::prewarm",
         key.label);
  }
  auto stored = std::make_shared<StoredCubin>();
  nvrtc::CompileResult result =
      compile_fn ? compile_fn(compiler_, request) : compiler_.compile(request);
  if (result.lowered_names.size() != request.name_expressions.size()) {
    fail(Status::kInternal, "compiling {} gave {} kernel names for {} name expressions", key.label,
         result.lowered_names.size(), request.name_expressions.size());
  }
  logger_.info("compiled {} in {:.2f} s", key.label, result.seconds);
  stored->entry.cubin = std::move(result.cubin);
  stored->entry.lowered_names = std::move(result.lowered_names);
  stored->entry.log = std::move(result.log);
  stored->compiled = true;
  stored->seconds = result.seconds;
  stored->source = disk_.store(key, stored->entry);
  return stored;
}

std::shared_ptr<const StoredCubin> KernelStore::get(const CacheKey& key,
                                                    const nvrtc::CompileRequest& request,
                                                    bool* compiled, const CompileFn& compile_fn) {
  bool created = false;
  auto stored_cubin = entries_.get_or_create(
      key.hash,
      [&]() -> std::shared_ptr<const StoredCubin> {
        const auto start = std::chrono::steady_clock::now();
        // The ptxas report read back feeds prewarm's reports: one ptxas could not have
        // written makes the entry a corrupt one.
        const auto check = [](const CubinEntry& entry) {
          bool malformed = false;
          nvrtc::parse_ptxas_report(entry.log, &malformed);
          return malformed ? std::string("malformed ptxas report") : std::string();
        };
        if (auto hit = disk_.load(key, request.name_expressions.size(), check)) {
          auto stored = std::make_shared<StoredCubin>();
          stored->entry = std::move(hit->entry);
          stored->source = std::move(hit->source);
          stored->seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          return stored;
        }
        return compile(key, request, compile_fn);
      },
      &created);
  if (compiled != nullptr) *compiled = created && stored_cubin->compiled;
  return stored_cubin;
}

std::shared_ptr<const StoredCubin> KernelStore::rebuild(const CacheKey& key,
                                                        const nvrtc::CompileRequest& request,
                                                        const CompileFn& compile_fn) {
  entries_.forget(key.hash);
  return entries_.get_or_create(key.hash, [&] { return compile(key, request, compile_fn); });
}

}  // namespace csa::cache
