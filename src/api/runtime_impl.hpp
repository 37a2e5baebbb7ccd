// What a Runtime owns. Construction order is destruction order reversed: the service and the
// module cache go before the driver they call.
#pragma once

#include <memory>
#include <string>

#include "cache/disk_cache.hpp"
#include "cache/kernel_store.hpp"
#include "common/logger.hpp"
#include "compressor/kernel_sources.hpp"
#include "compressor/service.hpp"
#include "csa/csa.hpp"
#include "driver/loader.hpp"

namespace csa {

// The prebuilt kernels' read-only layer: csa-kernels beside the library file (empty when the
// library's location is unknown).
std::string prebuilt_kernels_directory();

struct Runtime::Impl {
  // `injected`: a driver to use instead of loading libcuda (tests use a fake table).
  explicit Impl(RuntimeOptions opts, std::unique_ptr<driver::Driver> injected = nullptr)
      : options(std::move(opts)),
        logger(make_logger(options.log_level)),
        compiler(compressor::kernel_headers()),
        disk(disk_options(options, *logger), *logger),
        store(disk, compiler, options.jit_enabled, *logger),
        loader(std::move(injected)),
        service(options, *logger, store, loader) {}

  static cache::DiskCacheOptions disk_options(const RuntimeOptions& o, Logger& logger) {
    for (const auto& warning : o.warnings) logger.warn("{}", warning);
    cache::DiskCacheOptions d;
    if (!o.disk_cache) return d;
    d.directory = o.cache_dir.empty() ? cache::DiskCache::default_directory() : o.cache_dir;
    d.read_only = o.cache_layers;
    if (o.prebuilt_kernels) {
      if (std::string prebuilt = prebuilt_kernels_directory(); !prebuilt.empty())
        d.read_only.push_back(std::move(prebuilt));
    }
    d.max_bytes = o.cache_max_bytes;
    return d;
  }

  RuntimeOptions options;
  std::shared_ptr<Logger> logger;
  nvrtc::Compiler compiler;
  cache::DiskCache disk;
  cache::KernelStore store;
  driver::Loader loader;
  compressor::Service service;
};

// How the library's own units (the plan, the C ABI) and its white-box tests reach a Runtime's
// parts; not part of the public API.
struct RuntimeAccess {
  static Runtime::Impl& of(Runtime& runtime) { return *runtime.impl_; }
};

}  // namespace csa
