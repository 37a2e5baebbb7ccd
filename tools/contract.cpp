#include "contract.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "layout_data.hpp"

namespace csa::tools {

Diff diff(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b, DType dtype) {
  Diff d;
  const std::size_t n = a.size() / static_cast<std::size_t>(element_size(dtype));
  for (std::size_t i = 0; i < n; ++i) {
    const double x = element_value(a, dtype, i);
    const double y = element_value(b, dtype, i);
    if (std::isnan(x) || std::isnan(y)) {
      d.nan_mismatch += std::isnan(x) != std::isnan(y) ? 1 : 0;
      if (std::isnan(x)) ++d.differing;
      continue;
    }
    if (x != y) ++d.differing;
    const double scale = dtype == DType::kF32 ? std::max(1.0, std::fabs(y)) : 1.0;
    d.max_abs = std::max(d.max_abs, std::fabs(x - y) / scale);
  }
  return d;
}

std::string contract_failure(const std::vector<std::uint8_t>& got,
                             const std::vector<std::uint8_t>& ref, DType dtype, bool bitwise,
                             const std::string& name, double margin) {
  if (got.size() != ref.size())
    return fmt::format("{}: {} bytes against {}", name, got.size(), ref.size());
  const Diff d = diff(got, ref, dtype);
  if (d.nan_mismatch > 0) return fmt::format("{}: {} NaN mismatches", name, d.nan_mismatch);
  if (bitwise)
    return d.differing == 0 ? "" : fmt::format("{}: {} elements differ", name, d.differing);
  const std::size_t n = got.size() / static_cast<std::size_t>(element_size(dtype));
  if (dtype == DType::kF32) {
    return d.max_abs <= 0x1p-16
               ? ""
               : fmt::format("{}: max relative difference {:.3g}", name, d.max_abs);
  }
  const std::size_t contract = std::max<std::size_t>(1, dtype == DType::kF16 ? n / 100 : n / 1000);
  const auto allowed = static_cast<std::size_t>(static_cast<double>(contract) * margin);
  if (d.differing > allowed || d.max_abs > 1.6e-2) {
    return fmt::format("{}: {} of {} differ (allowed {} of the contract's {}), max |diff| {:.3g}",
                       name, d.differing, n, allowed, contract, d.max_abs);
  }
  return "";
}

}  // namespace csa::tools
