#include "common/error.hpp"

#include <fmt/format.h>

#include <string>

namespace csa {

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBf16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kF32:
      return "fp32";
  }
  return "unknown";
}

const char* layout_name(Layout layout) noexcept {
  switch (layout) {
    case Layout::kThd:
      return "thd";
    case Layout::kSbhd:
      return "sbhd";
  }
  return "unknown";
}

std::string tail_name(const TailShape& t) {
  if (!t.any()) return "none";
  std::string out;
  auto add = [&](const std::string& stage) { out += (out.empty() ? "" : "+") + stage; };
  if (t.norm) add(t.norm_weight_dtype == DType::kBf16 ? "norm-bf16" : "norm");
  if (t.rope()) add(fmt::format("rope{}{}", t.rope_dim, t.rope_interleaved ? "" : "-half"));
  if (t.hadamard) add("hadamard");
  return out;
}

const char* status_name(Status status) noexcept {
  switch (status) {
    case Status::kOk:
      return "ok";
    case Status::kInvalidArgument:
      return "invalid argument";
    case Status::kUnsupported:
      return "unsupported";
    case Status::kDriverUnavailable:
      return "driver unavailable";
    case Status::kDriverError:
      return "driver error";
    case Status::kCompileError:
      return "compile error";
    case Status::kCacheError:
      return "cache error";
    case Status::kCaptureUnsafe:
      return "capture unsafe";
    case Status::kJitDisabled:
      return "jit disabled";
    case Status::kInternal:
      return "internal error";
  }
  return "unknown";
}

Error::Error(Status code, const std::string& message)
    : std::runtime_error(std::string("csa: ") + status_name(code) + ": " + message), code_(code) {}

}  // namespace csa
