// One host-side description per kernel template of kernels/: the header that declares it, its
// name, whether it begins with the shape parameters <class IO, int RATIO, int COFF, int
// HEAD_DIM>, and how many template parameters follow them (checked at compile time wherever an
// instance is named). Every name expression NVRTC instantiates is rendered from these.
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "compressor/register_fit.hpp"
#include "csa_params.h"

namespace csa::compressor {

// FORMS: above 1, the template's last parameter, after its residency, is an int that chooses
// one of the kernel's FORMS forms (0: the default), which register fitting may take
// (register_fit.hpp).
template <int PARAMS, int FORMS = 1>
struct KernelTemplate {
  std::string_view header;
  std::string_view name;
  bool shaped = true;
};

namespace kernel_templates {

// short_window.cuh: <shape, VEC, THREADS, MIN_CTAS>
inline constexpr KernelTemplate<3> kShortWindowForward{"short_window.cuh",
                                                       "csa_kernel::short_window_forward"};
// short_window.cuh: <shape, VEC, TX, TY, FIXED_ORDER, MIN_CTAS, FORM>
inline constexpr KernelTemplate<6, csa_kernel::kShortWindowBackwardForms> kShortWindowBackward{
    "short_window.cuh", "csa_kernel::short_window_backward"};
// tail_row_stats.cuh: <shape, THREADS>
inline constexpr KernelTemplate<1> kTailRowStats{"tail_row_stats.cuh",
                                                 "csa_kernel::tail_row_stats"};
// tail_rows_forward.cuh: <shape, THREADS>
inline constexpr KernelTemplate<1> kTailRowsForward{"tail_rows_forward.cuh",
                                                    "csa_kernel::tail_rows_forward"};
// reference.cuh: <shape>
inline constexpr KernelTemplate<0> kReferenceForward{"reference.cuh",
                                                     "csa_kernel::reference_forward"};
inline constexpr KernelTemplate<0> kReferenceBackwardRows{"reference.cuh",
                                                          "csa_kernel::reference_backward_rows"};
inline constexpr KernelTemplate<0> kReferenceBackwardZeros{"reference.cuh",
                                                           "csa_kernel::reference_backward_zeros"};
inline constexpr KernelTemplate<0> kReferenceGradApe{"reference.cuh",
                                                     "csa_kernel::reference_grad_ape"};
// long_window.cuh (the staged form): <shape, VEC, COLS, THREADS, SERIAL, FAST_EXP>
inline constexpr KernelTemplate<5> kLongWindowForward{"long_window.cuh",
                                                      "csa_kernel::long_window_forward"};
inline constexpr KernelTemplate<5> kLongWindowBackward{"long_window.cuh",
                                                       "csa_kernel::long_window_backward"};
// lane_window_forward.cuh: <shape, VEC, TX, LANES, SERIAL, FAST_EXP>
inline constexpr KernelTemplate<5> kLaneWindowForward{"lane_window_forward.cuh",
                                                      "csa_kernel::lane_window_forward"};
// lane_window_backward.cuh: <shape, VEC, TX, LANES, STAGES, FAST_EXP, ATOMIC_APE>
inline constexpr KernelTemplate<6> kLaneWindowBackward{"lane_window_backward.cuh",
                                                       "csa_kernel::lane_window_backward"};
// ape_reduce.cuh: <LANES>, and the unshaped offset check (not a template)
inline constexpr KernelTemplate<1> kApeReduce{"ape_reduce.cuh", "csa_kernel::ape_reduce", false};
inline constexpr KernelTemplate<1> kApeReduceQuads{"ape_reduce.cuh", "csa_kernel::ape_reduce_quads",
                                                   false};
inline constexpr KernelTemplate<-1> kCheckOffsets{"ape_reduce.cuh", "csa_kernel::check_offsets",
                                                  false};

}  // namespace kernel_templates

// The kernels of one module in slot order, and its translation unit (each header they need,
// once). Naming an instance twice gives its first slot.
class ModuleBuilder {
 public:
  // `shape`: the arguments shaped templates begin with ("csa_kernel::Io<0,0,0>,4,2,128"); empty
  // for a module of unshaped kernels.
  explicit ModuleBuilder(std::string shape = {}) : shape_(std::move(shape)) {}

  // The shape arguments of the instances added from now on (a module whose kernels differ in
  // their I/O policy: the tail's row-stats backward).
  void set_shape(std::string shape) { shape_ = std::move(shape); }

  // The instance of `t` with one argument per template parameter after the shape.
  template <int N, int F, class... Args>
  std::string expression(const KernelTemplate<N, F>& t, const Args&... args) const {
    static_assert(N < 0 ? sizeof...(Args) == 0 : sizeof...(Args) == static_cast<std::size_t>(N),
                  "one argument per template parameter");
    if constexpr (N < 0) {
      return std::string(t.name);  // not a template
    } else {
      std::string list = t.shaped ? shape_ : std::string();
      ((list += fmt::format("{}{}", list.empty() ? "" : ",", args)), ...);
      return fmt::format("{}<{}>", t.name, list);
    }
  }
  // Adds the instance (or finds it); its slot.
  template <int N, int F, class... Args>
  int add(const KernelTemplate<N, F>& t, const Args&... args) {
    return add_expression(t.header, expression(t, args...), std::nullopt);
  }
  // add() of one instance under other shape arguments (a tail form's I/O policy); the module's
  // shape is kept for the instances after it.
  template <int N, int F, class... Args>
  int add_in_shape(const std::string& shape, const KernelTemplate<N, F>& t, const Args&... args) {
    std::string kept = std::exchange(shape_, shape);
    const int slot = add(t, args...);
    shape_ = std::move(kept);
    return slot;
  }
  // The same for a template whose last parameter is its residency (the CTAs per SM of
  // `threads` threads its registers must fit; 0: ptxas's choice), or whose residency its form
  // follows (named in form 0), which register fitting may change (register_fit.hpp).
  template <int N, int F, class... Args>
  int add_resident(const KernelTemplate<N, F>& t, int threads, int min_ctas,
                   const Args&... leading) {
    Residency r{{}, threads, min_ctas, F};
    std::string name;
    if constexpr (F > 1) {
      name = expression(t, leading..., min_ctas, 0);
    } else {
      name = expression(t, leading..., min_ctas);
    }
    // The prefix ends at the comma before the residency.
    const std::size_t residency_comma =
        F > 1 ? name.rfind(',', name.rfind(',') - 1) : name.rfind(',');
    r.prefix = name.substr(0, residency_comma + 1);
    return add_expression(t.header, std::move(name), std::move(r));
  }

  const std::vector<std::string>& names() const { return names_; }
  // One entry per name; empty where no kernel has a residency argument.
  ResidencyTable residency() const;
  std::string source() const;  // the #include lines of the headers, in first-use order

 private:
  int add_expression(std::string_view header, std::string name, std::optional<Residency> r);

  std::string shape_;
  std::vector<std::string_view> headers_;
  std::vector<std::string> names_;
  ResidencyTable residency_;
};

}  // namespace csa::compressor
