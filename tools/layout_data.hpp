// Host-side tensors in every element type and layout: bf16 values re-encoded as fp16 / fp32,
// THD rows rearranged into SBHD (and back), and rows spread `stride` elements apart (and
// gathered back). Shared by `csa bench` and the tests.
#pragma once

#include <cstdint>
#include <vector>

#include "csa/csa.hpp"

namespace csa::tools {

int element_size(DType dtype);

// bf16 values (raw 16-bit patterns) as `dtype` elements: fp16 rounds them, fp32 is exact.
std::vector<std::uint8_t> encode(const std::vector<std::uint16_t>& bf16, DType dtype);

// Element i of a `dtype` tensor's bytes.
double element_value(const std::vector<std::uint8_t>& bytes, DType dtype, std::size_t i);

// Rows of `width` elements (`bytes` each) of B equal segments of `per_segment` rows, segment b's
// row t at b * per_segment + t (THD), moved to t * B + b (SBHD), and back.
std::vector<std::uint8_t> to_sbhd(const std::vector<std::uint8_t>& thd, std::int64_t per_segment,
                                  std::int64_t batch, std::int64_t width, int bytes);
std::vector<std::uint8_t> from_sbhd(const std::vector<std::uint8_t>& sbhd, std::int64_t per_segment,
                                    std::int64_t batch, std::int64_t width, int bytes);

// `rows` dense rows of `width` elements placed `stride` elements apart; the gaps hold 0xff.
std::vector<std::uint8_t> spread(const std::vector<std::uint8_t>& dense, std::int64_t rows,
                                 std::int64_t width, std::int64_t stride, int bytes);
// The rows back, densely; `gaps_untouched` (if not null): every gap byte still 0xff.
std::vector<std::uint8_t> gather(const std::vector<std::uint8_t>& strided, std::int64_t rows,
                                 std::int64_t width, std::int64_t stride, int bytes,
                                 bool* gaps_untouched = nullptr);

}  // namespace csa::tools
