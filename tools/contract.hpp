// The numerics contract of a typed output tensor against the reference kernel's (docs/
// user-guide.md, "Numerics contract"): bitwise where the op order is the reference's; else bf16
// differs on at most max(1, 0.1 %) of the elements, by at most 1.6e-2; fp16, which rounds 8
// times finer, so that the same fp32 reordering flips about 8 times as many roundings, on at
// most max(1, 1 %); fp32 on every element by at most 2^-16 relative. Shared by the GPU tests
// and `csa tune`, which checks candidates with a margin inside it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csa/csa.hpp"

namespace csa::tools {

struct Diff {
  std::size_t differing = 0;     // elements whose values differ (NaN counts as differing)
  double max_abs = 0.0;          // max |a - b| (fp32: relative to max(1, |b|)) over finite pairs
  std::size_t nan_mismatch = 0;  // elements NaN in one tensor only
};

// a and b: the bytes of two `dtype` tensors of the same size.
Diff diff(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b, DType dtype);

// "" when `got` meets the contract against `ref`, else what breaks it, prefixed by `name`.
// `margin` (0 < margin <= 1) scales the tolerance contract's count of differing elements.
std::string contract_failure(const std::vector<std::uint8_t>& got,
                             const std::vector<std::uint8_t>& ref, DType dtype, bool bitwise,
                             const std::string& name, double margin = 1.0);

}  // namespace csa::tools
