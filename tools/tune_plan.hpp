// `csa tune` planning, free of any GPU: the candidate schedules of one configuration, the
// choice per measured row count (fastest, or the bitwise one when within 10 %), the buckets
// those choices make, and the schedule-table JSON they become.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "csa/csa.hpp"

namespace csa::tools {

// NOTE: nlohmann::json members make the implicit special members potentially throwing;
// candidates are built once, outside any noexcept path.
struct Candidate {        // NOLINT(bugprone-exception-escape)
  std::string name;       // "lanes-chunked-fast v2 c32 t256"
  nlohmann::json bucket;  // the bucket's schedule fields (no max_rows)
  bool bitwise = false;   // serial order, exact exp
};

std::vector<Candidate> tune_candidates(const Config& config, Direction direction);

// The candidates as the loader runs them: each one's fields (and name) replaced by its fitted
// schedule `fitted[i]` ("vec=1 cols=32 threads=512 ... stages=1", as Runtime::select_schedule
// prints it), then the repeats dropped. A ring the loader drops, or threads it raises, is
// neither measured twice nor written into the table under a name that does not run.
std::vector<Candidate> as_fitted(const std::vector<Candidate>& candidates,
                                 const std::vector<std::string>& fitted, Direction direction);

struct Measurement {
  std::int64_t rows = 0;
  std::vector<double> micros;  // per candidate; negative: failed its correctness check
};

// Index of the chosen candidate per measurement: the fastest, unless a bitwise candidate is
// within `bitwise_margin` (1.10: 10 %) of it; -1 when every candidate failed.
std::vector<int> choose(const std::vector<Candidate>& candidates,
                        const std::vector<Measurement>& measurements, double bitwise_margin);

// Buckets from the choices (measurements sorted by rows): neighbours with the same choice
// merge; a boundary between measured row counts a and b sits at floor(sqrt(a * b)).
nlohmann::json make_buckets(const std::vector<Candidate>& candidates,
                            const std::vector<Measurement>& measurements,
                            const std::vector<int>& chosen);

// Forward outputs of fewer than kBitwiseOutputElements elements keep the bitwise order: there
// the tolerance rule allows fewer than 16 differing values, and a reordered kernel flips about
// 0.02 % of them at random (measured by `csa tune`), so some inputs would break the contract.
inline constexpr std::int64_t kBitwiseOutputElements = 16384;

// The largest row count whose forward output stays under kBitwiseOutputElements.
std::int64_t bitwise_row_limit(const Config& config);

// Buckets for the rows up to `max_rows` from the fastest bitwise candidate at each measured
// row count up to it (at least the smallest measured count), the last one ending at
// `max_rows`; empty when no bitwise candidate passed.
nlohmann::json bitwise_buckets(const std::vector<Candidate>& candidates,
                               const std::vector<Measurement>& measurements, std::int64_t max_rows);

// `bitwise` (buckets ending at `max_rows`) followed by the buckets of `buckets` beyond it; the
// buckets it covers entirely are dropped.
nlohmann::json with_bitwise_small_rows(const nlohmann::json& buckets, const nlohmann::json& bitwise,
                                       std::int64_t max_rows);

// A table entry for exactly this configuration, keyed on its element type and layout unless
// they are bf16 THD, and on its tail if it has one.
nlohmann::json make_entry(const Config& config, Direction direction, nlohmann::json buckets);

// `base` (a schedule table) with `entries` (measured on `measured`'s dtype and layout) put
// first; an entry of `base` for the same (direction, coff, head_dim, ratio) ranges and tail is
// dropped where it also serves the measured dtype and layout with at least as many dtype /
// layout keys, since it would outrank the tuned entry there (a shipped tail entry keyed bf16
// THD against a bf16 THD measurement, which is unkeyed).
nlohmann::json merge_entries(nlohmann::json base, const std::vector<nlohmann::json>& entries,
                             const Config& measured, const std::string& origin);

}  // namespace csa::tools
