// The C ABI over the public C++ API: exceptions become status codes and a thread-local message.
#include <cstddef>
#include <cstring>
#include <exception>
#include <string>

#include "csa/csa.h"
#include "csa/csa.hpp"
#include "api/runtime_impl.hpp"
#include "common/error.hpp"

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

static_assert(sizeof(csa_compressor_args) == CSA_COMPRESSOR_ARGS_SIZE_V3,
              "csa_compressor_args: a field was added without a new version size");
static_assert(offsetof(csa_compressor_args, tail_flags) == CSA_COMPRESSOR_ARGS_SIZE_V1,
              "csa_compressor_args: version 2 must begin where version 1 ends");
static_assert(offsetof(csa_compressor_args, pooled) == CSA_COMPRESSOR_ARGS_SIZE_V2,
              "csa_compressor_args: version 3 must begin where version 2 ends");

constexpr std::uint32_t kKnownTailFlags =
    CSA_TAIL_NORM | CSA_TAIL_NORM_WEIGHT_BF16 | CSA_TAIL_ROPE_HALF_SPLIT | CSA_TAIL_HADAMARD;

// The arguments struct of the _ex calls, checked before anything else is read, as the latest
// version: a version-1 caller's struct with the later fields zero (no tail).
csa_compressor_args checked_args(const csa_compressor_args* args) {
  if (args == nullptr) csa::fail(csa::Status::kInvalidArgument, "args is null");
  const std::uint64_t size = args->struct_size;
  if (size != CSA_COMPRESSOR_ARGS_SIZE_V1 && size != CSA_COMPRESSOR_ARGS_SIZE_V2 &&
      size != CSA_COMPRESSOR_ARGS_SIZE_V3) {
    csa::fail(csa::Status::kInvalidArgument,
              "args->struct_size is {}: this library (csa {}) knows struct_size {} (version 1), "
              "{} (version 2) and {} (version 3, sizeof(csa_compressor_args) of its csa.h); "
              "rebuild against the csa.h of the library you load",
              size, csa::version(), CSA_COMPRESSOR_ARGS_SIZE_V1, CSA_COMPRESSOR_ARGS_SIZE_V2,
              CSA_COMPRESSOR_ARGS_SIZE_V3);
  }
  csa_compressor_args a{};
  std::memcpy(&a, args, static_cast<std::size_t>(size));
  if (a.reserved != 0)
    csa::fail(csa::Status::kInvalidArgument, "args->reserved is {} (must be 0)", a.reserved);
  if (a.reserved2 != 0)
    csa::fail(csa::Status::kInvalidArgument, "args->reserved2 is {} (must be 0)", a.reserved2);
  if ((a.tail_flags & ~kKnownTailFlags) != 0) {
    csa::fail(csa::Status::kInvalidArgument,
              "args->tail_flags {:#x} has unknown bits (known: CSA_TAIL_NORM=1, "
              "CSA_TAIL_NORM_WEIGHT_BF16=2, CSA_TAIL_ROPE_HALF_SPLIT=4, CSA_TAIL_HADAMARD=8)",
              a.tail_flags);
  }
  return a;
}

csa::Config config_of(const csa_compressor_args& a) {
  csa::Config c{a.ratio, a.head_dim, a.coff, static_cast<csa::DType>(a.dtype),
                static_cast<csa::Layout>(a.layout)};
  c.tail.norm = (a.tail_flags & CSA_TAIL_NORM) != 0;
  c.tail.norm_weight_dtype =
      (a.tail_flags & CSA_TAIL_NORM_WEIGHT_BF16) != 0 ? csa::DType::kBf16 : csa::DType::kF32;
  c.tail.rope_dim = a.rope_dim;
  c.tail.rope_interleaved = (a.tail_flags & CSA_TAIL_ROPE_HALF_SPLIT) == 0;
  c.tail.hadamard = (a.tail_flags & CSA_TAIL_HADAMARD) != 0;
  return c;
}

csa::Tail tail_of(const csa_compressor_args& a) {
  csa::Tail t;
  t.norm_weight = a.norm_weight;
  t.eps = a.eps;
  t.rope_cos = a.rope_cos;
  t.rope_sin = a.rope_sin;
  t.rope_max_blocks = a.rope_max_blocks;
  return t;
}

template <typename Args>
void copy_inputs(Args& out, const csa_compressor_args& a) {
  out.kv = a.kv;
  out.score = a.score;
  out.ape = a.ape;
  out.cu_seqlens = a.cu_seqlens;
  out.cu_seqlens_comp = a.cu_seqlens_comp;
  out.total_tokens = a.total_tokens;
  out.num_segments = a.num_segments;
  out.total_comp = a.total_comp;
  out.config = config_of(a);
  out.seq_len = a.seq_len;
  out.kv_stride = a.kv_stride;
  out.score_stride = a.score_stride;
}

}  // namespace

extern "C" {

int csa_compressor_forward_ex(const csa_compressor_args* args, void* stream) {
  return guarded([&] {
    const csa_compressor_args a = checked_args(args);
    if (a.flags != 0) {
      csa::fail(csa::Status::kInvalidArgument, "args->flags is {:#x}: the forward takes none",
                a.flags);
    }
    csa::ForwardArgs f;
    copy_inputs(f, a);
    f.out = a.out;
    f.out_stride = a.out_stride;
    f.tail = tail_of(a);
    f.rstd = a.rstd;
    f.pooled = a.pooled;
    if (a.grad_norm_weight != nullptr) {
      csa::fail(csa::Status::kInvalidArgument,
                "args->grad_norm_weight is set: the forward writes out and rstd only");
    }
    csa::forward(f, static_cast<csa::Stream>(stream));
  });
}

int csa_compressor_backward_ex(const csa_compressor_args* args, void* stream) {
  return guarded([&] {
    const csa_compressor_args a = checked_args(args);
    csa::BackwardArgs b;
    copy_inputs(b, a);
    b.flags = a.flags;
    b.grad_out = a.grad_out;
    b.grad_kv = a.grad_kv;
    b.grad_score = a.grad_score;
    b.grad_ape = a.grad_ape;
    b.grad_out_stride = a.grad_out_stride;
    b.grad_kv_stride = a.grad_kv_stride;
    b.grad_score_stride = a.grad_score_stride;
    if (a.rstd != nullptr)
      csa::fail(csa::Status::kInvalidArgument, "args->rstd is set: it is a forward output");
    b.tail = tail_of(a);
    b.grad_norm_weight = a.grad_norm_weight;
    b.pooled = a.pooled;
    csa::backward(b, static_cast<csa::Stream>(stream));
  });
}

int csa_prewarm_ex(const csa_compressor_args* args, int device) {
  return guarded([&] {
    const csa_compressor_args a = checked_args(args);
    csa::Config c = config_of(a);
    c.strided = a.kv_stride != 0 || a.score_stride != 0 || a.out_stride != 0 ||
                a.grad_out_stride != 0 || a.grad_kv_stride != 0 || a.grad_score_stride != 0;
    csa::Runtime::default_runtime().prewarm(c, device);
  });
}

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
