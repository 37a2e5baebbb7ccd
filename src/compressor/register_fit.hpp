// Register fitting: local memory that ptxas chose but did not need. Kernels whose residency is
// a template argument (the CTAs per SM their registers must fit, last; 0: ptxas's own choice)
// are compiled once as the schedule asks. Where one at ptxas's choice then uses local memory,
// it is compiled again pinned to the residency it got (the CTAs per SM its registers allow):
// the same register budget, named, which ptxas meets without the heuristic's spills. Where it
// still uses some, the next rungs pin one CTA fewer each (a larger budget), down to one CTA,
// at most kMaxRungs compiles; each kernel keeps the rung with the least local memory (its
// first compile on a tie). A residency the schedule names (measured against the default
// kernel) stays through the rungs. A kernel with other forms (an int after its residency: the
// same result, keeping fewer values live across its main loop) that still uses local memory
// after that is compiled once more in each, in order, at the residency it kept, while some
// remains, and keeps the form with the least (the earlier on a tie). Last, a named residency
// that still uses local memory in every form gives way: one CTA fewer at a time, each rung in
// the default form and then the others while some remains, kept where it uses less. Modules
// without local memory compile once and are unchanged.
// The decisions are a function of the module's compiles, so its cache key decides its cubin.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "nvrtc/compiler.hpp"

namespace csa::compressor {

// A kernel instance with a residency argument: its name expression is
// `prefix + std::to_string(min_ctas) + ">"`, or, with forms,
// `prefix + std::to_string(min_ctas) + "," + std::to_string(form) + ">"`.
struct Residency {
  std::string prefix;
  int threads = 0;   // per CTA
  int min_ctas = 0;  // as asked (0: ptxas's choice)
  int forms = 1;     // above 1: an int after the residency chooses the form (as asked: 0)
};

// One entry per name expression of a module (nullopt: no residency argument).
using ResidencyTable = std::vector<std::optional<Residency>>;

// Bump when the rule changes: it is part of every module's cache key.
inline constexpr int kRegisterFitVersion = 7;

// Compiles after the first at most: pinned at the residency the registers give, then two more
// rungs (a 128-register kernel at ptxas's choice reaches one CTA, a 48-register one four).
inline constexpr int kMaxRungs = 3;

// The CTAs of `threads` threads per SM that `registers` per thread allow (64K registers per SM,
// allocated per warp in units of 256), at most `max_threads_per_sm` threads and 32 CTAs.
int register_bound_ctas(int registers, int threads, int max_threads_per_sm);
// The most threads one SM of `arch` ("sm_90") holds: 1536 on sm_86, sm_89 and sm_12x, else 2048.
int max_threads_per_sm(const std::string& arch);

// The first rung after a first compile with lowered names `lowered` and ptxas report `report`:
// per slot, the CTAs per SM to pin (0: the slot stays as asked); nullopt where no kernel
// changes (or the report lacks one: fitting needs `--ptxas-options=-v`).
std::optional<std::vector<int>> first_rung(const ResidencyTable& residency,
                                           const std::vector<std::string>& lowered,
                                           const std::vector<nvrtc::KernelResources>& report,
                                           const std::string& arch);

// `names` with each slot that `pinned` names (> 0) at that residency.
std::vector<std::string> rung_names(const std::vector<std::string>& names,
                                    const ResidencyTable& residency,
                                    const std::vector<int>& pinned);

// A step after the rungs: `names` (each slot's best so far, at residency `ctas`) with each slot
// that has form `form` and still uses local memory (`bytes` > 0) in that form; nullopt where
// no slot changes.
std::optional<std::vector<std::string>> form_names(const std::vector<std::string>& names,
                                                   const ResidencyTable& residency,
                                                   const std::vector<int>& ctas,
                                                   const std::vector<long long>& bytes, int form);

// The name expressions to compile instead of `names` after a first compile with lowered names
// `lowered` and ptxas report `report`; nullopt where no kernel changes (or the report lacks
// one: fitting needs `--ptxas-options=-v`).
std::optional<std::vector<std::string>> fitted_names(
    const std::vector<std::string>& names, const ResidencyTable& residency,
    const std::vector<std::string>& lowered, const std::vector<nvrtc::KernelResources>& report,
    const std::string& arch);

// Compiles `request`, then the rungs of the kernels that use local memory, then the other
// forms of those that still do. The result has one lowered name per name expression of
// `request`, in its order (a fitted name two slots share is compiled once), and the log of the
// compile it comes from.
nvrtc::CompileResult compile_fitted(const nvrtc::Compiler& compiler,
                                    const nvrtc::CompileRequest& request,
                                    const ResidencyTable& residency);

}  // namespace csa::compressor
