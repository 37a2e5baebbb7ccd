// Compile-or-load of cubins: the in-process table first, then the disk cache, then NVRTC
// (one compile per key even when many threads miss it together).
#pragma once

#include <functional>
#include <memory>

#include "cache/disk_cache.hpp"
#include "cache/once_map.hpp"
#include "nvrtc/compiler.hpp"

namespace csa::cache {

struct StoredCubin {
  CubinEntry entry;
  bool compiled = false;  // by NVRTC (false: read from disk)
  double seconds = 0.0;   // compile or read time
  std::string source;     // the directory it was read from or stored in, or "memory"
};

// How a miss is compiled: NVRTC on the request by default; a caller may compile it its own way
// (register fitting compiles some modules twice) as long as the result has one lowered name
// per name expression of the request.
using CompileFn =
    std::function<nvrtc::CompileResult(const nvrtc::Compiler&, const nvrtc::CompileRequest&)>;

class KernelStore {
 public:
  KernelStore(DiskCache& disk, const nvrtc::Compiler& compiler, bool jit_enabled, Logger& logger)
      : disk_(disk), compiler_(compiler), jit_enabled_(jit_enabled), logger_(logger) {}

  // Throws Error(kJitDisabled) on a miss when JIT is disabled, Error(kCompileError) on failure.
  // `compiled` (optional): whether this call ran NVRTC.
  std::shared_ptr<const StoredCubin> get(const CacheKey& key, const nvrtc::CompileRequest& request,
                                         bool* compiled = nullptr,
                                         const CompileFn& compile_fn = {});

  // For a cubin read from disk that the driver refuses to load: compiles it again (replacing
  // the disk entry) and serves that from now on. Throws as get() does.
  std::shared_ptr<const StoredCubin> rebuild(const CacheKey& key,
                                             const nvrtc::CompileRequest& request,
                                             const CompileFn& compile_fn = {});

  DiskCache& disk() { return disk_; }

 private:
  std::shared_ptr<const StoredCubin> compile(const CacheKey& key,
                                             const nvrtc::CompileRequest& request,
                                             const CompileFn& compile_fn);

  DiskCache& disk_;
  const nvrtc::Compiler& compiler_;
  bool jit_enabled_;
  Logger& logger_;
  OnceMap<std::shared_ptr<const StoredCubin>> entries_;
};

}  // namespace csa::cache
