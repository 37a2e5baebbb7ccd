#include "driver/loader.hpp"

#include "common/error.hpp"

namespace csa::driver {

Loader::Loader(std::unique_ptr<Driver> injected) : driver_(std::move(injected)) {
  if (driver_) std::call_once(once_, [] {});  // nothing left to load
}

void Loader::load_once() {
  std::call_once(once_, [this] {
    try {
      driver_ = Driver::load();
    } catch (const Error&) {
      error_ = std::current_exception();
    }
  });
}

Driver& Loader::get() {
  load_once();
  if (!driver_) std::rethrow_exception(error_);
  return *driver_;
}

Driver* Loader::try_get(std::string* why) {
  load_once();
  if (!driver_ && why != nullptr) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      *why = e.what();
    }
  }
  return driver_.get();
}

}  // namespace csa::driver
