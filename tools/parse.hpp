// Checked parsing of the command line's values: every number is one whole integer in range,
// and every error names the option it came from (exit code 2 through CLI11).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "csa/csa.hpp"

namespace csa::tools {

// The whole of `text` as an integer in [lo, hi]; CLI::ValidationError naming `option` else.
std::int64_t parse_int(std::string_view text, std::int64_t lo, std::int64_t hi,
                       const std::string& option);

// A configuration: "ratio=4,coff=2,head_dim=512" (keys in any order), or the short form
// "4,2,512" (RATIO,COFF,HEAD_DIM).
Config parse_config(const std::string& text, const std::string& option = "--config");
// The keyed form, which cannot be misread.
std::string format_config(const Config& c);

// Splits at `separator`; an empty text gives one empty item.
std::vector<std::string> split(const std::string& text, char separator);

}  // namespace csa::tools
