#include <array>

#include "api/runtime_impl.hpp"
#include "common/error.hpp"
#include "compressor/kernel_spec.hpp"
#include "compressor/validation.hpp"

namespace csa {

struct Plan::State {
  compressor::Service* service = nullptr;
  // By kernel layout (csa_kernel::LayoutKind): every one the configuration's calls can take.
  std::array<std::shared_ptr<const compressor::Prepared>, 3> by_layout;
  std::shared_ptr<const compressor::Prepared> prepared;  // the first of them

  template <typename Args>
  const compressor::Prepared& for_call(const Args& a) const {
    const Config& p = prepared->config;
    const Config& c = a.config;
    if (c.ratio != p.ratio || c.coff != p.coff || c.head_dim != p.head_dim || c.dtype != p.dtype ||
        c.layout != p.layout || c.tail != p.tail) {
      fail(Status::kInvalidArgument, "the call is for {} but the plan was prepared for {}",
           compressor::config_label(c), compressor::config_label(p));
    }
    const auto& record = by_layout.at(static_cast<std::size_t>(compressor::kernel_layout(a)));
    if (!record) {
      fail(Status::kInvalidArgument,
           "the call passes row strides but the plan for {} was prepared without the strided "
           "kernels (set Config::strided)",
           compressor::config_label(p));
    }
    return *record;
  }
};

Plan::Plan(Runtime& runtime, const Config& config, int device, Family family)
    : state_(std::make_unique<State>()) {
  state_->service = &RuntimeAccess::of(runtime).service;
  for (const int layout : compressor::kernel_layouts(config)) {
    auto record = state_->service->record(config, layout, family, device);
    if (!state_->prepared) state_->prepared = record;
    state_->by_layout.at(static_cast<std::size_t>(layout)) = std::move(record);
  }
}

Plan::~Plan() = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;

void Plan::forward(const ForwardArgs& args, Stream stream) const {
  state_->service->forward_with(state_->for_call(args), args, reinterpret_cast<CUstream>(stream));
}

void Plan::backward(const BackwardArgs& args, Stream stream) const {
  state_->service->backward_with(state_->for_call(args), args, reinterpret_cast<CUstream>(stream));
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
