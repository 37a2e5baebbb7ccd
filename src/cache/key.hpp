// The cache key of one compiled module: a 128-bit XXH3 hash over a canonical JSON record of
// everything that changes the cubin (sources, kernel names, options, arch, NVRTC version,
// library version). No paths, no mtimes.
#pragma once

#include <string>
#include <string_view>

#include "nvrtc/compiler.hpp"

namespace csa::cache {

struct CacheKey {
  std::string label;   // readable file-name prefix, e.g. "short-r4-c2-d128-sm_90"
  std::string record;  // canonical JSON
  std::string hash;    // 32 hex digits
};

// `sources_hash` covers the text of every embedded header the translation unit can include;
// `fit` is the version of the rule that may compile the module a second time with other names
// (0: none), which changes the cubin too.
CacheKey make_key(std::string label, const nvrtc::CompileRequest& request,
                  std::string_view sources_hash, int fit = 0);

std::string hash128_hex(std::string_view data);

}  // namespace csa::cache
