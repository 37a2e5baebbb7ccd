#include "nvrtc/compiler.hpp"

#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <regex>
#include <sstream>

#include "common/error.hpp"
#include "common/parse.hpp"

namespace csa::nvrtc {

namespace {

void check(nvrtcResult result, const char* what) {
  if (result != NVRTC_SUCCESS)
    fail(Status::kCompileError, "{} failed: {}", what, nvrtcGetErrorString(result));
}

// Owns an nvrtcProgram for exception safety.
class Program {
 public:
  Program(const CompileRequest& request, const std::vector<Header>& headers) {
    std::vector<const char*> names;
    std::vector<const char*> contents;
    // The embedded headers are string_views without terminators; NVRTC wants C strings.
    std::vector<std::string> name_storage;
    name_storage.reserve(headers.size());
    contents_.reserve(headers.size());
    for (const Header& h : headers) {
      name_storage.emplace_back(h.name);
      contents_.emplace_back(h.content);
    }
    names_ = std::move(name_storage);
    for (std::size_t i = 0; i < headers.size(); ++i) {
      names.push_back(names_[i].c_str());
      contents.push_back(contents_[i].c_str());
    }
    check(nvrtcCreateProgram(&program_, request.source.c_str(), request.source_name.c_str(),
                             static_cast<int>(headers.size()), contents.data(), names.data()),
          "nvrtcCreateProgram");
  }
  ~Program() { nvrtcDestroyProgram(&program_); }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;
  nvrtcProgram get() const { return program_; }

 private:
  nvrtcProgram program_ = nullptr;
  std::vector<std::string> names_;
  std::vector<std::string> contents_;
};

// The program log without ptxas's timing lines, so that identical compiles give identical
// bytes (and cache entries).
std::string program_log(nvrtcProgram program) {
  std::size_t size = 0;
  if (nvrtcGetProgramLogSize(program, &size) != NVRTC_SUCCESS || size <= 1) return {};
  std::string log(size, '\0');
  if (nvrtcGetProgramLog(program, log.data()) != NVRTC_SUCCESS) return {};
  log.resize(size - 1);
  std::istringstream lines(log);
  std::string line;
  std::string kept;
  while (std::getline(lines, line)) {
    if (line.find("Compile time =") == std::string::npos) kept += line + "\n";
  }
  return kept;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : " ") + s;
  return out;
}

}  // namespace

std::pair<int, int> Compiler::version() {
  int major = 0;
  int minor = 0;
  check(nvrtcVersion(&major, &minor), "nvrtcVersion");
  return {major, minor};
}

std::vector<int> Compiler::supported_archs() {
  int count = 0;
  check(nvrtcGetNumSupportedArchs(&count), "nvrtcGetNumSupportedArchs");
  std::vector<int> archs(static_cast<std::size_t>(count));
  check(nvrtcGetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs");
  return archs;
}

void check_arch(const std::string& arch) {
  const auto parsed = parse::compute_capability(arch);
  if (!parsed) {
    fail(Status::kInvalidArgument, "arch '{}' is not of the form sm_XY (e.g. sm_90)", arch);
  }
  const int cc = *parsed;
  const auto archs = Compiler::supported_archs();
  if (std::find(archs.begin(), archs.end(), cc) == archs.end()) {
    std::string list;
    for (int a : archs) list += fmt::format("{}sm_{}", list.empty() ? "" : ", ", a);
    fail(Status::kUnsupported, "arch '{}' is not supported by this NVRTC (supported: {})", arch,
         list);
  }
  if (cc < 80)
    fail(Status::kUnsupported, "arch '{}': csa needs compute capability 8.0 or newer", arch);
}

CompileResult Compiler::compile(const CompileRequest& request) const {
  const auto start = std::chrono::steady_clock::now();
  Program program(request, headers_);
  for (const auto& expr : request.name_expressions) {
    check(nvrtcAddNameExpression(program.get(), expr.c_str()), "nvrtcAddNameExpression");
  }
  std::vector<std::string> options = request.options;
  options.push_back("--gpu-architecture=" + request.arch);
  std::vector<const char*> argv;
  argv.reserve(options.size());
  for (const auto& o : options) argv.push_back(o.c_str());
  const nvrtcResult rc =
      nvrtcCompileProgram(program.get(), static_cast<int>(argv.size()), argv.data());
  CompileResult result;
  result.log = program_log(program.get());
  if (rc != NVRTC_SUCCESS) {
    fail(Status::kCompileError, "NVRTC could not compile {} for {} ({}).\noptions: {}\nlog:\n{}",
         request.source_name, request.arch, nvrtcGetErrorString(rc), join(options), result.log);
  }
  for (const auto& expr : request.name_expressions) {
    const char* lowered = nullptr;
    check(nvrtcGetLoweredName(program.get(), expr.c_str(), &lowered), "nvrtcGetLoweredName");
    result.lowered_names.emplace_back(lowered);
  }
  std::size_t size = 0;
  check(nvrtcGetCUBINSize(program.get(), &size), "nvrtcGetCUBINSize");
  if (size == 0)
    fail(Status::kCompileError, "NVRTC produced no cubin for {} ({})", request.source_name,
         request.arch);
  result.cubin.resize(size);
  check(nvrtcGetCUBIN(program.get(), result.cubin.data()), "nvrtcGetCUBIN");
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

std::vector<KernelResources> parse_ptxas_report(const std::string& log, bool* malformed) {
  static const std::regex entry("Compiling entry function '([^']+)'");
  static const std::regex properties("Function properties for (\\S+)");
  static const std::regex frame(
      "([0-9]+) bytes stack frame, ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads");
  static const std::regex regs("Used ([0-9]+) registers");
  static const std::regex cumulative("([0-9]+) bytes cumulative stack size");
  // A report read back from a cache entry is not trusted: a number ptxas cannot print (more
  // registers than a thread may have, sizes beyond 1 GiB) makes the report malformed.
  constexpr int kMaxRegisters = 255;
  constexpr int kMaxBytes = 1 << 30;
  bool bad = false;
  auto number = [&](const std::ssub_match& text, int hi) {
    const auto value = parse::integer<int>(text.str(), 0, hi);
    if (!value) bad = true;
    return value.value_or(0);
  };
  std::vector<KernelResources> out;
  std::istringstream lines(log);
  std::string line;
  std::smatch m;
  // NOTE: ptxas prints the properties of the module's device functions (a slow path the
  // kernels call, say) among the entries' own, each after its "Function properties for" line.
  // Their frames count towards the entry they follow, added to its own: never in its place,
  // or a callee's zeros would hide the entry's spills.
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, entry)) {
      out.push_back(KernelResources{m[1].str()});
    } else if (std::regex_search(line, m, properties)) {
      // A device function's properties before any entry: a record of its own.
      if (out.empty()) out.push_back(KernelResources{m[1].str()});
    } else if (!out.empty() && std::regex_search(line, m, frame)) {
      KernelResources& k = out.back();
      k.stack_bytes = std::max(k.stack_bytes, number(m[1], kMaxBytes));
      k.spill_store_bytes += number(m[2], kMaxBytes);
      k.spill_load_bytes += number(m[3], kMaxBytes);
    } else if (!out.empty() && std::regex_search(line, m, regs)) {
      out.back().registers = number(m[1], kMaxRegisters);
      if (std::regex_search(line, m, cumulative))
        out.back().stack_bytes = std::max(out.back().stack_bytes, number(m[1], kMaxBytes));
    }
  }
  if (malformed != nullptr) *malformed = bad;
  return out;
}

}  // namespace csa::nvrtc
