// Loads the driver once, on first device use, and remembers why it could not.
#pragma once

#include <memory>
#include <mutex>
#include <exception>
#include <string>

#include "driver/driver.hpp"

namespace csa::driver {

class Loader {
 public:
  Loader() = default;
  // For tests: use this (fake) driver instead of loading libcuda; nullptr loads lazily as usual.
  explicit Loader(std::unique_ptr<Driver> injected);

  // Throws Error(kDriverUnavailable) with the reason when there is no usable driver.
  Driver& get();
  // nullptr (and the reason) when there is no usable driver.
  Driver* try_get(std::string* why);

 private:
  void load_once();
  std::once_flag once_;
  std::unique_ptr<Driver> driver_;
  std::exception_ptr error_;
};

}  // namespace csa::driver
