// `csa tune`'s correctness gate: how one row count's candidates are called and checked before
// they are timed. Plain calls are checked against the reference kernels; calls with a fused
// tail (which the reference kernels do not run) against the CPU fp32 chain reference. Each
// check allows half of the element type's contract (a reordered candidate must stay well
// inside it so that other inputs of the same bucket do too); serial-order candidates must give
// the reference's bits (plain) or one another's (tail).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "bench_data.hpp"
#include "csa/csa.hpp"

namespace csa::tools {

inline constexpr double kTuningMargin = 0.5;

struct CheckResult {
  std::string failure;        // "" when it holds
  std::size_t differing = 0;  // elements differing from the reference (the largest tensor)
};

class TuneCheck {
 public:
  virtual ~TuneCheck() = default;
  // The call over input set `s` of `inputs` (each set has its own tail outputs).
  virtual ForwardArgs forward(const DeviceInputs& inputs, int s) const = 0;
  virtual BackwardArgs backward(const DeviceInputs& inputs, int s) const = 0;
  // Before a direction's candidates run: its references, and for a tail's backward the
  // forward's pooled rows of every set (`set(i)` for i < sets, by `rt`'s own schedule).
  virtual void prepare(Direction direction, const std::function<const DeviceInputs&(int)>& set) = 0;
  // Poisons the outputs of the first set, runs `call` on it and checks what it wrote.
  virtual CheckResult run_and_check(Direction direction, bool bitwise,
                                    const std::function<void()>& call) = 0;
};

// The check of one row count's inputs `p` (sets: how many input sets the timing rotates).
std::unique_ptr<TuneCheck> make_tune_check(Runtime& rt, Stream stream, DeviceInputs& p, int sets,
                                           std::uint64_t seed);

// Bytes a call moves besides forward_bytes / backward_bytes: the fp32 pooled rows a
// long-window tail's forward writes and its backward reads.
std::int64_t tail_extra_bytes(const Config& config, std::int64_t total_comp, Direction direction);

}  // namespace csa::tools
