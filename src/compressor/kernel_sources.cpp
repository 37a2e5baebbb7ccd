#include "compressor/kernel_sources.hpp"

#include "cache/key.hpp"
#include "embedded_kernels.hpp"  // generated from kernels/ at build time

namespace csa::compressor {

const std::vector<nvrtc::Header>& kernel_headers() {
  static const std::vector<nvrtc::Header> headers = [] {
    std::vector<nvrtc::Header> out;
    for (const auto& file : embedded::kKernelFiles) out.push_back({file.name, file.content});
    return out;
  }();
  return headers;
}

std::string_view kernel_sources_hash() {
  static const std::string hash = [] {
    std::string all;
    for (const auto& file : embedded::kKernelFiles) {
      all.append(file.name).push_back('\0');
      all.append(file.content).push_back('\0');
    }
    return cache::hash128_hex(all);
  }();
  return hash;
}

}  // namespace csa::compressor
