// The C ABI over the public C++ API: exceptions become status codes and a thread-local message.
#include <exception>
#include <string>

#include "csa/csa.h"
#include "csa/csa.hpp"
#include "api/runtime_impl.hpp"

namespace {

thread_local std::string last_error;
thread_local std::string info_text;

template <typename Fn>
int guarded(Fn&& fn) {
  try {
    fn();
    last_error.clear();
    return CSA_OK;
  } catch (const csa::Error& e) {
    last_error = e.what();
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    last_error = std::string("csa: internal error: ") + e.what();
    return CSA_ERROR_INTERNAL;
  } catch (...) {
    last_error = "csa: internal error: unknown exception";
    return CSA_ERROR_INTERNAL;
  }
}

}  // namespace

extern "C" {

int csa_compressor_forward(const void* kv, const void* score, const float* ape,
                           const int32_t* cu_seqlens, const int32_t* cu_seqlens_comp, void* out,
                           int64_t total_tokens, int32_t num_segments, int64_t total_comp,
                           int32_t ratio, int32_t head_dim, int32_t coff, void* stream) {
  return guarded([&] {
    csa::ForwardArgs a;
    a.kv = kv;
    a.score = score;
    a.ape = ape;
    a.cu_seqlens = cu_seqlens;
    a.cu_seqlens_comp = cu_seqlens_comp;
    a.out = out;
    a.total_tokens = total_tokens;
    a.num_segments = num_segments;
    a.total_comp = total_comp;
    a.config = {ratio, head_dim, coff};
    csa::forward(a, static_cast<csa::Stream>(stream));
  });
}

int csa_compressor_backward(const void* kv, const void* score, const float* ape,
                            const int32_t* cu_seqlens, const int32_t* cu_seqlens_comp,
                            const void* grad_out, void* grad_kv, void* grad_score, float* grad_ape,
                            int64_t total_tokens, int32_t num_segments, int64_t total_comp,
                            int32_t ratio, int32_t head_dim, int32_t coff, uint32_t flags,
                            void* stream) {
  return guarded([&] {
    csa::BackwardArgs a;
    a.kv = kv;
    a.score = score;
    a.ape = ape;
    a.cu_seqlens = cu_seqlens;
    a.cu_seqlens_comp = cu_seqlens_comp;
    a.grad_out = grad_out;
    a.grad_kv = grad_kv;
    a.grad_score = grad_score;
    a.grad_ape = grad_ape;
    a.total_tokens = total_tokens;
    a.num_segments = num_segments;
    a.total_comp = total_comp;
    a.config = {ratio, head_dim, coff};
    a.flags = flags;
    csa::backward(a, static_cast<csa::Stream>(stream));
  });
}

int csa_prewarm(int32_t ratio, int32_t head_dim, int32_t coff, int device) {
  return guarded([&] { csa::Runtime::default_runtime().prewarm({ratio, head_dim, coff}, device); });
}

const char* csa_last_error(void) {
  return last_error.c_str();
}

const char* csa_version(void) {
  return csa::version();
}

int csa_set_device(int32_t device) {
  return guarded([&] {
    csa::RuntimeAccess::of(csa::Runtime::default_runtime()).service.make_current(device);
  });
}

const char* csa_info_json(void) {
  const int rc = guarded([&] { info_text = csa::Runtime::default_runtime().info_json(); });
  return rc == CSA_OK ? info_text.c_str() : nullptr;
}

}  // extern "C"
