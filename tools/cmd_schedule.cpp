#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "commands.hpp"

namespace csa::tools {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot be read", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

const char* family_name(Family f) {
  switch (f) {
    case Family::kShortWindow:
      return "short_window";
    case Family::kLongWindow:
      return "long_window";
    case Family::kReference:
      return "reference";
    default:
      return "auto";
  }
}

// The device's arch when there is one, else sm_90.
std::string default_arch(Runtime& runtime) {
  const DriverInfo info = runtime.driver_info();
  if (info.available && !info.devices.empty())
    return fmt::format("sm_{}{}", info.devices[0].cc_major, info.devices[0].cc_minor);
  return "sm_90";
}

}  // namespace

void add_schedule_command(CLI::App& app, Runtime*& runtime) {
  auto* cmd = app.add_subcommand("schedule", "show, select from or validate schedule tables");
  cmd->require_subcommand(1);

  auto* show =
      cmd->add_subcommand("show", "print the schedule table serving an arch (all: every table)");
  auto show_arch = std::make_shared<std::string>();
  show->add_option("--arch", *show_arch, "arch such as sm_90 (default: every table)");
  show->callback([&runtime, show_arch] {
    const auto archs =
        show_arch->empty() ? runtime->schedule_table_archs() : std::vector<std::string>{*show_arch};
    for (const auto& arch : archs) {
      fmt::print("# table serving {}\n{}", arch, runtime->schedule_table_json(arch));
    }
  });

  auto* select = cmd->add_subcommand("select", "the family, bucket and schedule a call gets");
  struct SelectOptions {
    Config config;
    std::int64_t rows = 0;
    std::string arch;
    std::string direction = "both";
  };
  auto so = std::make_shared<SelectOptions>();
  select->add_option("--ratio", so->config.ratio)->required();
  select->add_option("--coff", so->config.coff)->required();
  select->add_option("--head-dim", so->config.head_dim)->required();
  select->add_option("--rows", so->rows, "output rows of the call (total_comp)")->required();
  select->add_option("--arch", so->arch, "arch such as sm_90 (default: device 0, else sm_90)");
  select->add_option("--direction", so->direction, "forward, backward or both")
      ->check(CLI::IsMember({"forward", "backward", "both"}));
  select->callback([&runtime, so] {
    const Config& config = so->config;
    const std::int64_t rows = so->rows;
    const std::string& arch = so->arch;
    const std::string& direction = so->direction;
    const std::string a = arch.empty() ? default_arch(*runtime) : arch;
    for (Direction d : {Direction::kForward, Direction::kBackward}) {
      const char* name = d == Direction::kForward ? "forward" : "backward";
      if (direction != "both" && direction != name) continue;
      const ScheduleChoice c = runtime->select_schedule(config, d, rows, a);
      std::string where = "built-in rule";
      if (c.entry >= 0) {
        where = fmt::format("{} entries[{}].buckets[{}], rows {}..{}", c.table_source, c.entry,
                            c.bucket, c.rows_min,
                            c.rows_max < 0 ? std::string("inf") : std::to_string(c.rows_max));
      }
      const char* ape =
          d == Direction::kForward ? ""
          : !c.grad_ape_atomic     ? "; grad_ape in a fixed order, bitwise run to run"
          : c.grad_ape_atomic_needs_claim_words
              ? "; grad_ape by fp32 atomics in one launch, in a fixed order when deterministic "
                "and under graph capture where a CTA has less than cap rows x window slots or "
                "no claim words are left"
              : "; grad_ape by fp32 atomics, fixed order when deterministic";
      fmt::print("{:<8} {} ratio={} coff={} head_dim={} rows={} on {}: {}\n  {} ({} contract{})\n",
                 name, family_name(c.family), config.ratio, config.coff, config.head_dim, rows, a,
                 where, c.schedule, c.contract, ape);
    }
  });

  auto* validate = cmd->add_subcommand("validate", "check a schedule table file");
  auto file = std::make_shared<std::string>();
  validate->add_option("file", *file, "JSON schedule table")->required();
  validate->callback([file] {
    validate_schedule_table(read_file(*file), *file);
    fmt::print("{}: valid\n", *file);
  });
}

}  // namespace csa::tools
