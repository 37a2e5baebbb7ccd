#include "common/error.hpp"

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
