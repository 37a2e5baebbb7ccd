// libFuzzer: every argument of forward and backward, through the C ABI and through a Runtime
// on the fake driver (so that accepted calls go on to the launch path: records, grids,
// scratch, capture rules). A call either launches or fails with csa::Error naming the
// argument; another exception, kInternal, a crash or undefined behaviour is a finding.
#include <fuzzer/FuzzedDataProvider.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "compressor/validation.hpp"
#include "csa/csa.h"
#include "fake_driver.hpp"

namespace {

using csa::test::state;

// Valid configurations are mapped onto these few, so that the fuzzer spends its time on the
// arguments rather than on NVRTC (each configuration is compiled once).
constexpr std::array<csa::Config, 3> kPrepared = {csa::Config{4, 64, 2}, csa::Config{128, 64, 1},
                                                  csa::Config{2, 5, 1}};

csa::test::FakeRuntime& runtime() {
  static auto* rt = new csa::test::FakeRuntime();  // NOTE: leaked: lives until exit
  return *rt;
}

template <typename T>
T* pointer(FuzzedDataProvider& in, std::uintptr_t base) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return nullptr;
    case 1:
      return reinterpret_cast<T*>(base + in.ConsumeIntegralInRange<std::uintptr_t>(1, 15));
    default:
      return reinterpret_cast<T*>(base);
  }
}

std::int64_t size(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0:
      return in.ConsumeIntegral<std::int64_t>();
    case 1:
      return in.ConsumeIntegralInRange<std::int64_t>(-2, 1 << 20);
    default:
      return in.ConsumeIntegralInRange<std::int64_t>(0, 4096);
  }
}

void expect_clean(const csa::Error& e) {
  if (e.code() == csa::Status::kInternal) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size_in) {
  FuzzedDataProvider in(data, size_in);
  csa::Config c{in.ConsumeIntegral<std::int32_t>(), in.ConsumeIntegral<std::int32_t>(),
                in.ConsumeIntegral<std::int32_t>()};
  if (in.ConsumeBool()) c = kPrepared[in.ConsumeIntegralInRange<std::size_t>(0, 2)];
  // Element type and layout: any value (most invalid); valid ones keep their layout, and map
  // onto bf16 so that each prepared configuration compiles once per layout.
  const auto dtype = static_cast<csa::DType>(in.ConsumeIntegralInRange<std::int32_t>(-1, 3));
  const auto layout = static_cast<csa::Layout>(in.ConsumeIntegralInRange<std::int32_t>(-1, 2));
  c.dtype = dtype;
  c.layout = layout;
  try {
    csa::compressor::validate_config(c);
    c = kPrepared[static_cast<std::size_t>(c.ratio + c.head_dim + c.coff) % kPrepared.size()];
    c.layout = layout;
  } catch (const csa::Error&) {  // NOLINT(bugprone-empty-catch): kept invalid on purpose
  }
  csa::BackwardArgs b;
  b.kv = pointer<const void>(in, 0x100000);
  b.score = pointer<const void>(in, 0x200000);
  b.ape = pointer<const float>(in, 0x300000);
  b.cu_seqlens = pointer<const std::int32_t>(in, 0x400000);
  b.cu_seqlens_comp = pointer<const std::int32_t>(in, 0x500000);
  b.grad_out = pointer<const void>(in, 0x600000);
  b.grad_kv = pointer<void>(in, 0x700000);
  b.grad_score = pointer<void>(in, 0x800000);
  b.grad_ape = pointer<float>(in, 0x900000);
  b.total_tokens = size(in);
  b.num_segments = in.ConsumeBool() ? in.ConsumeIntegral<std::int32_t>()
                                    : in.ConsumeIntegralInRange<std::int32_t>(0, 64);
  b.total_comp = size(in);
  b.config = c;
  b.flags = in.ConsumeBool() ? in.ConsumeIntegral<std::uint32_t>()
                             : in.ConsumeIntegralInRange<std::uint32_t>(0, 3);
  b.seq_len = size(in);
  b.kv_stride = size(in);
  b.score_stride = in.ConsumeBool() ? b.kv_stride : size(in);
  b.grad_out_stride = size(in);
  b.grad_kv_stride = size(in);
  b.grad_score_stride = in.ConsumeBool() ? b.grad_kv_stride : size(in);
  csa::ForwardArgs f;
  f.kv = b.kv;
  f.score = b.score;
  f.ape = b.ape;
  f.cu_seqlens = b.cu_seqlens;
  f.cu_seqlens_comp = b.cu_seqlens_comp;
  f.out = pointer<void>(in, 0xa00000);
  f.total_tokens = b.total_tokens;
  f.num_segments = b.num_segments;
  f.total_comp = b.total_comp;
  f.config = c;
  f.seq_len = b.seq_len;
  f.kv_stride = b.kv_stride;
  f.score_stride = b.score_stride;
  f.out_stride = b.grad_out_stride;
  const auto family = in.ConsumeBool() ? csa::Family::kAuto : csa::Family::kReference;
  state().capturing = in.ConsumeBool();
  state().current_device = in.ConsumeIntegralInRange<int>(0, 1);
  auto* stream = reinterpret_cast<CUstream>(in.ConsumeIntegralInRange<std::uintptr_t>(0, 0x6000));
  const int call = in.ConsumeIntegralInRange<int>(0, 4);
  try {
    auto& service = runtime().service;
    switch (call) {
      case 0:
        service.forward(f, stream, family);
        break;
      case 1:
        service.backward(b, stream, family);
        break;
      case 2: {
        state().capturing = false;  // a plan is prepared outside capture
        const auto record =
            service.record(c, csa::compressor::kernel_layout(f), family, state().current_device);
        service.forward_with(*record, f, stream);
        if (csa::compressor::kernel_layout(b) == record->kernel_layout)
          service.backward_with(*record, b, stream);
        break;
      }
      case 3: {
        // The C ABI over the default runtime (no driver in CI: what precedes the driver runs).
        // Every failure comes with a message, and none is internal.
        const auto clean = [](int rc) {
          if (rc == CSA_ERROR_INTERNAL || (rc != CSA_OK && *csa_last_error() == '\0')) std::abort();
        };
        clean(csa_compressor_forward(f.kv, f.score, f.ape, f.cu_seqlens, f.cu_seqlens_comp, f.out,
                                     f.total_tokens, f.num_segments, f.total_comp, c.ratio,
                                     c.head_dim, c.coff, stream));
        clean(csa_compressor_backward(b.kv, b.score, b.ape, b.cu_seqlens, b.cu_seqlens_comp,
                                      b.grad_out, b.grad_kv, b.grad_score, b.grad_ape,
                                      b.total_tokens, b.num_segments, b.total_comp, c.ratio,
                                      c.head_dim, c.coff, b.flags, stream));
        // The versioned struct, with a size the fuzzer may get wrong.
        csa_compressor_args a{};
        a.struct_size = in.ConsumeBool() ? sizeof a : in.ConsumeIntegral<std::uint64_t>();
        a.ratio = c.ratio;
        a.head_dim = c.head_dim;
        a.coff = c.coff;
        a.dtype = static_cast<std::int32_t>(dtype);
        a.layout = static_cast<std::int32_t>(layout);
        a.flags = b.flags;
        a.total_tokens = b.total_tokens;
        a.total_comp = b.total_comp;
        a.seq_len = b.seq_len;
        a.num_segments = b.num_segments;
        a.kv_stride = b.kv_stride;
        a.score_stride = b.score_stride;
        a.grad_out_stride = b.grad_out_stride;
        a.grad_kv_stride = b.grad_kv_stride;
        a.grad_score_stride = b.grad_score_stride;
        a.kv = b.kv;
        a.score = b.score;
        a.ape = b.ape;
        a.cu_seqlens = b.cu_seqlens;
        a.cu_seqlens_comp = b.cu_seqlens_comp;
        a.out = f.out;
        a.grad_out = b.grad_out;
        a.grad_kv = b.grad_kv;
        a.grad_score = b.grad_score;
        a.grad_ape = b.grad_ape;
        clean(csa_compressor_backward_ex(&a, stream));
        a.flags = 0;
        clean(csa_compressor_forward_ex(&a, stream));
        break;
      }
      default:
        csa::validate_shape(c, f.total_tokens, f.num_segments, f.total_comp);
        break;
    }
  } catch (const csa::Error& e) {
    expect_clean(e);
  }
  state().capturing = false;
  return 0;
}
