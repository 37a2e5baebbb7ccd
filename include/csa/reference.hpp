// CPU references of the Compressor (no GPU needed): the fp32-intermediate reference in the
// SPEC §2 op order, and an fp64 oracle, for every element type (config.dtype: bf16 and fp16
// tensors as their raw 16-bit patterns, fp32 as floats) and layout (config.layout: THD with
// offsets, or SBHD with num_segments = B, total_tokens = S * B and null offsets), dense rows.
#pragma once

#include <cstdint>

#include "csa/csa.hpp"

namespace csa::reference {

struct HostProblem {
  const void* kv = nullptr;     // config.dtype elements
  const void* score = nullptr;  // config.dtype elements
  const float* ape = nullptr;
  const std::int32_t* cu_seqlens = nullptr;
  const std::int32_t* cu_seqlens_comp = nullptr;
  std::int64_t total_tokens = 0;
  std::int32_t num_segments = 0;
  std::int64_t total_comp = 0;
  Config config;
  std::int64_t seq_len = 0;  // SBHD: S
};

CSA_API float bf16_to_float(std::uint16_t bits) noexcept;
CSA_API std::uint16_t float_to_bf16(float value) noexcept;  // round to nearest even
CSA_API float fp16_to_float(std::uint16_t bits) noexcept;
CSA_API std::uint16_t float_to_fp16(float value) noexcept;  // round to nearest even

// out: total_comp * head_dim elements of config.dtype.
CSA_API void forward_fp32(const HostProblem& problem, void* out);
CSA_API void forward_fp64(const HostProblem& problem, double* out);

// grad_out: total_comp * head_dim, grad_kv, grad_score: total_tokens * W (fully written), all
// of config.dtype; grad_ape: ratio * W, overwritten unless `accumulate`. Gradients on padding
// rows are ignored.
CSA_API void backward_fp32(const HostProblem& problem, const void* grad_out, void* grad_kv,
                           void* grad_score, float* grad_ape, bool accumulate = false);
CSA_API void backward_fp64(const HostProblem& problem, const void* grad_out, double* grad_kv,
                           double* grad_score, double* grad_ape);

// The pooling and its tail (host pointers in `tail`). Forward: y, total_comp * head_dim of
// config.dtype, each stage in fp32 (or fp64) in the order the user guide gives, y rounded
// once; rstd (fp32 only, optional, needs the norm): total_comp values, each row's
// (mean(x²) + eps)^-1/2. Throws Error(kInvalidArgument) naming the field on a bad tail, or a
// row whose block has no RoPE table row.
CSA_API void tail_forward_fp32(const HostProblem& problem, const Tail& tail, void* y,
                               float* rstd = nullptr);
CSA_API void tail_forward_fp64(const HostProblem& problem, const Tail& tail, double* y);
// The pooling's rows in fp32 before any rounding (total_comp * head_dim floats), and the tail
// alone over given fp32 pooled rows (y and rstd as tail_forward_fp32): with the long-window
// family's pooled rows (ForwardArgs::pooled) they compare the tail's stages apart from the
// pooling's exp, whose CPU and GPU forms differ in the last place.
CSA_API void pooled_fp32(const HostProblem& problem, float* pooled);
CSA_API void tail_rows_fp32(const HostProblem& problem, const Tail& tail, const float* pooled,
                            void* y, float* rstd = nullptr);

// Backward from grad_y (total_comp * head_dim of config.dtype) through the tail and the pooling:
// grad_kv, grad_score, grad_ape as backward_fp32, and grad_w (head_dim, fp32; needed with the
// norm, else null) summed over the valid rows, overwritten unless `accumulate`.
CSA_API void tail_backward_fp32(const HostProblem& problem, const Tail& tail, const void* grad_y,
                                void* grad_kv, void* grad_score, float* grad_ape, float* grad_w,
                                bool accumulate = false);
CSA_API void tail_backward_fp64(const HostProblem& problem, const Tail& tail, const void* grad_y,
                                double* grad_kv, double* grad_score, double* grad_ape,
                                double* grad_w);

}  // namespace csa::reference
