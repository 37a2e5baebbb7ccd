// Kernel launch: one cuLaunchKernelEx with the by-value parameter struct, and the capture
// guard that every slow path (compile, load, allocation, device read) calls first.
#pragma once

#include <string>

#include "driver/driver.hpp"

namespace csa::launch {

struct LaunchShape {
  unsigned grid_x = 1, grid_y = 1, grid_z = 1;
  unsigned block_x = 1, block_y = 1, block_z = 1;
  unsigned shared_bytes = 0;
  // Programmatic dependent launch (sm_90+): the kernel may be scheduled while the previous
  // kernel in the stream still runs; it waits in pdl_enter() before touching memory.
  bool programmatic = false;
  // Thread-block clusters of this many CTAs along x (sm_90+; 0: none).
  unsigned cluster_x = 0;
};

// NOTE: a CUkernel from cuLibraryGetKernel may be launched as a CUfunction; it then runs in
// the calling thread's current context.
template <typename Params>
void launch(const driver::Driver& driver, CUkernel kernel, const LaunchShape& shape,
            const Params& params, CUstream stream, const char* what) {
  CUlaunchConfig config{};
  config.gridDimX = shape.grid_x;
  config.gridDimY = shape.grid_y;
  config.gridDimZ = shape.grid_z;
  config.blockDimX = shape.block_x;
  config.blockDimY = shape.block_y;
  config.blockDimZ = shape.block_z;
  config.sharedMemBytes = shape.shared_bytes;
  config.hStream = stream;
  CUlaunchAttribute attributes[2] = {};
  unsigned count = 0;
  if (shape.programmatic) {
    attributes[count].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[count].value.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (shape.cluster_x > 0) {
    attributes[count].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attributes[count].value.clusterDim.x = shape.cluster_x;
    attributes[count].value.clusterDim.y = 1;
    attributes[count].value.clusterDim.z = 1;
    ++count;
  }
  config.attrs = count > 0 ? attributes : nullptr;
  config.numAttrs = count;
  void* args[] = {const_cast<Params*>(&params)};
  driver.check(
      driver.api().cuLaunchKernelEx(&config, reinterpret_cast<CUfunction>(kernel), args, nullptr),
      what);
}

bool is_capturing(const driver::Driver& driver, CUstream stream);

// Throws Error(kCaptureUnsafe) naming `action` and `config` when `stream` is capturing;
// `prewarm_spec` is the `csa prewarm --config` argument that makes the call capture-safe.
void ensure_not_capturing(const driver::Driver& driver, CUstream stream, const std::string& action,
                          const std::string& config, const std::string& prewarm_spec);

}  // namespace csa::launch
