#include "tune_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "contract.hpp"
#include "csa/reference.hpp"
#include "csa/testing/device.hpp"
#include "layout_data.hpp"

namespace csa::tools {

namespace {

template <class T>
std::vector<std::uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<std::uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<float> download_floats(const device::Buffer& b, std::size_t n) {
  std::vector<float> v(n);
  b.download(v.data(), n * sizeof(float));
  return v;
}

CheckResult check_tensor(const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& ref,
                         DType dtype, bool bitwise, const char* name) {
  return {contract_failure(got, ref, dtype, bitwise, name, kTuningMargin),
          diff(got, ref, dtype).differing};
}

// fp32 sums (grad_ape, grad_w) in a reordered summation: |diff| <= 1e-3 · max(1, |ref|), the
// same NaN mask (SPEC §2 item 5 for grad_ape).
std::string check_sums(const std::vector<float>& got, const std::vector<float>& ref,
                       const char* name) {
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(ref[i]))
      return fmt::format("{}: NaN mask differs at {}", name, i);
    if (std::fabs(got[i] - ref[i]) > 1e-3 * std::max(1.0, std::fabs(static_cast<double>(ref[i]))))
      return fmt::format("{}[{}]: {} against {}", name, i, got[i], ref[i]);
  }
  return {};
}

// The first failure of `parts`, and the largest differing count.
CheckResult first_failure(std::initializer_list<CheckResult> parts) {
  CheckResult out;
  for (const CheckResult& r : parts) {
    if (out.failure.empty()) out.failure = r.failure;
    out.differing = std::max(out.differing, r.differing);
  }
  return out;
}

// Plain calls: the reference kernels of the SPEC op order on the same device.
class PlainCheck final : public TuneCheck {
 public:
  PlainCheck(Runtime& rt, Stream stream, DeviceInputs& p) : rt_(rt), stream_(stream), p_(p) {}

  ForwardArgs forward(const DeviceInputs& inputs, int) const override { return inputs.forward(); }
  BackwardArgs backward(const DeviceInputs& inputs, int) const override {
    return inputs.backward();
  }

  void prepare(Direction direction, const std::function<const DeviceInputs&(int)>&) override {
    if (direction == Direction::kForward) {
      rt_.forward(p_.forward(), stream_, Family::kReference);
      device::synchronize(stream_);
      ref_out_ = DeviceInputs::download(p_.out);
      return;
    }
    rt_.backward(p_.backward(), stream_, Family::kReference);
    device::synchronize(stream_);
    ref_kv_ = DeviceInputs::download(p_.grad_kv);
    ref_score_ = DeviceInputs::download(p_.grad_score);
    ref_ape_ = download_floats(p_.grad_ape, p_.grad_ape.size() / sizeof(float));
  }

  CheckResult run_and_check(Direction direction, bool bitwise,
                            const std::function<void()>& call) override {
    p_.out.fill(0xff);
    p_.grad_kv.fill(0xff);
    p_.grad_score.fill(0xff);
    p_.grad_ape.fill(0xff);  // NaN: a grad_ape not overwritten fails its check
    call();
    device::synchronize(stream_);
    const DType dtype = p_.in.config.dtype;
    if (direction == Direction::kForward)
      return check_tensor(DeviceInputs::download(p_.out), ref_out_, dtype, bitwise, "out");
    CheckResult r = first_failure(
        {check_tensor(DeviceInputs::download(p_.grad_kv), ref_kv_, dtype, bitwise, "grad_kv"),
         check_tensor(DeviceInputs::download(p_.grad_score), ref_score_, dtype, bitwise,
                      "grad_score")});
    if (r.failure.empty())
      r.failure = check_sums(download_floats(p_.grad_ape, ref_ape_.size()), ref_ape_, "grad_ape");
    return r;
  }

 private:
  Runtime& rt_;
  Stream stream_;
  DeviceInputs& p_;
  std::vector<std::uint8_t> ref_out_, ref_kv_, ref_score_;
  std::vector<float> ref_ape_;
};

// Calls with a fused tail: the CPU fp32 chain. The forward's pooled rows meet the fp32
// contract against the CPU's and y is compared with the CPU tail over the candidate's own
// pooled rows, so that the CPU's libm expf does not count against the candidate; the backward
// against the CPU chain's gradients.
class TailCheck final : public TuneCheck {
 public:
  TailCheck(Runtime& rt, Stream stream, DeviceInputs& p, int sets, std::uint64_t seed)
      : rt_(rt),
        stream_(stream),
        p_(p),
        config_(p.in.config),
        rows_(static_cast<std::size_t>(p.in.total_comp)),
        d_(static_cast<std::size_t>(config_.head_dim)),
        inputs_(make_tail_inputs(config_, p.in, seed)),
        tail_(config_, inputs_),
        rstd_(std::max<std::size_t>(rows_, 1) * 4),
        grad_w_(d_ * 4),
        laid_(lay_out(p.in, config_.dtype, config_.layout)),
        host_(host_problem(p.in, laid_)),
        host_tail_(host_tail(config_, inputs_)) {
    for (int s = 0; s < sets; ++s) pooled_.emplace_back(std::max<std::size_t>(rows_, 1) * d_ * 4);
  }

  ForwardArgs forward(const DeviceInputs& inputs, int s) const override {
    ForwardArgs a = inputs.forward();
    a.tail = tail_.tail();
    if (config_.tail.norm) a.rstd = rstd_.as<float>();
    a.pooled = pooled_[static_cast<std::size_t>(s)].as<float>();
    return a;
  }
  BackwardArgs backward(const DeviceInputs& inputs, int s) const override {
    BackwardArgs a = inputs.backward();
    a.tail = tail_.tail();
    if (config_.tail.norm) {
      a.grad_norm_weight = grad_w_.as<float>();
      a.pooled = pooled_[static_cast<std::size_t>(s)].as<float>();
    }
    return a;
  }

  void prepare(Direction direction, const std::function<const DeviceInputs&(int)>& set) override {
    if (direction == Direction::kForward) {
      ref_pooled_.resize(rows_ * d_);
      reference::pooled_fp32(host_, ref_pooled_.data());
      return;
    }
    for (std::size_t s = 0; s < pooled_.size(); ++s)
      rt_.forward(forward(set(static_cast<int>(s)), static_cast<int>(s)), stream_);
    device::synchronize(stream_);
    ref_kv_.resize(p_.grad_kv.size());
    ref_score_.resize(p_.grad_score.size());
    ref_ape_.resize(p_.grad_ape.size() / sizeof(float));
    ref_w_.resize(d_);
    reference::tail_backward_fp32(host_, host_tail_, laid_.grad_out.data(), ref_kv_.data(),
                                  ref_score_.data(), ref_ape_.data(),
                                  config_.tail.norm ? ref_w_.data() : nullptr);
  }

  CheckResult run_and_check(Direction direction, bool bitwise,
                            const std::function<void()>& call) override {
    return direction == Direction::kForward ? check_forward(bitwise, call)
                                            : check_backward(bitwise, call);
  }

 private:
  CheckResult check_forward(bool bitwise, const std::function<void()>& call) {
    p_.out.fill(0xff);
    rstd_.fill(0xff);
    pooled_[0].fill(0xff);
    call();
    device::synchronize(stream_);
    const std::vector<std::uint8_t> y = DeviceInputs::download(p_.out);
    const std::vector<float> pooled = download_floats(pooled_[0], rows_ * d_);
    std::vector<std::uint8_t> ref_y(y.size());
    std::vector<float> ref_rstd(rows_);
    reference::tail_rows_fp32(host_, host_tail_, pooled.data(), ref_y.data(), ref_rstd.data());
    CheckResult r = first_failure(
        {check_tensor(as_bytes(pooled), as_bytes(ref_pooled_), DType::kF32, false, "pooled"),
         check_tensor(y, ref_y, config_.dtype, false, "y")});
    if (r.failure.empty() && config_.tail.norm) {
      const std::vector<float> rstd = download_floats(rstd_, rows_);
      for (std::size_t i = 0; i < rows_ && r.failure.empty(); ++i)
        if (!(std::fabs(rstd[i] - ref_rstd[i]) <= 1e-5f * std::fabs(ref_rstd[i])))
          r.failure = fmt::format("rstd[{}]: {} against {}", i, rstd[i], ref_rstd[i]);
    }
    if (r.failure.empty() && bitwise) r.failure = same_as_first_serial(as_bytes(pooled), y);
    return r;
  }

  CheckResult check_backward(bool bitwise, const std::function<void()>& call) {
    p_.grad_kv.fill(0xff);
    p_.grad_score.fill(0xff);
    p_.grad_ape.fill(0xff);  // NaN: a sum not overwritten fails its check
    grad_w_.fill(0xff);
    call();
    device::synchronize(stream_);
    const std::vector<std::uint8_t> kv = DeviceInputs::download(p_.grad_kv);
    const std::vector<std::uint8_t> score = DeviceInputs::download(p_.grad_score);
    const std::vector<float> ape = download_floats(p_.grad_ape, ref_ape_.size());
    const std::vector<float> w = download_floats(grad_w_, d_);
    CheckResult r =
        first_failure({check_tensor(kv, ref_kv_, config_.dtype, false, "grad_kv"),
                       check_tensor(score, ref_score_, config_.dtype, false, "grad_score")});
    if (r.failure.empty()) r.failure = check_sums(ape, ref_ape_, "grad_ape");
    if (r.failure.empty() && config_.tail.norm) r.failure = check_sums(w, ref_w_, "grad_w");
    if (r.failure.empty() && bitwise) {
      std::vector<std::uint8_t> all = kv;
      all.insert(all.end(), score.begin(), score.end());
      r.failure = same_as_first_serial(all, as_bytes(config_.tail.norm ? w : ape));
    }
    return r;
  }

  // Serial-order candidates run one op order: the first to pass sets the bits the others
  // must give.
  std::string same_as_first_serial(std::vector<std::uint8_t> a, std::vector<std::uint8_t> b) {
    if (!serial_) {
      serial_.emplace(std::move(a), std::move(b));
      return {};
    }
    if (serial_->first != a || serial_->second != b)
      return "a serial-order candidate's bits differ from the first serial-order candidate's";
    return {};
  }

  Runtime& rt_;
  Stream stream_;
  DeviceInputs& p_;
  Config config_;
  std::size_t rows_, d_;
  TailInputs inputs_;
  DeviceTail tail_;
  device::Buffer rstd_, grad_w_;
  std::vector<device::Buffer> pooled_;
  LaidInputs laid_;
  reference::HostProblem host_;
  Tail host_tail_;
  std::vector<float> ref_pooled_, ref_ape_, ref_w_;
  std::vector<std::uint8_t> ref_kv_, ref_score_;
  std::optional<std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>>> serial_;
};

}  // namespace

std::unique_ptr<TuneCheck> make_tune_check(Runtime& rt, Stream stream, DeviceInputs& p, int sets,
                                           std::uint64_t seed) {
  if (p.in.config.tail.any()) return std::make_unique<TailCheck>(rt, stream, p, sets, seed);
  return std::make_unique<PlainCheck>(rt, stream, p);
}

std::int64_t tail_extra_bytes(const Config& config, std::int64_t total_comp, Direction direction) {
  if (!keeps_pooled_rows(config) || (direction == Direction::kBackward && !config.tail.norm))
    return 0;
  return total_comp * config.head_dim * 4;
}

}  // namespace csa::tools
