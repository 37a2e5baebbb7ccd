#include "compressor/kernel_templates.hpp"

#include <algorithm>

namespace csa::compressor {

int ModuleBuilder::add_expression(std::string_view header, std::string name,
                                  std::optional<Residency> r) {
  if (std::find(headers_.begin(), headers_.end(), header) == headers_.end())
    headers_.push_back(header);
  const auto it = std::find(names_.begin(), names_.end(), name);
  if (it != names_.end()) return static_cast<int>(it - names_.begin());
  names_.push_back(std::move(name));
  residency_.push_back(std::move(r));
  return static_cast<int>(names_.size()) - 1;
}

ResidencyTable ModuleBuilder::residency() const {
  const bool any = std::any_of(residency_.begin(), residency_.end(),
                               [](const std::optional<Residency>& r) { return r.has_value(); });
  return any ? residency_ : ResidencyTable{};
}

std::string ModuleBuilder::source() const {
  std::string out;
  for (const auto header : headers_) out += fmt::format("#include \"{}\"\n", header);
  return out;
}

}  // namespace csa::compressor
