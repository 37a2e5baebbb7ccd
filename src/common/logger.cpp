#include "common/logger.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace csa {

std::shared_ptr<Logger> make_logger(const std::string& level) {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<Logger>("csa", sink);
  logger->set_pattern("[csa %l] %v");
  logger->set_level(level.empty() ? spdlog::level::warn : spdlog::level::from_str(level));
  return logger;
}

}  // namespace csa
