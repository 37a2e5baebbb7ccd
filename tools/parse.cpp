#include "parse.hpp"

#include <fmt/format.h>

#include <charconv>
#include <sstream>

namespace csa::tools {

std::int64_t parse_int(std::string_view text, std::int64_t lo, std::int64_t hi,
                       const std::string& option) {
  std::int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value < lo || value > hi) {
    throw CLI::ValidationError(
        option, fmt::format("'{}' is not an integer in [{}, {}]", std::string(text), lo, hi));
  }
  return value;
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(text);
  while (std::getline(in, item, separator)) out.push_back(item);
  if (out.empty() || (!text.empty() && text.back() == separator)) out.emplace_back();
  return out;
}

Config parse_config(const std::string& text, const std::string& option) {
  const auto fields = split(text, ',');
  const auto form_error = [&](const std::string& why) {
    return CLI::ValidationError(
        option, fmt::format("'{}' {}; write ratio=R,coff=C,head_dim=D (or R,C,D)", text, why));
  };
  Config c;
  if (text.find('=') == std::string::npos) {
    if (fields.size() != 3) throw form_error("is not three numbers");
    c.ratio = static_cast<std::int32_t>(parse_int(fields[0], 1, 256, option + " ratio"));
    c.coff = static_cast<std::int32_t>(parse_int(fields[1], 1, 2, option + " coff"));
    c.head_dim = static_cast<std::int32_t>(parse_int(fields[2], 1, 4096, option + " head_dim"));
    return c;
  }
  bool seen[3] = {false, false, false};
  for (const auto& field : fields) {
    const auto eq = field.find('=');
    if (eq == std::string::npos) throw form_error(fmt::format("has '{}' without a key", field));
    const std::string key = field.substr(0, eq);
    const std::string value = field.substr(eq + 1);
    int index = -1;
    if (key == "ratio") {
      index = 0;
      c.ratio = static_cast<std::int32_t>(parse_int(value, 1, 256, option + " ratio"));
    } else if (key == "coff") {
      index = 1;
      c.coff = static_cast<std::int32_t>(parse_int(value, 1, 2, option + " coff"));
    } else if (key == "head_dim") {
      index = 2;
      c.head_dim = static_cast<std::int32_t>(parse_int(value, 1, 4096, option + " head_dim"));
    } else {
      throw form_error(fmt::format("has the unknown key '{}'", key));
    }
    if (seen[index]) throw form_error(fmt::format("gives {} twice", key));
    seen[index] = true;
  }
  if (!seen[0] || !seen[1] || !seen[2]) throw form_error("lacks a key");
  return c;
}

std::string format_config(const Config& c) {
  std::string text = fmt::format("ratio={},coff={},head_dim={}", c.ratio, c.coff, c.head_dim);
  if (c.dtype != DType::kBf16) text += fmt::format(" {}", dtype_name(c.dtype));
  if (c.layout != Layout::kThd) text += fmt::format(" {}", layout_name(c.layout));
  if (c.strided && c.layout == Layout::kThd) text += " strided";
  if (c.tail.any()) text += " tail=" + tail_name(c.tail);
  return text;
}

}  // namespace csa::tools
