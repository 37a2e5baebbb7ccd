// The library's spdlog logger. Each Runtime owns one (named "csa", not registered globally);
// units receive it by reference.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <optional>
#include <string>

namespace csa {

using Logger = spdlog::logger;

std::shared_ptr<Logger> make_logger(const std::string& level);

}  // namespace csa
