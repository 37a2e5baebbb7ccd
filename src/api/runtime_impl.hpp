// What a Runtime owns. Construction order is destruction order reversed: the service and the
// module cache go before the driver they call.
#pragma once

#include <memory>

#include "cache/disk_cache.hpp"
#include "cache/kernel_store.hpp"
#include "common/logger.hpp"
#include "compressor/kernel_sources.hpp"
#include "compressor/service.hpp"
#include "csa/csa.hpp"
#include "driver/loader.hpp"

namespace csa {

struct Runtime::Impl {
  // `injected`: a driver to use instead of loading libcuda (tests use a fake table).
  explicit Impl(RuntimeOptions opts, std::unique_ptr<driver::Driver> injected = nullptr)
      : options(std::move(opts)),
        logger(make_logger(options.log_level)),
        compiler(compressor::kernel_headers()),
        disk(options.disk_cache ? (options.cache_dir.empty() ? cache::DiskCache::default_directory()
                                                             : options.cache_dir)
                                : std::string(),
             *logger),
        store(disk, compiler, options.jit_enabled, *logger),
        loader(std::move(injected)),
        service(options, *logger, store, loader) {}

  RuntimeOptions options;
  std::shared_ptr<Logger> logger;
  nvrtc::Compiler compiler;
  cache::DiskCache disk;
  cache::KernelStore store;
  driver::Loader loader;
  compressor::Service service;
};

}  // namespace csa
