#include "compressor/grad_ape_policy.hpp"

namespace csa::compressor {

bool short_window_fixed_order(const schedule::ShortWindowSchedule& s, bool deterministic,
                              bool capturing, std::int64_t rows_per_cta, int window_slots) {
  return deterministic ||
         (s.fixed_order_default && (!s.one_launch || (capturing && rows_per_cta * window_slots <
                                                                       s.captured_one_launch_min)));
}

GradApeForm short_window_grad_ape(const schedule::ShortWindowSchedule& s) {
  GradApeForm f;
  f.atomic = !short_window_fixed_order(s, false, false, 0, 0);
  f.needs_claim_words = f.atomic && s.fixed_order_default;
  return f;
}

bool long_window_atomic(const schedule::LongWindowSchedule& s, bool deterministic) {
  return s.atomic_ape && !deterministic;
}

}  // namespace csa::compressor
