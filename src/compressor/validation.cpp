#include "compressor/validation.hpp"

#include <cstdint>

#include "common/error.hpp"
#include "schedule/short_window.hpp"

namespace csa::compressor {

namespace {

constexpr std::int64_t kInt32Limit = std::int64_t{1} << 31;

// A buffer pointer: may be null only when the buffer is empty.
void check_pointer(const void* ptr, const char* name, std::int64_t elements, unsigned alignment) {
  if (ptr == nullptr) {
    if (elements == 0) return;
    fail(Status::kInvalidArgument, "{} is null but holds {} elements", name, elements);
  }
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  if (address % alignment != 0) {
    fail(Status::kInvalidArgument, "{} ({:#x}) is not {}-byte aligned", name, address, alignment);
  }
}

struct Shape {
  std::int64_t width;        // coff * head_dim
  std::int64_t token_elems;  // total_tokens * width
  std::int64_t comp_elems;   // total_comp * head_dim
  std::int64_t ape_elems;    // ratio * width
};

Shape checked_shape(const Config& c, std::int64_t total_tokens, std::int32_t num_segments,
                    std::int64_t total_comp) {
  validate_config(c);
  // NOTE: kernels index the offset arrays (num_segments + 1 entries) and stride over segments
  // with int32: the bound leaves room for both.
  if (num_segments < 0 || num_segments > kMaxSegments) {
    fail(Status::kInvalidArgument, "num_segments is {} (must be in [0, 2^30])", num_segments);
  }
  if (total_tokens < 0)
    fail(Status::kInvalidArgument, "total_tokens is {} (must be >= 0)", total_tokens);
  if (total_comp < 0) fail(Status::kInvalidArgument, "total_comp is {} (must be >= 0)", total_comp);
  Shape s{};
  s.width = static_cast<std::int64_t>(c.coff) * c.head_dim;
  // NOTE: kernels index with int32 flat offsets; these bounds keep every offset below 2^31.
  if (total_tokens > (kInt32Limit - 1) / s.width) {
    fail(Status::kInvalidArgument,
         "total_tokens * coff * head_dim = {} * {} overflows int32 offsets (must be < 2^31)",
         total_tokens, s.width);
  }
  if (total_comp > (kInt32Limit - 1) / c.head_dim) {
    fail(Status::kInvalidArgument,
         "total_comp * head_dim = {} * {} overflows int32 offsets (must be < 2^31)", total_comp,
         c.head_dim);
  }
  if (total_comp > 0 && total_tokens < c.ratio) {
    fail(Status::kInvalidArgument,
         "total_comp is {} but total_tokens ({}) < ratio ({}): the first window needs ratio tokens",
         total_comp, total_tokens, c.ratio);
  }
  s.token_elems = total_tokens * s.width;
  s.comp_elems = total_comp * c.head_dim;
  s.ape_elems = static_cast<std::int64_t>(c.ratio) * s.width;
  return s;
}

constexpr unsigned kDataAlign = 16;

constexpr unsigned kOffsetAlign = 4;

}  // namespace

void validate_sizes(const Config& config, std::int64_t total_tokens, std::int32_t num_segments,
                    std::int64_t total_comp) {
  checked_shape(config, total_tokens, num_segments, total_comp);
}

void validate_config(const Config& c) {
  if (c.ratio < 1 || c.ratio > kMaxRatio)
    fail(Status::kInvalidArgument, "ratio is {} (supported: 1..{})", c.ratio, kMaxRatio);
  if (c.coff != 1 && c.coff != 2)
    fail(Status::kInvalidArgument, "coff is {} (supported: 1 or 2)", c.coff);
  if (c.head_dim < 1 || c.head_dim > kMaxHeadDim) {
    fail(Status::kInvalidArgument, "head_dim is {} (supported: 1..{})", c.head_dim, kMaxHeadDim);
  }
}

void check_family(const Config& c, Family family) {
  validate_config(c);
  if (family == Family::kShortWindow && c.ratio > schedule::kShortWindowMaxRatio) {
    fail(Status::kUnsupported,
         "ratio {} (coff {}, head_dim {}) is beyond the short-window family (ratio 1..{}); use "
         "the long-window family (Family::kLongWindow) or let the runtime route (Family::kAuto)",
         c.ratio, c.coff, c.head_dim, schedule::kShortWindowMaxRatio);
  }
}

namespace {

// The shape and the inputs both directions share (ForwardArgs or BackwardArgs).
template <typename Args>
Shape validate_inputs(const Args& a) {
  const Shape s = checked_shape(a.config, a.total_tokens, a.num_segments, a.total_comp);
  check_pointer(a.kv, "kv", s.token_elems, kDataAlign);
  check_pointer(a.score, "score", s.token_elems, kDataAlign);
  check_pointer(a.ape, "ape", s.ape_elems, kDataAlign);
  const std::int64_t offsets = std::int64_t{a.num_segments} + 1;
  check_pointer(a.cu_seqlens, "cu_seqlens", offsets, kOffsetAlign);
  check_pointer(a.cu_seqlens_comp, "cu_seqlens_comp", offsets, kOffsetAlign);
  return s;
}

}  // namespace

void validate_forward(const ForwardArgs& a) {
  const Shape s = validate_inputs(a);
  check_pointer(a.out, "out", s.comp_elems, kDataAlign);
}

void validate_backward(const BackwardArgs& a) {
  const Shape s = validate_inputs(a);
  if ((a.flags & ~(kAccumulateGradApe | kDeterministic)) != 0) {
    fail(Status::kInvalidArgument,
         "flags {:#x} has unknown bits (known: CSA_ACCUMULATE_GRAD_APE=1, CSA_DETERMINISTIC=2)",
         a.flags);
  }
  check_pointer(a.grad_out, "grad_out", s.comp_elems, kDataAlign);
  check_pointer(a.grad_kv, "grad_kv", s.token_elems, kDataAlign);
  check_pointer(a.grad_score, "grad_score", s.token_elems, kDataAlign);
  check_pointer(a.grad_ape, "grad_ape", s.ape_elems, kDataAlign);
}

}  // namespace csa::compressor
