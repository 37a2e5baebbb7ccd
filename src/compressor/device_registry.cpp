#include "compressor/device_registry.hpp"

#include <fmt/format.h>

#include "common/error.hpp"
#include "nvrtc/compiler.hpp"

namespace csa::compressor {

DeviceTraits DeviceRegistry::traits(int ordinal) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = devices_.find(ordinal);
    if (it != devices_.end()) return it->second;
  }
  driver::Driver& d = loader_.get();
  const auto& api = d.api();
  int count = 0;
  d.check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= count) {
    fail(Status::kInvalidArgument, "device {} does not exist ({} CUDA devices)", ordinal, count);
  }
  CUdevice dev = 0;
  d.check(api.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  int major = 0;
  int minor = 0;
  DeviceTraits t;
  t.ordinal = ordinal;
  d.check(api.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
          "cuDeviceGetAttribute(major)");
  d.check(api.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
          "cuDeviceGetAttribute(minor)");
  d.check(api.cuDeviceGetAttribute(&t.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
          "cuDeviceGetAttribute(multiprocessor count)");
  d.check(api.cuDeviceGetAttribute(&t.sm.registers,
                                   CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, dev),
          "cuDeviceGetAttribute(registers per SM)");
  d.check(api.cuDeviceGetAttribute(&t.sm.threads,
                                   CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev),
          "cuDeviceGetAttribute(threads per SM)");
  d.check(
      api.cuDeviceGetAttribute(&t.sm.ctas, CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, dev),
      "cuDeviceGetAttribute(blocks per SM)");
  d.check(api.cuDeviceGetAttribute(&t.sm.shared_bytes,
                                   CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, dev),
          "cuDeviceGetAttribute(shared memory per SM)");
  if (major < 8) {
    fail(Status::kUnsupported, "device {} has compute capability {}.{}; csa needs 8.0 or newer",
         ordinal, major, minor);
  }
  t.arch = fmt::format("sm_{}{}", major, minor);
  t.cc_major = major;
  nvrtc::check_arch(t.arch);
  std::lock_guard<std::mutex> lock(mutex_);
  devices_.emplace(ordinal, t);
  return t;
}

int DeviceRegistry::current_device() {
  driver::Driver& d = loader_.get();
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    fail(Status::kInvalidArgument,
         "the calling thread has no current CUDA context; select a device first (cudaSetDevice, "
         "cuCtxSetCurrent or csa_set_device)");
  }
  CUdevice dev = 0;
  d.check(d.api().cuCtxGetDevice(&dev), "cuCtxGetDevice");
  return static_cast<int>(dev);
}

void DeviceRegistry::make_current(int device) {
  driver::Driver& d = loader_.get();
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) {
    CUdevice current = 0;
    d.check(d.api().cuCtxGetDevice(&current), "cuCtxGetDevice");
    if (current == device) return;
  }
  traits(device);  // validates the ordinal
  CUdevice dev = 0;
  d.check(d.api().cuDeviceGet(&dev, device), "cuDeviceGet");
  // NOTE: the primary context (the CUDA runtime's and the frameworks') is retained and never
  // released here: it is shared with everything else in the process.
  d.check(d.api().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  d.check(d.api().cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

}  // namespace csa::compressor
