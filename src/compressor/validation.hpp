// Host-side checks of every call (SPEC §3 and §6), before anything is launched. Each failure
// throws Error(kInvalidArgument or kUnsupported) naming the argument.
#pragma once

#include "csa/csa.hpp"

namespace csa::compressor {

inline constexpr int kMaxRatio = 256;
inline constexpr int kMaxHeadDim = 4096;
inline constexpr int kMaxSegments = 1 << 30;

void validate_config(const Config& config);
// The tail's own rules (norm weight type, eps, rope_dim and its tables, the Hadamard size).
void validate_tail(const Config& config, const Tail& tail);
void validate_sizes(const Config& config, std::int64_t total_tokens, std::int32_t num_segments,
                    std::int64_t total_comp);
// Also checks that `family` (kAuto resolved) serves the configuration; returns the family.
// Rejects an explicit family that cannot serve `config` (kAuto is routed per arch later).
void check_family(const Config& config, Family family);
void validate_forward(const ForwardArgs& args);
void validate_backward(const BackwardArgs& args);

int element_bytes(DType dtype);
// Elements a row stride must be a multiple of: dense rows' alignment for the widest vector
// access of the configuration (16 bytes, or less where head_dim is not a multiple of it).
std::int64_t row_alignment(const Config& config);
bool dense(std::int64_t stride, std::int64_t width);
// The kernels' layout policy of a validated call (csa_kernel::LayoutKind): SBHD, or THD packed
// when every stride is dense, else THD strided.
int kernel_layout(const ForwardArgs& args);
int kernel_layout(const BackwardArgs& args);

}  // namespace csa::compressor
