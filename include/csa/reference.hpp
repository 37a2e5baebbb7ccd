// CPU references of the Compressor (no GPU needed): the fp32-intermediate reference in the
// SPEC §2 op order, and an fp64 oracle. bf16 tensors are passed as their raw 16-bit patterns.
#pragma once

#include <cstdint>

#include "csa/csa.hpp"

namespace csa::reference {

struct HostProblem {
  const std::uint16_t* kv = nullptr;
  const std::uint16_t* score = nullptr;
  const float* ape = nullptr;
  const std::int32_t* cu_seqlens = nullptr;
  const std::int32_t* cu_seqlens_comp = nullptr;
  std::int64_t total_tokens = 0;
  std::int32_t num_segments = 0;
  std::int64_t total_comp = 0;
  Config config;
};

CSA_API float bf16_to_float(std::uint16_t bits) noexcept;
CSA_API std::uint16_t float_to_bf16(float value) noexcept;  // round to nearest even

// out: total_comp * head_dim.
CSA_API void forward_fp32(const HostProblem& problem, std::uint16_t* out);
CSA_API void forward_fp64(const HostProblem& problem, double* out);

// grad_kv, grad_score: total_tokens * W (fully written); grad_ape: ratio * W, overwritten
// unless `accumulate`. Gradients on padding rows are ignored.
CSA_API void backward_fp32(const HostProblem& problem, const std::uint16_t* grad_out,
                           std::uint16_t* grad_kv, std::uint16_t* grad_score, float* grad_ape,
                           bool accumulate = false);
CSA_API void backward_fp64(const HostProblem& problem, const std::uint16_t* grad_out,
                           double* grad_kv, double* grad_score, double* grad_ape);

}  // namespace csa::reference
