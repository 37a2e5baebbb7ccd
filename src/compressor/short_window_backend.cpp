// The short-window and reference families' launches (the long-window family's are in
// long_window_backend.cpp): one forward kernel; the backward in one launch adding grad_ape
// atomically, or the fixed order's two (gradients with per-row-group partials, then their
// reduction), as grad_ape_policy decides.
#include <optional>

#include "common/error.hpp"
#include "compressor/grad_ape_policy.hpp"
#include "compressor/launch_helpers.hpp"
#include "compressor/service.hpp"
#include "csa_params.h"
#include "launch/launch.hpp"

namespace csa::compressor {

using detail::BackwardWorkspace;
using detail::blocks_for;
using detail::device_ptr;
using detail::fill_gradients;
using detail::fill_inputs;
using detail::fill_output;
using detail::launch_ape_reduce;
using detail::launch_rows;
using detail::StreamScratch;

namespace {

constexpr unsigned kReferenceThreads = 256;

}  // namespace

void Service::launch_forward(const Prepared& p, const ForwardArgs& a, CUstream stream) {
  if (p.family == Family::kLongWindow) {
    forward_long(p, a, stream);
    return;
  }
  csa_kernel::ForwardParams params{};
  fill_inputs(params, a);
  fill_output(params, a);
  launch::LaunchShape shape;
  if (p.family == Family::kReference) {
    shape.grid_x = blocks_for(a.total_comp * a.config.head_dim, kReferenceThreads);
    shape.block_x = kReferenceThreads;
    launch::launch(driver(), p.kernel(p.slots.reference.forward), shape, params, stream,
                   "reference forward launch");
    return;
  }
  const auto choice = schedule::forward_choice(p.schedule, a.config, a.total_comp);
  const int ncv = a.config.head_dim / choice.vec;
  shape.block_x = static_cast<unsigned>(choice.threads);
  shape.programmatic = p.programmatic;
  shape.grid_x = blocks_for(a.total_comp * ncv, shape.block_x);
  params.pooled = a.pooled;  // a tail's pooled rows, for the backward's row-stats form
  const int slot = choice.wide ? p.slots.short_window.forward_wide : p.slots.short_window.forward;
  launch::launch(driver(), p.kernel(slot), shape, params, stream, "forward launch");
}

void Service::launch_backward(const Prepared& p, const BackwardArgs& a, CUstream stream) {
  if (p.family == Family::kLongWindow) {
    backward_long(p, a, stream);
    return;
  }
  driver::Driver& d = driver();
  const Config& c = a.config;
  const std::int64_t width = static_cast<std::int64_t>(c.coff) * c.head_dim;
  const std::int64_t ape_elems = c.ratio * width;
  const bool accumulate = (a.flags & kAccumulateGradApe) != 0;

  csa_kernel::BackwardParams params{};
  fill_inputs(params, a);
  fill_gradients(params, a);
  params.accumulate = accumulate ? 1 : 0;

  if (p.family == Family::kReference) {
    launch::LaunchShape shape;
    shape.block_x = kReferenceThreads;
    if (a.total_tokens > 0) {
      shape.grid_x = blocks_for(a.total_tokens * width, kReferenceThreads);
      launch::launch(d, p.kernel(p.slots.reference.backward_zeros), shape, params, stream,
                     "reference backward zeros launch");
    }
    if (a.total_comp > 0) {
      shape.grid_x = blocks_for(a.total_comp * c.head_dim, kReferenceThreads);
      launch::launch(d, p.kernel(p.slots.reference.backward_rows), shape, params, stream,
                     "reference backward launch");
    }
    shape.grid_x = blocks_for(ape_elems, kReferenceThreads);
    launch::launch(d, p.kernel(p.slots.reference.grad_ape), shape, params, stream,
                   "reference grad_ape launch");
    return;
  }

  // The tail's row-stats form where the caller passes the pooled rows (kernels/
  // tail_row_stats.cuh): its first kernel, then the backward on the plain block shape.
  const ShortWindowSlots& slots = p.slots.short_window;
  const bool row_stats = a.pooled != nullptr;
  if (row_stats && slots.row_stats < 0) {
    fail(Status::kInvalidArgument,
         "pooled is set but {} has no row-stats backward in the short-window family (it needs "
         "the norm and no Hadamard transform): pass pooled = null",
         config_label(c));
  }
  const schedule::ShortWindowSchedule s =
      row_stats ? schedule::row_stats_backward(p.schedule) : p.schedule;
  struct Kernels {
    int fixed, atomic, fixed_resident, atomic_resident, ape_reduce;
  };
  const Kernels k =
      row_stats
          ? Kernels{slots.backward_row_stats_fixed, slots.backward_row_stats_atomic, -1, -1,
                    slots.row_stats_ape_reduce}
          : Kernels{slots.backward_fixed, slots.backward_atomic, slots.backward_fixed_resident,
                    slots.backward_atomic_resident, slots.ape_reduce};
  // Large calls take the resident kernel where the module has one (a tail's module: in the
  // grad_ape forms it holds).
  const bool resident =
      k.fixed_resident >= 0 && schedule::backward_takes_resident(s, c, a.total_comp);
  const int ctas_per_sm = row_stats  ? p.row_stats_backward_ctas_per_sm
                          : resident ? p.resident_backward_ctas_per_sm
                                     : p.backward_ctas_per_sm;
  const auto grid = schedule::backward_grid(s, c, a.total_comp, p.device.sm_count, ctas_per_sm);
  params.rows_per_cta = grid.rows_per_cta;
  launch::LaunchShape shape;
  shape.grid_x = static_cast<unsigned>(grid.grid_x);
  shape.grid_y = static_cast<unsigned>(grid.grid_y);
  shape.block_x = static_cast<unsigned>(s.backward_tx);
  shape.block_y = static_cast<unsigned>(s.backward_ty);
  shape.programmatic = p.programmatic;
  const bool deterministic = (a.flags & kDeterministic) != 0;
  const bool capturing = launch::is_capturing(d, stream);
  // One launch instead of two (one_launch): the atomic form, which zeroes grad_ape itself
  // through claim words; captured, where claim words are left (and a CTA has at least
  // captured_one_launch_min rows x slots of work: 0, always, by default).
  bool fixed_order =
      short_window_fixed_order(s, deterministic, capturing, grid.rows_per_cta, c.ratio * c.coff);
  CUdeviceptr words = 0;
  if (!fixed_order) {
    // The claim words are per column block (x).
    words = accumulate ? 0 : scratch_.claim_words(grid.grid_x, capturing, stream);
    fixed_order = words == 0 && !accumulate && s.fixed_order_default;
  }
  const BackwardWorkspace layout(c, ape_elems, fixed_order ? grid.grid_y : 0,
                                 row_stats ? a.total_comp : 0);
  std::optional<StreamScratch> graph_scratch;  // under capture: memory owned by the graph
  const CUdeviceptr workspace =
      layout.bytes() > 0 ? call_workspace(stream, capturing, layout.bytes(), graph_scratch) : 0;
  if (row_stats) {
    params.pooled = a.pooled;
    params.row_stats = device_ptr<float>(workspace) + layout.partial_floats;
    launch_rows(d, p.kernel(slots.row_stats), params, a.total_comp, kRowStatsThreads / 32,
                kRowStatsThreads, p.programmatic, stream, "row-stats launch");
  }
  if (!fixed_order) {
    prepare_atomic_grad_ape(params, a, ape_elems, words, stream);
    launch::launch(d, p.kernel(resident ? k.atomic_resident : k.atomic), shape, params, stream,
                   "backward launch");
    return;
  }
  params.workspace = device_ptr<float>(workspace);
  launch::launch(d, p.kernel(resident ? k.fixed_resident : k.fixed), shape, params, stream,
                 "backward launch");
  launch_ape_reduce(d, p.kernel(k.ape_reduce), params.workspace, a, ape_elems, grid.grid_y,
                    {32, s.reduce_lanes, 1}, p.device.sm_count, p.programmatic, stream,
                    layout.grad_w_elements);
}

}  // namespace csa::compressor
