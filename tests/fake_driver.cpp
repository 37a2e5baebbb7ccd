// The fake driver's entry points and call arguments (see fake_driver.hpp).
#include "fake_driver.hpp"

#include <algorithm>
#include <cstring>

#include "csa_params.h"

namespace csa::test {

FakeState& state() {
  static FakeState s;
  return s;
}

namespace {

CUresult CUDAAPI fake_ctx_get_current(CUcontext* ctx) {
  *ctx = reinterpret_cast<CUcontext>(static_cast<std::uintptr_t>(0x1000 + state().current_device));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_ctx_get_device(CUdevice* dev) {
  *dev = state().current_device;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_device_get_count(int* n) {
  *n = 2;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_device_get(CUdevice* dev, int ordinal) {
  *dev = ordinal;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_device_get_attribute(int* value, CUdevice_attribute attr, CUdevice dev) {
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *value = dev == 0 ? 9 : 8;
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
      *value = 0;
      break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
      *value = dev == 0 ? 132 : 108;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR:
      *value = 65536;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR:
      *value = 2048;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR:
      *value = 32;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR:
      *value = 233472;
      break;
    default:
      *value = 0;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_stream_is_capturing(CUstream, CUstreamCaptureStatus* status) {
  *status = state().capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_library_load_data(CUlibrary* lib, const void* image, CUjit_option*, void**,
                                        unsigned, CUlibraryOption*, void**, unsigned) {
  // As the driver does, an image that is not an ELF cubin is refused.
  if (std::memcmp(image,
                  "\x7f"
                  "ELF",
                  4) != 0) {
    ++state().refused_loads;
    return CUDA_ERROR_INVALID_IMAGE;
  }
  ++state().library_loads;
  *lib = reinterpret_cast<CUlibrary>(0x2000);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_library_unload(CUlibrary) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_library_get_kernel(CUkernel* kernel, CUlibrary, const char* name) {
  std::lock_guard<std::mutex> lock(state().mutex);
  auto& names = state().kernel_names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) it = names.insert(names.end(), name);
  *kernel =
      reinterpret_cast<CUkernel>(0x3000 + 16 * static_cast<std::uintptr_t>(it - names.begin()));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_kernel_get_attribute(int* value, CUfunction_attribute attr, CUkernel,
                                           CUdevice) {
  ++state().attribute_queries;
  *value = attr == CU_FUNC_ATTRIBUTE_NUM_REGS ? 64 : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_kernel_set_attribute(CUfunction_attribute, int, CUkernel, CUdevice) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_launch(const CUlaunchConfig* config, CUfunction f, void** params, void**) {
  ++state().launches;
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto index = (reinterpret_cast<std::uintptr_t>(f) - 0x3000) / 16;
  state().launched.push_back(index < state().kernel_names.size() ? state().kernel_names[index]
                                                                 : "?");
  state().last_grid = {config->gridDimX, config->gridDimY, config->blockDimX, config->blockDimY};
  state().grids.push_back(state().last_grid);
  // Every kernel takes one by-value parameter struct.
  if (state().launched.back().find("ape_reduce") != std::string::npos) {
    const auto* reduce = static_cast<const csa_kernel::ApeReduceParams*>(params[0]);
    state().reduce_dependents_first.push_back(reduce->dependents_first);
    state().reduce_grids.push_back(state().last_grid);
  }
  state().last_programmatic =
      config->numAttrs == 1 &&
      config->attrs[0].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION &&
      config->attrs[0].value.programmaticStreamSerializationAllowed == 1;
  const std::string& name = state().launched.back();
  if (name.find("window_backward") != std::string::npos ||
      name.find("tail_row_stats") != std::string::npos) {
    const auto* p = static_cast<const csa_kernel::BackwardParams*>(params[0]);
    state().backward_launches.push_back({name, reinterpret_cast<std::uintptr_t>(p->row_stats),
                                         reinterpret_cast<std::uintptr_t>(p->workspace),
                                         state().last_programmatic});
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_get_id(unsigned long long* id) {
  *id = 7;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_ctx_get_id(CUcontext ctx, unsigned long long* id) {
  ++state().context_id_queries;
  *id = reinterpret_cast<std::uintptr_t>(ctx);
  return CUDA_SUCCESS;
}
// A stream's id: its handle for the handles tests create; the special handles get one id,
// whatever the context (the worst case for the workspace key).
CUresult CUDAAPI fake_stream_get_id(CUstream stream, unsigned long long* id) {
  const auto handle = reinterpret_cast<std::uintptr_t>(stream);
  if (handle <= 2) return fake_get_id(id);
  *id = handle;
  return CUDA_SUCCESS;
}
auto* const kOwnStream = reinterpret_cast<CUstream>(0x7000);
CUresult CUDAAPI fake_stream_create(CUstream* stream, unsigned) {
  ++state().own_streams_open;
  *stream = kOwnStream;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_stream_destroy(CUstream) {
  --state().own_streams_open;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_stream_synchronize(CUstream) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_mem_alloc_async(CUdeviceptr* ptr, std::size_t, CUstream stream) {
  ++(stream == kOwnStream ? state().slab_allocations : state().allocations);
  *ptr = 0x40000;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_mem_free_async(CUdeviceptr, CUstream) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_mem_free(CUdeviceptr) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_memset(CUdeviceptr, unsigned, std::size_t, CUstream stream) {
  ++(stream == kOwnStream ? state().slab_memsets : state().memsets);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_error_name(CUresult, const char** s) {
  *s = "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}

}  // namespace

// Every entry point the fake does not model answers CUDA_ERROR_NOT_SUPPORTED: no call through
// the table is ever a null function pointer.
template <typename Fn>
struct NotSupported;
template <typename... Args>
struct NotSupported<CUresult(CUDAAPI*)(Args...)> {
  static CUresult CUDAAPI call(Args...) { return CUDA_ERROR_NOT_SUPPORTED; }
};

driver::Api fake_api() {
  driver::Api api;
  api.cuCtxGetCurrent = fake_ctx_get_current;
  api.cuCtxGetDevice = fake_ctx_get_device;
  api.cuDeviceGetCount = fake_device_get_count;
  api.cuDeviceGet = fake_device_get;
  api.cuDeviceGetAttribute = fake_device_get_attribute;
  api.cuStreamIsCapturing = fake_stream_is_capturing;
  api.cuLibraryLoadData = fake_library_load_data;
  api.cuLibraryUnload = fake_library_unload;
  api.cuLibraryGetKernel = fake_library_get_kernel;
  api.cuKernelGetAttribute = fake_kernel_get_attribute;
  api.cuKernelSetAttribute = fake_kernel_set_attribute;
  api.cuLaunchKernelEx = fake_launch;
  api.cuCtxGetId = fake_ctx_get_id;
  api.cuStreamGetId = fake_stream_get_id;
  api.cuStreamCreate = fake_stream_create;
  api.cuStreamDestroy = fake_stream_destroy;
  api.cuStreamSynchronize = fake_stream_synchronize;
  api.cuMemAllocAsync = fake_mem_alloc_async;
  api.cuMemFreeAsync = fake_mem_free_async;
  api.cuMemFree = fake_mem_free;
  api.cuMemsetD32Async = fake_memset;
  api.cuGetErrorName = fake_error_name;
  api.cuGetErrorString = fake_error_name;
#define CSA_FAKE_UNMODELLED(name, ver) \
  if (api.name == nullptr) api.name = &NotSupported<PFN_##name##_v##ver>::call;
  CSA_DRIVER_FUNCTIONS(CSA_FAKE_UNMODELLED)
#undef CSA_FAKE_UNMODELLED
  return api;
}

ForwardArgs forward_args(const Config& c) {
  ForwardArgs a;
  a.kv = fake_ptr<void>(0x100000);
  a.score = fake_ptr<void>(0x200000);
  a.ape = fake_ptr<float>(0x300000);
  a.cu_seqlens = fake_ptr<std::int32_t>(0x400000);
  a.cu_seqlens_comp = fake_ptr<std::int32_t>(0x500000);
  a.out = fake_ptr<void>(0x600000);
  a.total_tokens = 8192;
  a.num_segments = 1;
  a.total_comp = 8192 / c.ratio;
  a.config = c;
  return a;
}

BackwardArgs backward_args(const Config& c, std::uint32_t flags) {
  const ForwardArgs f = forward_args(c);
  BackwardArgs a;
  a.kv = f.kv;
  a.score = f.score;
  a.ape = f.ape;
  a.cu_seqlens = f.cu_seqlens;
  a.cu_seqlens_comp = f.cu_seqlens_comp;
  a.grad_out = fake_ptr<void>(0x700000);
  a.grad_kv = fake_ptr<void>(0x800000);
  a.grad_score = fake_ptr<void>(0x900000);
  a.grad_ape = fake_ptr<float>(0xa00000);
  a.total_tokens = f.total_tokens;
  a.num_segments = 1;
  a.total_comp = f.total_comp;
  a.config = c;
  a.flags = flags;
  if (c.tail.any()) {  // the tail's tensors, each its own range
    a.tail.norm_weight = fake_ptr<float>(0xb00000);
    a.tail.rope_cos = fake_ptr<float>(0xb10000);
    a.tail.rope_sin = fake_ptr<float>(0xb20000);
    a.tail.rope_max_blocks = a.total_comp;
    a.grad_norm_weight = fake_ptr<float>(0xb30000);
    if (keeps_pooled_rows(c)) a.pooled = fake_ptr<float>(0xc00000);
  }
  return a;
}

}  // namespace csa::test
