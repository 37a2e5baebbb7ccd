#include "api/runtime_impl.hpp"
#include "common/error.hpp"
#include "compressor/kernel_spec.hpp"

namespace csa {

struct Plan::State {
  compressor::Service* service = nullptr;
  std::shared_ptr<const compressor::Prepared> prepared;
};

namespace {

void check_config(const Plan::State& s, const Config& c) {
  const Config& p = s.prepared->config;
  if (c.ratio != p.ratio || c.coff != p.coff || c.head_dim != p.head_dim) {
    fail(Status::kInvalidArgument, "the call is for {} but the plan was prepared for {}",
         compressor::config_label(c), compressor::config_label(p));
  }
}

}  // namespace

Plan::Plan(Runtime& runtime, const Config& config, int device, Family family)
    : state_(std::make_unique<State>()) {
  state_->service = &RuntimeAccess::of(runtime).service;
  state_->prepared = state_->service->record(config, family, device);
}

Plan::~Plan() = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;

void Plan::forward(const ForwardArgs& args, Stream stream) const {
  check_config(*state_, args.config);
  state_->service->forward_with(*state_->prepared, args, reinterpret_cast<CUstream>(stream));
}

void Plan::backward(const BackwardArgs& args, Stream stream) const {
  check_config(*state_, args.config);
  state_->service->backward_with(*state_->prepared, args, reinterpret_cast<CUstream>(stream));
}

const Config& Plan::config() const {
  return state_->prepared->config;
}
int Plan::device() const {
  return state_->prepared->device.ordinal;
}
Family Plan::family() const {
  return state_->prepared->family;
}

}  // namespace csa
