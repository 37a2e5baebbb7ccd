// How a backward sums grad_ape — fp32 atomics in the gradient kernel (one launch) or the fixed
// order (per-row-group partials, then a reduction kernel) — decided in one place for the
// launch path and for `csa schedule select` (Runtime::select_schedule).
#pragma once

#include <cstdint>

#include "schedule/long_window.hpp"
#include "schedule/short_window.hpp"

namespace csa::compressor {

// Short-window: the fixed order when the call is deterministic, or when the schedule's
// default is the fixed order and it either takes no single launch or, captured, a CTA would
// hold fewer than captured_one_launch_min rows x window slots of work.
bool short_window_fixed_order(const schedule::ShortWindowSchedule& s, bool deterministic,
                              bool capturing, std::int64_t rows_per_cta, int window_slots);

// The form a default (not deterministic, not captured) call takes, as `select` reports it:
// atomic, and whether the atomic form needs the Runtime's claim words (without them a
// short-window fixed-order-default schedule falls back to the fixed order).
struct GradApeForm {
  bool atomic = false;
  bool needs_claim_words = false;
};
GradApeForm short_window_grad_ape(const schedule::ShortWindowSchedule& s);

// Long-window: the bucket's atomic kernel unless the call is deterministic.
bool long_window_atomic(const schedule::LongWindowSchedule& s, bool deterministic);

}  // namespace csa::compressor
