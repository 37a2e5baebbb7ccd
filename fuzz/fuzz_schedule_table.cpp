// libFuzzer: the schedule-table loader takes any bytes. It either returns a table or throws
// csa::Error (kInvalidArgument) naming the field; anything else (another exception, a crash,
// undefined behaviour under UBSan) is a finding. A table it accepts must survive its own
// serialisation unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "schedule/table.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  csa::schedule::ScheduleTable table;
  try {
    table = csa::schedule::parse_schedule_table(text, "fuzz.json");
  } catch (const csa::Error& e) {
    if (e.code() != csa::Status::kInvalidArgument) std::abort();
    return 0;
  }
  const std::string once = csa::schedule::to_json(table);
  const std::string twice =
      csa::schedule::to_json(csa::schedule::parse_schedule_table(once, "round trip"));
  if (once != twice) std::abort();
  // Selection over the accepted table never fails for a supported configuration.
  csa::schedule::ScheduleSet set;
  set.add(table);
  for (const csa::Config c : {csa::Config{128, 512, 1}, csa::Config{64, 65, 2}}) {
    for (const auto d : {csa::Direction::kForward, csa::Direction::kBackward}) {
      set.select(c, d, 37, table.arch);
      set.kernels(c, d, table.arch);
    }
  }
  return 0;
}
