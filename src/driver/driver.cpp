#include "driver/driver.hpp"

#include <dlfcn.h>

#include "common/env.hpp"
#include "common/error.hpp"

namespace csa::driver {

namespace {

// NOTE: all resolved entries use the legacy default-stream semantics (CU_GET_PROC_ADDRESS_DEFAULT
// without per-thread default stream), matching the non-_ptsz names of the ABI versions above.
constexpr cuuint64_t kProcFlags = CU_GET_PROC_ADDRESS_DEFAULT;

}  // namespace

std::unique_ptr<Driver> Driver::load() {
  const std::string path = env::get("CSA_LIBCUDA_PATH").value_or("libcuda.so.1");
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    fail(Status::kDriverUnavailable, "cannot load the CUDA driver '{}': {}", path,
         why != nullptr ? why : "unknown dlopen error");
  }
  auto get_proc =
      reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(handle, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    dlclose(handle);
    fail(Status::kDriverUnavailable,
         "the CUDA driver '{}' has no cuGetProcAddress_v2 (a CUDA 12.0 or newer driver is needed)",
         path);
  }
  Api api;
  std::string missing;
#define CSA_RESOLVE_ENTRY(name, ver)                                                       \
  {                                                                                        \
    void* fn = nullptr;                                                                    \
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;                   \
    if (get_proc(#name, &fn, ver, kProcFlags, &status) != CUDA_SUCCESS || fn == nullptr) { \
      missing += missing.empty() ? #name : ", " #name;                                     \
    }                                                                                      \
    api.name = reinterpret_cast<PFN_##name##_v##ver>(fn);                                  \
  }
  CSA_DRIVER_FUNCTIONS(CSA_RESOLVE_ENTRY)
#undef CSA_RESOLVE_ENTRY
  if (!missing.empty()) {
    dlclose(handle);
    fail(Status::kDriverUnavailable, "the CUDA driver '{}' lacks entry points: {}", path, missing);
  }
  auto driver = std::make_unique<Driver>(api, handle);
  const CUresult init = api.cuInit(0);
  if (init != CUDA_SUCCESS) {
    fail(Status::kDriverUnavailable, "cuInit failed: {}", driver->error_text(init));
  }
  driver->check(api.cuDriverGetVersion(&driver->version_), "cuDriverGetVersion");
  return driver;
}

Driver::~Driver() {
  // NOTE: never dlclose libcuda: other libraries in the process (the CUDA runtime, frameworks)
  // share the one loaded copy, and unloading it under them crashes at exit.
  (void)handle_;
}

std::string Driver::error_text(CUresult result) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api_.cuGetErrorName != nullptr) api_.cuGetErrorName(result, &name);
  if (api_.cuGetErrorString != nullptr) api_.cuGetErrorString(result, &text);
  return fmt::format("{} ({}): {}", name != nullptr ? name : "CUDA_ERROR", static_cast<int>(result),
                     text != nullptr ? text : "no description");
}

void Driver::check(CUresult result, const char* what) const {
  if (result == CUDA_SUCCESS) return;
  fail(Status::kDriverError, "{} failed: {}", what, error_text(result));
}

}  // namespace csa::driver
