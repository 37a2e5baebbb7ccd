#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "commands.hpp"

namespace csa::tools {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CLI::ValidationError("FILE", fmt::format("{}: cannot be read", path));
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

const char* grad_ape_text(const ScheduleChoice& c) {
  if (!c.grad_ape_atomic) return "fixed order, bitwise run to run";
  if (c.grad_ape_atomic_needs_claim_words)
    return "fp32 atomics in one launch; the fixed order when deterministic, and under graph "
           "capture where a CTA has less than cap rows x window slots or no claim words are left";
  return "fp32 atomics; the fixed order when deterministic";
}

nlohmann::json or_null(const std::string& text) {
  return text.empty() ? nlohmann::json(nullptr) : nlohmann::json(text);
}

nlohmann::json choice_json(const ScheduleChoice& c, const std::string& direction) {
  nlohmann::json j = {{"direction", direction},
                      {"family", family_name(c.family)},
                      {"schedule", c.schedule},
                      {"contract", c.contract}};
  if (c.entry >= 0) {
    j["table"] = {{"arch", c.table_arch},
                  {"source", c.table_source},
                  {"entry", c.entry},
                  {"bucket", c.bucket},
                  {"rows_min", c.rows_min},
                  {"rows_max", c.rows_max},
                  {"dtype", or_null(c.entry_dtype)},
                  {"layout", or_null(c.entry_layout)},
                  {"tail", or_null(c.entry_tail)}};
  } else {
    j["table"] = nullptr;
  }
  if (direction == "bwd") j["grad_ape"] = grad_ape_text(c);
  return j;
}

}  // namespace

void add_schedule_command(CLI::App& app, Runtime*& runtime) {
  auto* cmd = app.add_subcommand("schedule", "show, select from or validate schedule tables");
  cmd->require_subcommand(1);

  auto* show = cmd->add_subcommand(
      "show",
      "print the schedule table serving an arch as JSON (without --arch: every table, "
      "by arch)");
  auto show_arch = std::make_shared<std::string>();
  show->add_option("--arch", *show_arch, "an arch such as sm_90 (default: every table)");
  show->callback([&runtime, show_arch] {
    if (!show_arch->empty()) {
      const std::string arch = resolve_arch(*runtime, *show_arch, "--arch");
      print_json(nlohmann::json::parse(runtime->schedule_table_json(arch)));
      return;
    }
    nlohmann::json all = nlohmann::json::object();
    for (const auto& arch : runtime->schedule_table_archs())
      all[arch] = nlohmann::json::parse(runtime->schedule_table_json(arch));
    print_json(all);
  });

  auto* select = cmd->add_subcommand(
      "select",
      "the family, table bucket, schedule and numerics contract a call gets (the "
      "runtime's own selection, CSA_SHORT_WINDOW_SCHEDULE and CSA_SCHEDULE_FILE "
      "included)");
  struct SelectOptions {
    Config config;
    std::int64_t rows = 0;
    std::string arch;
    std::vector<std::string> directions;
    bool json = false;
  };
  auto so = std::make_shared<SelectOptions>();
  add_config_options(select, so->config);
  add_io_options(select, so->config.dtype, so->config.layout);
  add_tail_options(select, so->config.tail);
  select->add_flag("--strided", so->config.strided,
                   "a THD call with row strides (kv, score or a gradient not dense)");
  select->add_option("--rows", so->rows, "output rows of the call (total_comp)")
      ->required()
      ->check(CLI::NonNegativeNumber);
  select->add_option("--arch", so->arch, "an arch such as sm_90 (default: device 0's)");
  add_direction_option(select, so->directions, kDirections);
  select->add_flag("--json", so->json, "print one JSON object instead of text");
  select->callback([&runtime, so] {
    const Config& c = so->config;
    const std::string arch = resolve_arch(*runtime, so->arch, "--arch");
    nlohmann::json out = {{"config", to_json(c)},
                          {"rows", so->rows},
                          {"arch", arch},
                          {"choices", nlohmann::json::array()}};
    for (const auto& [d, name] :
         {std::pair{Direction::kForward, "fwd"}, std::pair{Direction::kBackward, "bwd"}}) {
      if (!wants(so->directions, name)) continue;
      const ScheduleChoice choice = runtime->select_schedule(c, d, so->rows, arch);
      out["choices"].push_back(choice_json(choice, name));
      if (so->json) continue;
      std::string where = "built-in rule";
      if (choice.entry >= 0) {
        std::string keys;
        if (!choice.entry_dtype.empty()) keys += " " + choice.entry_dtype;
        if (!choice.entry_layout.empty()) keys += " " + choice.entry_layout;
        if (!choice.entry_tail.empty()) keys += " tail=" + choice.entry_tail;
        where = fmt::format(
            "{} entries[{}].buckets[{}]{}, rows {}..{}", choice.table_source, choice.entry,
            choice.bucket, keys.empty() ? "" : " (the" + keys + " entry)", choice.rows_min,
            choice.rows_max < 0 ? std::string("inf") : std::to_string(choice.rows_max));
      }
      fmt::print("{} {} {} rows={} on {}: {}\n  {} ({} contract{}{})\n", name,
                 family_name(choice.family), format_config(c), so->rows, arch, where,
                 choice.schedule, choice.contract, d == Direction::kBackward ? "; grad_ape: " : "",
                 d == Direction::kBackward ? grad_ape_text(choice) : "");
    }
    if (so->json) print_json(out);
  });

  auto* validate = cmd->add_subcommand("validate", "check a schedule table file");
  auto file = std::make_shared<std::string>();
  validate->add_option("FILE", *file, "a JSON schedule table")->required();
  validate->callback([file] {
    validate_schedule_table(read_file(*file), *file);
    fmt::print("{}: valid\n", *file);
  });
}

}  // namespace csa::tools
