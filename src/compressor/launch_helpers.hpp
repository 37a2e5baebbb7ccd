// Launch-side helpers the service's translation units share: grid arithmetic, stream-ordered
// scratch memory, and filling the kernels' by-value parameter structs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "csa/csa.hpp"
#include "csa_params.h"
#include "driver/driver.hpp"
#include "launch/launch.hpp"

namespace csa::compressor::detail {

inline unsigned blocks_for(std::int64_t threads, unsigned per_block) {
  return static_cast<unsigned>((threads + per_block - 1) / per_block);
}

// Stream-ordered scratch memory: freed on the stream after the kernels that use it.
class StreamScratch {
 public:
  StreamScratch(const driver::Driver& driver, std::size_t bytes, CUstream stream)
      : driver_(driver), stream_(stream) {
    driver_.check(driver_.api().cuMemAllocAsync(&ptr_, bytes, stream_),
                  "cuMemAllocAsync (grad_ape workspace)");
  }
  ~StreamScratch() { driver_.api().cuMemFreeAsync(ptr_, stream_); }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  CUdeviceptr get() const { return ptr_; }

 private:
  const driver::Driver& driver_;
  CUstream stream_;
  CUdeviceptr ptr_ = 0;
};

// A validated row stride as the kernels take it (0: dense rows of `width`).
inline csa_i32 row_stride(std::int64_t stride, std::int64_t width) {
  return static_cast<csa_i32>(stride == 0 ? width : stride);
}

// The inputs and sizes both kernel parameter structs share. Sizes fit int32: validated.
template <typename Params, typename Args>
void fill_inputs(Params& params, const Args& a) {
  const std::int64_t width = static_cast<std::int64_t>(a.config.coff) * a.config.head_dim;
  params.kv = a.kv;
  params.score = a.score;
  params.ape = a.ape;
  params.cu_seqlens = a.cu_seqlens;
  params.cu_seqlens_comp = a.cu_seqlens_comp;
  params.total_tokens = static_cast<csa_i32>(a.total_tokens);
  params.num_segments = a.num_segments;
  params.total_comp = static_cast<csa_i32>(a.total_comp);
  params.kv_stride = row_stride(a.kv_stride, width);
  params.score_stride = row_stride(a.score_stride, width);
  params.seq_len = static_cast<csa_i32>(a.seq_len);
  // Only SBHD kernels split rows by B (validated >= 1); THD calls skip the divisor's work.
  if (a.config.layout == Layout::kSbhd)
    params.batch_divisor = csa_kernel::row_divisor(std::max<csa_i32>(a.num_segments, 1));
}

// The tail epilogue's tensors (validated: set exactly as config.tail names its stages).
template <typename Params>
void fill_tail(Params& params, const Tail& t) {
  params.norm_weight = t.norm_weight;
  params.eps = t.eps;
  params.rope_cos = t.rope_cos;
  params.rope_sin = t.rope_sin;
  params.rope_max_blocks = static_cast<std::int32_t>(
      std::min<std::int64_t>(t.rope_max_blocks, std::numeric_limits<std::int32_t>::max()));
}

inline void fill_output(csa_kernel::ForwardParams& params, const ForwardArgs& a) {
  params.out = a.out;
  params.out_stride = row_stride(a.out_stride, a.config.head_dim);
  fill_tail(params, a.tail);
  params.rstd = a.rstd;
}

template <typename T>
T* device_ptr(CUdeviceptr p) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(p));
}

// The backward's gradient pointers (inputs come from fill_inputs).
inline void fill_gradients(csa_kernel::BackwardParams& params, const BackwardArgs& a) {
  const std::int64_t width = static_cast<std::int64_t>(a.config.coff) * a.config.head_dim;
  params.grad_out = a.grad_out;
  params.grad_kv = a.grad_kv;
  params.grad_score = a.grad_score;
  params.grad_ape = a.grad_ape;
  params.grad_out_stride = row_stride(a.grad_out_stride, a.config.head_dim);
  params.grad_kv_stride = row_stride(a.grad_kv_stride, width);
  params.grad_score_stride = row_stride(a.grad_score_stride, width);
  fill_tail(params, a.tail);
  params.grad_w = a.grad_norm_weight;
}

// A backward call's stream workspace, in floats: the fixed order's partials (`groups` row
// groups' blocks of grad_ape's partials, then the tail's grad_w's), then the row-stats form's
// row scalars (`stats_rows` rows). Either part may be empty.
struct BackwardWorkspace {
  std::int64_t grad_w_elements = 0;  // in each group's block, after grad_ape's
  std::int64_t partial_floats = 0;
  std::int64_t stats_floats = 0;
  BackwardWorkspace(const Config& c, std::int64_t ape_elements, std::int64_t groups,
                    std::int64_t stats_rows)
      : grad_w_elements(c.tail.norm ? c.head_dim : 0),
        partial_floats(groups * (ape_elements + grad_w_elements)),
        stats_floats(stats_rows * csa_kernel::kTailRowStatsFloats) {}
  std::size_t bytes() const {
    return static_cast<std::size_t>(partial_floats + stats_floats) * sizeof(float);
  }
};

// A kernel of the tail's rows (kernels/tail_row_stats.cuh: a warp a row writes its norm scalars;
// tail_rows_forward.cuh: whole rows run the tail): `rows` rows, `rows_per_cta` in each CTA of
// `threads` threads.
template <class Params>
void launch_rows(const driver::Driver& d, CUkernel kernel, const Params& params, std::int64_t rows,
                 int rows_per_cta, int threads, bool programmatic, CUstream stream,
                 const char* what) {
  launch::LaunchShape shape;
  shape.grid_x = blocks_for(rows, static_cast<unsigned>(rows_per_cta));
  shape.block_x = static_cast<unsigned>(threads);
  shape.programmatic = programmatic;
  launch::launch(d, kernel, shape, params, stream, what);
}

// The CTA of a grad_ape reduction kernel: `columns` x `lanes` threads, each thread summing
// `per_thread` consecutive elements over its lane's groups (ape_reduce<LANES>: 32 columns, 1
// element; ape_reduce_quads<LANES>: 256 / LANES columns, 4 elements).
struct ApeReduceShape {
  int columns = 32;
  int lanes = 8;
  int per_thread = 1;
};

// The fixed-order sum of `groups` grad_ape partials of `elements` floats each into
// a.grad_ape (overwritten, or added into with CSA_ACCUMULATE_GRAD_APE). `sm_count`: the
// device's, to tell a grid of one wave.
// `grad_w_elements`: the tail's grad_w partials after grad_ape's in each group (0: none).
inline void launch_ape_reduce(const driver::Driver& d, CUkernel kernel, const float* workspace,
                              const BackwardArgs& a, std::int64_t elements, int groups,
                              const ApeReduceShape& cta, int sm_count, bool programmatic,
                              CUstream stream, std::int64_t grad_w_elements = 0) {
  csa_kernel::ApeReduceParams reduce{};
  reduce.workspace = workspace;
  reduce.grad_ape = a.grad_ape;
  reduce.grad_w = a.grad_norm_weight;
  reduce.ape_elements = static_cast<csa_i32>(elements);
  elements += grad_w_elements;
  reduce.elements = static_cast<csa_i32>(elements);
  reduce.groups = groups;
  reduce.accumulate = (a.flags & kAccumulateGradApe) != 0 ? 1 : 0;
  launch::LaunchShape shape;
  shape.grid_x = blocks_for((elements + cta.per_thread - 1) / cta.per_thread,
                            static_cast<unsigned>(cta.columns));
  shape.block_x = static_cast<unsigned>(cta.columns);
  shape.block_y = static_cast<unsigned>(cta.lanes);
  shape.programmatic = programmatic;
  // One wave, counted at half an SM's threads a CTA may hold (2048 on sm_80..sm_100): the
  // reduction's CTAs need few registers and little shared memory.
  const std::int64_t per_sm = std::max(1, 1024 / (cta.columns * cta.lanes));
  reduce.dependents_first = shape.grid_x <= static_cast<std::int64_t>(sm_count) * per_sm ? 1 : 0;
  launch::launch(d, kernel, shape, reduce, stream, "grad_ape reduction launch");
}

}  // namespace csa::compressor::detail
