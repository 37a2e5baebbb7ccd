// NVRTC: compiles one CUDA C++ translation unit, with headers supplied from memory, to a cubin
// for an explicit arch. Needs no driver and no CUDA include directory.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace csa::nvrtc {

struct Header {
  std::string_view name;
  std::string_view content;
};

struct CompileRequest {
  std::string source;       // the translation unit
  std::string source_name;  // shown in diagnostics
  std::vector<std::string>
      name_expressions;              // e.g. "csa_kernel::short_window_forward<4,2,128,2,256>"
  std::vector<std::string> options;  // without the arch option
  std::string arch;                  // "sm_90", "sm_90a", ...
};

struct CompileResult {
  std::vector<char> cubin;
  std::vector<std::string> lowered_names;  // one per name expression, same order
  std::string log;                         // NVRTC + ptxas log
  double seconds = 0.0;
};

// Resources of one kernel, parsed from a ptxas -v report.
struct KernelResources {
  std::string name;
  int registers = -1;
  int stack_bytes = 0;
  int spill_store_bytes = 0;
  int spill_load_bytes = 0;
};

class Compiler {
 public:
  explicit Compiler(std::vector<Header> headers) : headers_(std::move(headers)) {}
  // Throws Error(kCompileError) with the log and the options on failure.
  CompileResult compile(const CompileRequest& request) const;

  static std::pair<int, int> version();
  static std::vector<int> supported_archs();  // e.g. {75, 80, ..., 120}

 private:
  std::vector<Header> headers_;
};

// Throws Error(kInvalidArgument) unless `arch` is sm_XY[a|f] and NVRTC supports XY.
void check_arch(const std::string& arch);
// `malformed` (optional): set when a number is out of what ptxas can report.
std::vector<KernelResources> parse_ptxas_report(const std::string& log, bool* malformed = nullptr);

}  // namespace csa::nvrtc
