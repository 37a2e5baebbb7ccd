// The kernel templates of kernels/, embedded into the library at build time.
#pragma once

#include <string_view>
#include <vector>

#include "nvrtc/compiler.hpp"

namespace csa::compressor {

const std::vector<nvrtc::Header>& kernel_headers();
// XXH3-128 over every embedded header's name and text: part of every cache key.
std::string_view kernel_sources_hash();

}  // namespace csa::compressor
