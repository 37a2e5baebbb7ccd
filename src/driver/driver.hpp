// The CUDA driver, loaded with dlopen on first device use; libcsa.so never links libcuda.
// Every entry point is resolved through cuGetProcAddress with an explicit ABI version, so a
// newer driver cannot hand us a different signature.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <memory>
#include <string>

#include "csa/csa.hpp"

namespace csa::driver {

// X(name, abi version): the PFN_<name>_v<version> typedef from cudaTypedefs.h.
#define CSA_DRIVER_FUNCTIONS(X)         \
  X(cuInit, 2000)                       \
  X(cuDriverGetVersion, 2020)           \
  X(cuDeviceGet, 2000)                  \
  X(cuDeviceGetCount, 2000)             \
  X(cuDeviceGetName, 2000)              \
  X(cuDeviceGetAttribute, 2000)         \
  X(cuDeviceTotalMem, 3020)             \
  X(cuDevicePrimaryCtxRetain, 7000)     \
  X(cuDevicePrimaryCtxRelease, 11000)   \
  X(cuCtxGetCurrent, 4000)              \
  X(cuCtxSetCurrent, 4000)              \
  X(cuCtxGetDevice, 2000)               \
  X(cuLibraryLoadData, 12000)           \
  X(cuLibraryUnload, 12000)             \
  X(cuLibraryGetKernel, 12000)          \
  X(cuKernelGetAttribute, 12000)        \
  X(cuKernelSetAttribute, 12000)        \
  X(cuKernelGetFunction, 12000)         \
  X(cuStreamBeginCapture, 10010)        \
  X(cuStreamEndCapture, 10000)          \
  X(cuGraphInstantiateWithFlags, 11040) \
  X(cuGraphLaunch, 10000)               \
  X(cuGraphExecDestroy, 10000)          \
  X(cuGraphDestroy, 10000)              \
  X(cuLaunchKernelEx, 11060)            \
  X(cuStreamIsCapturing, 10000)         \
  X(cuStreamGetId, 12000)               \
  X(cuCtxGetId, 12000)                  \
  X(cuStreamCreate, 2000)               \
  X(cuStreamDestroy, 4000)              \
  X(cuStreamSynchronize, 2000)          \
  X(cuMemAlloc, 3020)                   \
  X(cuMemFree, 3020)                    \
  X(cuMemAllocAsync, 11020)             \
  X(cuMemFreeAsync, 11020)              \
  X(cuMemcpyHtoD, 3020)                 \
  X(cuMemcpyDtoH, 3020)                 \
  X(cuMemcpyDtoDAsync, 3020)            \
  X(cuMemsetD8Async, 3020)              \
  X(cuMemsetD32Async, 3020)             \
  X(cuEventCreate, 2000)                \
  X(cuEventDestroy, 4000)               \
  X(cuEventRecord, 2000)                \
  X(cuEventSynchronize, 2000)           \
  X(cuEventElapsedTime, 2000)           \
  X(cuGetErrorName, 6000)               \
  X(cuGetErrorString, 6000)

struct Api {
#define CSA_DECLARE_ENTRY(name, ver) PFN_##name##_v##ver name = nullptr;
  CSA_DRIVER_FUNCTIONS(CSA_DECLARE_ENTRY)
#undef CSA_DECLARE_ENTRY
};

class Driver {
 public:
  // Loads libcuda.so.1 (or $CSA_LIBCUDA_PATH), resolves the table and calls cuInit.
  // Throws Error(kDriverUnavailable) when there is no usable driver.
  static std::unique_ptr<Driver> load();
  // For tests: a table built by the caller (fake driver).
  explicit Driver(const Api& api, void* handle = nullptr) : api_(api), handle_(handle) {}
  ~Driver();
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  const Api& api() const { return api_; }
  int version() const { return version_; }

  // Throws Error(kDriverError) naming `what` and the driver's error name, unless CUDA_SUCCESS.
  void check(CUresult result, const char* what) const;
  std::string error_text(CUresult result) const;

 private:
  Api api_;
  void* handle_ = nullptr;
  int version_ = 0;
};

}  // namespace csa::driver
