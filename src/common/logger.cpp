#include "common/logger.hpp"

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <array>

namespace csa {

namespace {

// spdlog's from_str() turns any unknown name into "off", which would hide every warning.
std::optional<spdlog::level::level_enum> level_of(const std::string& name) {
  static constexpr std::array<std::pair<const char*, spdlog::level::level_enum>, 9> kLevels{{
      {"trace", spdlog::level::trace},
      {"debug", spdlog::level::debug},
      {"info", spdlog::level::info},
      {"warn", spdlog::level::warn},
      {"warning", spdlog::level::warn},
      {"error", spdlog::level::err},
      {"err", spdlog::level::err},
      {"critical", spdlog::level::critical},
      {"off", spdlog::level::off},
  }};
  for (const auto& [text, level] : kLevels)
    if (name == text) return level;
  return std::nullopt;
}

}  // namespace

std::shared_ptr<Logger> make_logger(const std::string& level) {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<Logger>("csa", sink);
  logger->set_pattern("[csa %l] %v");
  const auto parsed = level.empty() ? std::optional(spdlog::level::warn) : level_of(level);
  logger->set_level(parsed.value_or(spdlog::level::warn));
  if (!parsed) {
    logger->warn(
        "log level '{}' is unknown (trace, debug, info, warn, error, critical, off); keeping "
        "warn",
        level);
  }
  return logger;
}

}  // namespace csa
