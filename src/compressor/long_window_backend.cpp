// The long-window family's backend: preparing every bucket kernel of a configuration, and
// the forward and backward launches.
#include <algorithm>
#include <optional>

#include "common/error.hpp"
#include "compressor/grad_ape_policy.hpp"
#include "compressor/launch_helpers.hpp"
#include "compressor/service.hpp"
#include "launch/launch.hpp"

namespace csa::compressor {

using detail::BackwardWorkspace;
using detail::device_ptr;
using detail::fill_gradients;
using detail::fill_inputs;
using detail::fill_output;
using detail::launch_ape_reduce;
using detail::launch_rows;
using detail::StreamScratch;

ModuleSpec Service::long_window_spec(const Config& config, int kernel_layout,
                                     const std::string& arch, const schedule::ScheduleSet& set,
                                     std::vector<schedule::LongWindowSchedule>* forward,
                                     std::vector<schedule::LongWindowSchedule>* backward) const {
  *forward = set.kernels(config, Direction::kForward, arch);
  *backward = set.kernels(config, Direction::kBackward, arch);
  return make_long_window_spec(config, kernel_layout, *forward, *backward, arch, compile_options_);
}

void Service::prepare_long_window(Prepared& p, const schedule::ScheduleSet& set,
                                  const ModuleSpec& spec) {
  driver::Driver& d = loader_.get();
  CUdevice dev = 0;
  d.check(d.api().cuDeviceGet(&dev, p.device.ordinal), "cuDeviceGet");
  auto buckets_of = [&](Direction direction) {
    auto slot_of = [&](const schedule::LongWindowSchedule& s) {
      const int slot = long_window_slot(spec, p.config, p.kernel_layout, s, direction);
      if (slot < 0)
        fail(Status::kInternal, "{}: no kernel compiled for schedule {}", config_label(p.config),
             s.describe());
      return slot;
    };
    // The kernel's dynamic shared memory limit; its CTAs per SM.
    auto configure = [&](int slot, int shared_bytes, int threads) {
      const CUkernel kernel = p.kernel(slot);
      // NOTE: attributes are set here, never on the launch path (not capture-safe to change).
      if (shared_bytes > 0) {
        d.check(d.api().cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             shared_bytes, kernel, dev),
                fmt::format("cuKernelSetAttribute(max dynamic shared memory {} B) for {}",
                            shared_bytes, config_label(p.config))
                    .c_str());
      }
      int regs = 0;
      int static_shared = 0;
      d.check(d.api().cuKernelGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, kernel, dev),
              "cuKernelGetAttribute(registers)");
      d.check(d.api().cuKernelGetAttribute(&static_shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                           kernel, dev),
              "cuKernelGetAttribute(shared memory)");
      return schedule::resident_ctas(p.device.sm, threads, regs, shared_bytes + static_shared);
    };
    std::vector<PreparedBucket> out;
    std::int64_t rows = 0;
    for (;;) {
      const schedule::Selection sel = set.select(p.config, direction, rows, p.device.arch);
      PreparedBucket b;
      b.max_rows = sel.rows_max;
      b.schedule = sel.schedule;
      b.slot = slot_of(sel.schedule);
      b.shared_bytes = schedule::long_window_shared_bytes(p.config, b.schedule);
      b.resident_ctas = configure(b.slot, b.shared_bytes, b.schedule.threads);
      b.fixed_slot = b.slot;
      b.fixed_resident_ctas = b.resident_ctas;
      if (b.schedule.atomic_ape) {
        b.fixed_slot = slot_of(b.schedule.fixed_order_twin());
        b.fixed_resident_ctas = configure(b.fixed_slot, b.shared_bytes, b.schedule.threads);
      }
      out.push_back(b);
      if (sel.rows_max < 0) break;
      rows = sel.rows_max + 1;
    }
    return out;
  };
  p.long_forward = buckets_of(Direction::kForward);
  p.long_backward = buckets_of(Direction::kBackward);
}

namespace {

// Staged form: a 1-D block and dynamic shared memory; lanes form: (column lanes, window lanes)
// and, for a backward with stages > 1, dynamic shared memory for its ring.
// Both wait for the stream's previous kernel in pdl_enter() when launched programmatically.
void set_block(launch::LaunchShape& shape, const PreparedBucket& b, bool programmatic) {
  shape.programmatic = programmatic;
  if (b.schedule.staged) {
    shape.block_x = static_cast<unsigned>(b.schedule.threads);
    shape.shared_bytes = static_cast<unsigned>(b.shared_bytes);
  } else {
    shape.block_x = static_cast<unsigned>(b.schedule.cols / b.schedule.vec);
    shape.block_y = static_cast<unsigned>(b.schedule.window_lanes());
    shape.shared_bytes = static_cast<unsigned>(b.shared_bytes);  // the backward's ring
  }
}

const PreparedBucket& bucket_for(const std::vector<PreparedBucket>& buckets, std::int64_t rows) {
  for (const auto& b : buckets)
    if (b.max_rows < 0 || rows <= b.max_rows) return b;
  return buckets.back();
}

}  // namespace

void Service::forward_long(const Prepared& p, const ForwardArgs& a, CUstream stream) {
  const PreparedBucket& b = bucket_for(p.long_forward, a.total_comp);
  csa_kernel::ForwardParams params{};
  fill_inputs(params, a);
  fill_output(params, a);
  launch::LaunchShape shape;
  // One flat dimension, column slices fastest (kernels' ForwardTile).
  // NOTE: total_comp * slices < 2^31: validation keeps total_comp * head_dim below it.
  const std::int64_t slices = b.schedule.column_slices(a.config.head_dim);
  shape.grid_x = static_cast<unsigned>(a.total_comp * slices);
  params.prefetch_early =
      schedule::forward_prefetches_early(shape.grid_x, p.device.sm_count, b.resident_ctas) ? 1 : 0;
  set_block(shape, b, p.programmatic);
  // The tail (kernels/long_window_tail.cuh): the pooled rows (the caller's, else scratch) and,
  // with more than one column slice, one zeroed arrival word per row; in the row-kernel form
  // (kernels/tail_rows_forward.cuh) no words: a second kernel runs the rows' tail; in the
  // cluster form neither: a row's slices are one cluster, and the pooled rows only the caller's.
  std::optional<StreamScratch> graph_pooled, graph_words;  // under capture: the graph's memory
  const bool row_kernel = b.schedule.row_kernel() && a.total_comp > 0;
  if (a.config.tail.any() && b.schedule.cluster()) {
    shape.cluster_x = static_cast<unsigned>(slices);
    params.pooled = a.pooled;
  } else if (a.config.tail.any() && a.total_comp > 0) {
    driver::Driver& d = driver();
    const bool capturing = launch::is_capturing(d, stream);
    if (a.pooled != nullptr) {
      params.pooled = a.pooled;
    } else {
      const std::size_t bytes =
          static_cast<std::size_t>(a.total_comp) * a.config.head_dim * sizeof(float);
      params.pooled = device_ptr<float>(call_workspace(stream, capturing, bytes, graph_pooled));
    }
    if (slices > 1 && !row_kernel) {
      // One claim word a row (its arrivals in the low bits, as grad_ape's claims keep them).
      CUdeviceptr words = scratch_.claim_words(a.total_comp, capturing, stream);
      if (words == 0) {  // captured with none left: the graph's own, zeroed in the graph
        const std::size_t bytes = static_cast<std::size_t>(a.total_comp) * 8;
        words = graph_words.emplace(d, bytes, stream).get();
        d.check(d.api().cuMemsetD32Async(words, 0, bytes / 4, stream),
                "cuMemsetD32Async (the tail's arrival words)");
      }
      params.row_arrivals = device_ptr<unsigned long long>(words);
    }
  }
  launch::launch(driver(), p.kernel(b.slot), shape, params, stream, "long-window forward launch");
  if (!row_kernel) return;
  const int vec = csa_kernel::tail_rows_vec(a.config.head_dim, kTailRowsThreads);
  launch_rows(driver(), p.kernel(p.slots.long_window.rows_forward), params, a.total_comp,
              kTailRowsThreads / (a.config.head_dim / vec), kTailRowsThreads, p.programmatic,
              stream, "tail rows launch");
}

void Service::backward_long(const Prepared& p, const BackwardArgs& a, CUstream stream) {
  driver::Driver& d = driver();
  const Config& c = a.config;
  const std::int64_t ape_elems = static_cast<std::int64_t>(c.ratio) * c.coff * c.head_dim;
  const PreparedBucket& b = bucket_for(p.long_backward, a.total_comp);
  const bool atomic = long_window_atomic(b.schedule, (a.flags & kDeterministic) != 0);
  const bool capturing = launch::is_capturing(d, stream);
  const auto grid =
      schedule::long_window_backward_grid(c, b.schedule, a.total_comp, p.device.sm_count,
                                          atomic ? b.resident_ctas : b.fixed_resident_ctas);
  if (c.tail.norm && a.pooled == nullptr) {
    fail(Status::kInvalidArgument,
         "pooled is null but {} runs its tail's backward in the long-window family, which reads "
         "the pooled rows its forward wrote (ForwardArgs::pooled)",
         config_label(c));
  }
  csa_kernel::BackwardParams params{};
  fill_inputs(params, a);
  fill_gradients(params, a);
  params.pooled = a.pooled;
  params.rows_per_cta = grid.rows_per_cta;
  launch::LaunchShape shape;
  shape.grid_x = static_cast<unsigned>(grid.row_groups);
  shape.grid_y = static_cast<unsigned>(grid.column_slices);
  set_block(shape, b, p.programmatic);
  const bool row_stats = b.schedule.row_stats && a.total_comp > 0;
  const BackwardWorkspace layout(c, ape_elems, atomic ? 0 : grid.row_groups,
                                 row_stats ? a.total_comp : 0);
  std::optional<StreamScratch> graph_scratch;  // under capture: memory owned by the graph
  const CUdeviceptr workspace =
      layout.bytes() > 0 ? call_workspace(stream, capturing, layout.bytes(), graph_scratch) : 0;
  if (row_stats) {
    // The tail's row-stats form (kernels/tail_row_stats.cuh): each row's norm scalars first.
    params.row_stats = device_ptr<float>(workspace) + layout.partial_floats;
    launch_rows(d, p.kernel(p.slots.long_window.row_stats), params, a.total_comp,
                kRowStatsThreads / 32, kRowStatsThreads, p.programmatic, stream,
                "row-stats launch");
  }
  if (atomic) {  // one launch adding into grad_ape; the claim words are per column slice (y)
    // Claim words: the stream's, or under capture the call's own; without any left (captured
    // calls only), a memset of grad_ape goes first (prepare_atomic_grad_ape).
    const CUdeviceptr words = (a.flags & kAccumulateGradApe) != 0
                                  ? 0
                                  : scratch_.claim_words(grid.column_slices, capturing, stream);
    prepare_atomic_grad_ape(params, a, ape_elems, words, stream);
    launch::launch(d, p.kernel(b.slot), shape, params, stream, "long-window backward launch");
    return;
  }
  params.workspace = device_ptr<float>(workspace);
  launch::launch(d, p.kernel(b.fixed_slot), shape, params, stream, "long-window backward launch");
  // The fewest lanes of the 16-byte reduction that leave each at most 8 groups (256-thread
  // CTAs); the scalar one where none does.
  std::size_t i = 0;
  while (i < kApeReduceQuadLanes.size() && grid.row_groups > 8 * kApeReduceQuadLanes[i]) ++i;
  const LongWindowSlots& slots = p.slots.long_window;
  if (i == kApeReduceQuadLanes.size() || slots.ape_reduce_quads[i] < 0) {
    launch_ape_reduce(d, p.kernel(slots.ape_reduce), params.workspace, a, ape_elems,
                      grid.row_groups, {32, kApeReduceLanes, 1}, p.device.sm_count, p.programmatic,
                      stream, layout.grad_w_elements);
    return;
  }
  const int lanes = kApeReduceQuadLanes[i];
  launch_ape_reduce(d, p.kernel(slots.ape_reduce_quads[i]), params.workspace, a, ape_elems,
                    grid.row_groups, {256 / lanes, lanes, 4}, p.device.sm_count, p.programmatic,
                    stream);
}

}  // namespace csa::compressor
