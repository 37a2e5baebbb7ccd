// Host-side checks of every call (SPEC §3 and §6), before anything is launched. Each failure
// throws Error(kInvalidArgument or kUnsupported) naming the argument.
#pragma once

#include "csa/csa.hpp"

namespace csa::compressor {

inline constexpr int kMaxRatio = 256;
inline constexpr int kMaxHeadDim = 4096;
inline constexpr int kMaxSegments = 1 << 30;

void validate_config(const Config& config);
void validate_sizes(const Config& config, std::int64_t total_tokens, std::int32_t num_segments,
                    std::int64_t total_comp);
// Also checks that `family` (kAuto resolved) serves the configuration; returns the family.
// Rejects an explicit family that cannot serve `config` (kAuto is routed per arch later).
void check_family(const Config& config, Family family);
void validate_forward(const ForwardArgs& args);
void validate_backward(const BackwardArgs& args);

}  // namespace csa::compressor
