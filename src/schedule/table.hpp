// The JSON schedule table of the long-window family (schedules/*.json): typed structs, a
// strict loader whose errors name the source, the entry and the field, and the one selection
// function that calls, prewarm and `csa schedule select` share.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "csa/csa.hpp"
#include "schedule/long_window.hpp"

namespace csa::schedule {

inline constexpr int kScheduleSchemaVersion = 1;

struct Bucket {
  std::int64_t max_rows = -1;  // inclusive upper bound on output rows; -1: unbounded
  LongWindowSchedule schedule;
};

struct TableEntry {
  Direction direction = Direction::kForward;
  int coff = 1;
  int head_dim_min = 1, head_dim_max = 4096;
  int ratio_min = 1, ratio_max = 256;
  // Element type and layout the entry was measured for; absent: it serves every one. A call
  // takes the matching entry that names the most of them (the first of those).
  std::optional<DType> dtype;
  std::optional<Layout> layout;
  // The fused tail the entry was measured for (csa::tail_name: "norm+rope64"), or kAnyTail:
  // every call with a tail; absent: every call, with a tail or not. A call with a tail takes
  // an entry naming its tail over one naming "any", over one naming none.
  std::optional<std::string> tail;
  static constexpr const char* kAnyTail = "any";
  std::vector<Bucket> buckets;  // ascending max_rows, the last unbounded
  bool matches(const Config& c, Direction d) const;
  int specificity() const {
    const int tail_rank = !tail ? 0 : *tail == kAnyTail ? 4 : 8;
    return tail_rank + (dtype ? 1 : 0) + (layout ? 1 : 0);
  }
};

// Ratios from `long_window_min_ratio` up use the long-window family (below: short-window).
struct RoutingRule {
  int coff = 1;
  int head_dim_min = 1, head_dim_max = 4096;
  int long_window_min_ratio = 17;
};

struct ScheduleTable {
  std::string arch;    // "sm_90"
  std::string origin;  // free text: how the table was made
  std::string source;  // where it was loaded from (not serialised)
  std::vector<RoutingRule> routing;
  std::vector<TableEntry> entries;
};

// Throws Error(kInvalidArgument): "<source>: entries[2].buckets[0].vec: must be 1, 2, 4 or 8".
ScheduleTable parse_schedule_table(std::string_view json_text, const std::string& source);
std::string to_json(const ScheduleTable& table);

struct Selection {
  Family family = Family::kLongWindow;
  std::string table_arch;  // the table used ("" when the built-in default rule applied)
  int entry = -1;          // index into the table's entries, -1: built-in default
  int bucket = -1;
  std::int64_t rows_min = 0, rows_max = -1;  // the bucket's row range (-1: unbounded)
  LongWindowSchedule schedule;               // fitted to the configuration and arch
};

// All tables by arch: the embedded ones, then overrides ($CSA_SCHEDULE_FILE, the API).
class ScheduleSet {
 public:
  static ScheduleSet embedded();
  void add(ScheduleTable table);  // replaces the table of the same arch
  // The table serving `arch`: its own, else the newest older arch, else the oldest one.
  const ScheduleTable* table_for(const std::string& arch) const;
  const std::map<int, ScheduleTable>& tables() const { return tables_; }

  Family route(const Config& config, const std::string& arch) const;
  Selection select(const Config& config, Direction direction, std::int64_t rows,
                   const std::string& arch) const;
  // Every distinct kernel of the buckets serving (config, direction, arch), bucket order; an
  // atomic grad_ape bucket's fixed-order twin follows it.
  std::vector<LongWindowSchedule> kernels(const Config& config, Direction direction,
                                          const std::string& arch) const;

 private:
  std::map<int, ScheduleTable> tables_;  // by compute capability (90 for sm_90)
};

// The built-in rule where no table entry matches.
LongWindowSchedule default_long_window(const Config& config, Direction direction);

}  // namespace csa::schedule
