#include "layout_data.hpp"

#include <algorithm>
#include <cstring>

#include "csa/reference.hpp"

namespace csa::tools {

int element_size(DType dtype) {
  return dtype == DType::kF32 ? 4 : 2;
}

std::vector<std::uint8_t> encode(const std::vector<std::uint16_t>& bf16, DType dtype) {
  const auto size = static_cast<std::size_t>(element_size(dtype));
  std::vector<std::uint8_t> out(bf16.size() * size);
  for (std::size_t i = 0; i < bf16.size(); ++i) {
    const float v = reference::bf16_to_float(bf16[i]);
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v, 4);
    } else {
      const std::uint16_t h = dtype == DType::kF16 ? reference::float_to_fp16(v) : bf16[i];
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

double element_value(const std::vector<std::uint8_t>& bytes, DType dtype, std::size_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == DType::kF16 ? reference::fp16_to_float(h) : reference::bf16_to_float(h);
}

namespace {

std::vector<std::uint8_t> permute_rows(const std::vector<std::uint8_t>& in,
                                       std::int64_t per_segment, std::int64_t batch,
                                       std::int64_t width, int bytes, bool to_sbhd) {
  std::vector<std::uint8_t> out(in.size());
  const std::int64_t row_bytes = width * bytes;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t t = 0; t < per_segment; ++t) {
      const std::int64_t thd = b * per_segment + t;
      const std::int64_t sbhd = t * batch + b;
      std::memcpy(out.data() + (to_sbhd ? sbhd : thd) * row_bytes,
                  in.data() + (to_sbhd ? thd : sbhd) * row_bytes,
                  static_cast<std::size_t>(row_bytes));
    }
  }
  return out;
}

}  // namespace

std::vector<std::uint8_t> to_sbhd(const std::vector<std::uint8_t>& thd, std::int64_t per_segment,
                                  std::int64_t batch, std::int64_t width, int bytes) {
  return permute_rows(thd, per_segment, batch, width, bytes, true);
}

std::vector<std::uint8_t> from_sbhd(const std::vector<std::uint8_t>& sbhd, std::int64_t per_segment,
                                    std::int64_t batch, std::int64_t width, int bytes) {
  return permute_rows(sbhd, per_segment, batch, width, bytes, false);
}

std::vector<std::uint8_t> spread(const std::vector<std::uint8_t>& dense, std::int64_t rows,
                                 std::int64_t width, std::int64_t stride, int bytes) {
  std::vector<std::uint8_t> out(
      static_cast<std::size_t>(std::max<std::int64_t>(rows, 1) * stride * bytes), 0xff);
  for (std::int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * stride * bytes, dense.data() + r * width * bytes,
                static_cast<std::size_t>(width * bytes));
  return out;
}

std::vector<std::uint8_t> gather(const std::vector<std::uint8_t>& strided, std::int64_t rows,
                                 std::int64_t width, std::int64_t stride, int bytes,
                                 bool* gaps_untouched) {
  std::vector<std::uint8_t> out(static_cast<std::size_t>(rows * width * bytes));
  bool untouched = true;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* row = strided.data() + r * stride * bytes;
    std::memcpy(out.data() + r * width * bytes, row, static_cast<std::size_t>(width * bytes));
    untouched = untouched && std::all_of(row + width * bytes, row + stride * bytes,
                                         [](std::uint8_t b) { return b == 0xff; });
  }
  if (gaps_untouched != nullptr) *gaps_untouched = untouched;
  return out;
}

}  // namespace csa::tools
