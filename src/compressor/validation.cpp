#include "compressor/validation.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "csa_params.h"

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

// The smallest power of two that divides n (n >= 1).
std::int64_t low_bit(std::int64_t n) {
  return n & -n;
}

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

std::int64_t row_alignment(const Config& c) {
  const std::int64_t chunk = 16 / element_bytes(c.dtype);
  return std::min<std::int64_t>(chunk, low_bit(c.head_dim));
}

int element_bytes(DType dtype) {
  return dtype == DType::kF32 ? 4 : 2;
}

std::int64_t checked_stride(std::int64_t stride, const char* name, std::int64_t width,
                            std::int64_t rows, const Config& c) {
  if (stride == 0) return width;
  if (stride < width) {
    fail(Status::kInvalidArgument, "{} is {} (must be 0 for dense rows, or >= the row width {})",
         name, stride, width);
  }
  const std::int64_t align = row_alignment(c);
  if (stride % align != 0) {
    fail(Status::kInvalidArgument,
         "{} is {}: rows {} elements apart lose the {}-byte alignment that {} rows of head_dim {} "
         "are accessed with (must be a multiple of {})",
         name, stride, stride, align * element_bytes(c.dtype), dtype_name(c.dtype), c.head_dim,
         align);
  }
  // NOTE: kernels index rows with int32 strides and 64-bit products; the last row must end
  // below 2^31 elements like a dense buffer's.
  if (rows > 0 && (rows - 1) > (kInt32Limit - 1 - width) / stride) {
    fail(Status::kInvalidArgument,
         "{} = {} over {} rows overflows int32 offsets (the last row must end below 2^31 "
         "elements)",
         name, stride, rows);
  }
  return stride;
}

std::int64_t strided_elements(std::int64_t rows, std::int64_t stride, std::int64_t width) {
  return rows == 0 ? 0 : (rows - 1) * stride + width;
}

void validate_config(const Config& c) {
  if (c.dtype != DType::kBf16 && c.dtype != DType::kF16 && c.dtype != DType::kF32) {
    fail(Status::kInvalidArgument, "dtype is {} (supported: bf16 = 0, fp16 = 1, fp32 = 2)",
         static_cast<int>(c.dtype));
  }
  if (c.layout != Layout::kThd && c.layout != Layout::kSbhd) {
    fail(Status::kInvalidArgument, "layout is {} (supported: thd = 0, sbhd = 1)",
         static_cast<int>(c.layout));
  }
  if (c.ratio < 1 || c.ratio > kMaxRatio)
    fail(Status::kInvalidArgument, "ratio is {} (supported: 1..{})", c.ratio, kMaxRatio);
  if (c.coff != 1 && c.coff != 2)
    fail(Status::kInvalidArgument, "coff is {} (supported: 1 or 2)", c.coff);
  if (c.head_dim < 1 || c.head_dim > kMaxHeadDim) {
    fail(Status::kInvalidArgument, "head_dim is {} (supported: 1..{})", c.head_dim, kMaxHeadDim);
  }
  const TailShape& t = c.tail;
  if (t.norm && t.norm_weight_dtype != DType::kBf16 && t.norm_weight_dtype != DType::kF32) {
    fail(Status::kInvalidArgument,
         "config.tail.norm_weight_dtype is {} (supported: bf16 = 0, fp32 = 2)",
         static_cast<int>(t.norm_weight_dtype));
  }
  if (t.rope_dim < 0 || t.rope_dim % 2 != 0 || t.rope_dim > c.head_dim) {
    fail(Status::kInvalidArgument, "config.tail.rope_dim is {} (must be even, in 0..head_dim {})",
         t.rope_dim, c.head_dim);
  }
  if (t.hadamard && (c.head_dim & (c.head_dim - 1)) != 0) {
    fail(Status::kInvalidArgument, "config.tail.hadamard needs a power-of-two head_dim, not {}",
         c.head_dim);
  }
}

void validate_tail(const Config& c, const Tail& t) {
  const TailShape& shape = c.tail;
  if (shape.norm) {
    if (t.norm_weight == nullptr)
      fail(Status::kInvalidArgument, "tail.norm_weight is null but config.tail.norm is true");
    if (!std::isfinite(t.eps) || t.eps <= 0.0f)
      fail(Status::kInvalidArgument, "tail.eps is {} (must be finite and > 0)", t.eps);
  } else if (t.norm_weight != nullptr) {
    fail(Status::kInvalidArgument, "tail.norm_weight is set but config.tail.norm is false");
  }
  if (shape.rope()) {
    if (t.rope_cos == nullptr || t.rope_sin == nullptr) {
      fail(Status::kInvalidArgument, "tail.rope_{} is null with config.tail.rope_dim {}",
           t.rope_cos == nullptr ? "cos" : "sin", shape.rope_dim);
    }
    // Entries of one table must stay within int64 (and within the int32 indexing of kernels).
    constexpr std::int64_t kMaxTableEntries = (std::int64_t{1} << 31) - 1;
    if (t.rope_max_blocks < 1 || t.rope_max_blocks > kMaxTableEntries / (shape.rope_dim / 2)) {
      fail(Status::kInvalidArgument,
           "tail.rope_max_blocks is {} (must be >= 1, and rows * rope_dim / 2 < 2^31)",
           t.rope_max_blocks);
    }
  } else if (t.rope_cos != nullptr || t.rope_sin != nullptr || t.rope_max_blocks != 0) {
    fail(Status::kInvalidArgument,
         "tail.rope_cos / rope_sin / rope_max_blocks are set but config.tail.rope_dim is 0");
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
  if (c.tail.any()) {
    const bool long_window = family == Family::kLongWindow ||
                             (family == Family::kAuto && c.ratio > schedule::kShortWindowMaxRatio);
    if (family != Family::kAuto && family != Family::kShortWindow && !long_window) {
      fail(Status::kUnsupported,
           "config.tail (the fused RMSNorm/RoPE/Hadamard) runs in the short-window and "
           "long-window families; call with Family::kAuto, kShortWindow or kLongWindow");
    }
    if (long_window) {
      // The row's last column slice runs the tail over whole rows of long_tail_vec columns a
      // thread (kernels/long_window_tail.cuh).
      if (c.head_dim > csa_kernel::kTailMaxHeadDim || (c.head_dim & (c.head_dim - 1)) != 0) {
        fail(Status::kUnsupported,
             "config.tail (the fused RMSNorm/RoPE/Hadamard) in the long-window family (ratio {}) "
             "needs head_dim a power of two, at most {}, not {}",
             c.ratio, csa_kernel::kTailMaxHeadDim, c.head_dim);
      }
    } else if (c.head_dim > csa_kernel::kTailMaxHeadDim || schedule::tail_vec(2, c.head_dim) == 0) {
      fail(Status::kUnsupported,
           "config.tail (the fused RMSNorm/RoPE/Hadamard) needs head_dim a power of two or a "
           "multiple of 32, at most {}, not {}",
           csa_kernel::kTailMaxHeadDim, c.head_dim);
    }
  }
}

namespace {

// SBHD's sizes follow from (S, B): every column one segment, no offsets, no padding rows.
template <typename Args>
void check_layout(const Args& a) {
  const Config& c = a.config;
  if (c.layout == Layout::kThd) {
    if (a.seq_len != 0) {
      fail(Status::kInvalidArgument,
           "seq_len is {} but the layout is THD (seq_len is SBHD's S; THD takes cu_seqlens)",
           a.seq_len);
    }
    return;
  }
  if (a.num_segments < 1) {
    fail(Status::kInvalidArgument,
         "num_segments (SBHD's batch B) is {} (must be >= 1: every batch column is a segment)",
         a.num_segments);
  }
  if (a.seq_len < 0)
    fail(Status::kInvalidArgument, "seq_len (SBHD's S) is {} (must be >= 0)", a.seq_len);
  if (a.cu_seqlens != nullptr || a.cu_seqlens_comp != nullptr) {
    fail(Status::kInvalidArgument,
         "{} is set but the layout is SBHD, which has no offsets (pass null)",
         a.cu_seqlens != nullptr ? "cu_seqlens" : "cu_seqlens_comp");
  }
  if (a.seq_len > (kInt32Limit - 1) / a.num_segments ||
      a.total_tokens != a.seq_len * a.num_segments) {
    fail(Status::kInvalidArgument,
         "total_tokens is {} but SBHD with seq_len {} and batch {} has seq_len * batch rows",
         a.total_tokens, a.seq_len, a.num_segments);
  }
  const std::int64_t rows = (a.seq_len / c.ratio) * a.num_segments;
  if (a.total_comp != rows) {
    fail(Status::kInvalidArgument,
         "total_comp is {} but SBHD with seq_len {}, ratio {} and batch {} has (seq_len / ratio) "
         "* batch = {} rows (no padding rows)",
         a.total_comp, a.seq_len, c.ratio, a.num_segments, rows);
  }
}

// The shape and the inputs both directions share (ForwardArgs or BackwardArgs).
template <typename Args>
Shape validate_inputs(const Args& a) {
  validate_config(a.config);
  check_layout(a);
  const Shape s = checked_shape(a.config, a.total_tokens, a.num_segments, a.total_comp);
  const std::int64_t kv_stride =
      checked_stride(a.kv_stride, "kv_stride", s.width, a.total_tokens, a.config);
  const std::int64_t score_stride =
      checked_stride(a.score_stride, "score_stride", s.width, a.total_tokens, a.config);
  check_pointer(a.kv, "kv", strided_elements(a.total_tokens, kv_stride, s.width), kDataAlign);
  check_pointer(a.score, "score", strided_elements(a.total_tokens, score_stride, s.width),
                kDataAlign);
  check_pointer(a.ape, "ape", s.ape_elems, kDataAlign);
  if (a.config.layout == Layout::kThd) {
    const std::int64_t offsets = std::int64_t{a.num_segments} + 1;
    check_pointer(a.cu_seqlens, "cu_seqlens", offsets, kOffsetAlign);
    check_pointer(a.cu_seqlens_comp, "cu_seqlens_comp", offsets, kOffsetAlign);
  }
  return s;
}

}  // namespace

// The long-window tail's pooled rows: with a tail only; (total_comp, head_dim) fp32, dense.
template <typename Args>
void check_pooled(const Args& a, const char* name) {
  if (a.pooled == nullptr) return;
  if (!a.config.tail.any())
    fail(Status::kInvalidArgument, "{} is set but config.tail has no stage (no tail)", name);
  check_pointer(a.pooled, name, a.total_comp * a.config.head_dim, kDataAlign);
}

// The tail's tensors of a call: their rules, alignment and (SBHD) the tables' rows.
template <typename Args>
void check_tail_tensors(const Args& a) {
  validate_tail(a.config, a.tail);
  const TailShape& tail = a.config.tail;
  if (tail.norm)
    check_pointer(a.tail.norm_weight, "tail.norm_weight", a.config.head_dim, kDataAlign);
  if (tail.rope()) {
    const std::int64_t entries = a.tail.rope_max_blocks * (tail.rope_dim / 2);
    check_pointer(a.tail.rope_cos, "tail.rope_cos", entries, 4);
    check_pointer(a.tail.rope_sin, "tail.rope_sin", entries, 4);
    // SBHD's blocks are known here: every row's block must have a table row.
    if (a.config.layout == Layout::kSbhd && a.seq_len / a.config.ratio > a.tail.rope_max_blocks) {
      fail(Status::kInvalidArgument,
           "tail.rope_max_blocks is {} but SBHD's S = {} gives {} blocks at ratio {}",
           a.tail.rope_max_blocks, a.seq_len, a.seq_len / a.config.ratio, a.config.ratio);
    }
  }
}

void validate_forward(const ForwardArgs& a) {
  const Shape s = validate_inputs(a);
  const std::int64_t d = a.config.head_dim;
  const std::int64_t out_stride =
      checked_stride(a.out_stride, "out_stride", d, a.total_comp, a.config);
  check_pointer(a.out, "out", strided_elements(a.total_comp, out_stride, d), kDataAlign);
  (void)s;
  check_tail_tensors(a);
  const TailShape& tail = a.config.tail;
  if (a.rstd != nullptr) {
    if (!tail.norm)
      fail(Status::kInvalidArgument, "rstd is set but config.tail.norm is false (no norm)");
    check_pointer(a.rstd, "rstd", a.total_comp, 4);
  }
  check_pooled(a, "pooled");
}

void validate_backward(const BackwardArgs& a) {
  const Shape s = validate_inputs(a);
  if ((a.flags & ~(kAccumulateGradApe | kDeterministic)) != 0) {
    fail(Status::kInvalidArgument,
         "flags {:#x} has unknown bits (known: CSA_ACCUMULATE_GRAD_APE=1, CSA_DETERMINISTIC=2)",
         a.flags);
  }
  const std::int64_t d = a.config.head_dim;
  const std::int64_t t = a.total_tokens;
  const std::int64_t gout =
      checked_stride(a.grad_out_stride, "grad_out_stride", d, a.total_comp, a.config);
  const std::int64_t gkv = checked_stride(a.grad_kv_stride, "grad_kv_stride", s.width, t, a.config);
  const std::int64_t gsc =
      checked_stride(a.grad_score_stride, "grad_score_stride", s.width, t, a.config);
  check_pointer(a.grad_out, "grad_out", strided_elements(a.total_comp, gout, d), kDataAlign);
  check_pointer(a.grad_kv, "grad_kv", strided_elements(t, gkv, s.width), kDataAlign);
  check_pointer(a.grad_score, "grad_score", strided_elements(t, gsc, s.width), kDataAlign);
  check_pointer(a.grad_ape, "grad_ape", s.ape_elems, kDataAlign);
  check_tail_tensors(a);
  if (a.config.tail.norm) {
    if (a.grad_norm_weight == nullptr) {
      fail(Status::kInvalidArgument,
           "grad_norm_weight is null but config.tail.norm is true (the weight's gradient)");
    }
    check_pointer(a.grad_norm_weight, "grad_norm_weight", d, 4);
  } else if (a.grad_norm_weight != nullptr) {
    fail(Status::kInvalidArgument, "grad_norm_weight is set but config.tail.norm is false");
  }
  check_pooled(a, "pooled");
}

bool dense(std::int64_t stride, std::int64_t width) {
  return stride == 0 || stride == width;
}

int kernel_layout(const ForwardArgs& a) {
  if (a.config.layout == Layout::kSbhd) return csa_kernel::kLayoutSbhd;
  const std::int64_t w = static_cast<std::int64_t>(a.config.coff) * a.config.head_dim;
  return dense(a.kv_stride, w) && dense(a.score_stride, w) && dense(a.out_stride, a.config.head_dim)
             ? csa_kernel::kLayoutThdPacked
             : csa_kernel::kLayoutThdStrided;
}

int kernel_layout(const BackwardArgs& a) {
  if (a.config.layout == Layout::kSbhd) return csa_kernel::kLayoutSbhd;
  const std::int64_t w = static_cast<std::int64_t>(a.config.coff) * a.config.head_dim;
  const std::int64_t d = a.config.head_dim;
  return dense(a.kv_stride, w) && dense(a.score_stride, w) && dense(a.grad_kv_stride, w) &&
                 dense(a.grad_score_stride, w) && dense(a.grad_out_stride, d)
             ? csa_kernel::kLayoutThdPacked
             : csa_kernel::kLayoutThdStrided;
}

}  // namespace csa::compressor
