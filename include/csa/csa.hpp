// csa: fused CUDA kernels for the CSA/HCA Compressor, C++ API.
//
// A Runtime owns the CUDA driver table (loaded lazily), the NVRTC compiler, the disk cubin
// cache, the in-memory module cache and the prepared launch records. Trainers may hold their
// own Runtime or use Runtime::default_runtime().
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "csa/export.h"

struct CUstream_st;

namespace csa {

// A CUstream or cudaStream_t (the same type); nullptr is the legacy default stream.
using Stream = CUstream_st*;

enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,
  kUnsupported = 2,
  kDriverUnavailable = 3,
  kDriverError = 4,
  kCompileError = 5,
  kCacheError = 6,
  kCaptureUnsafe = 7,
  kJitDisabled = 8,
  kInternal = 9,
};

CSA_API const char* status_name(Status status) noexcept;

class CSA_API Error : public std::runtime_error {
 public:
  Error(Status code, const std::string& message);
  Status code() const noexcept { return code_; }

 private:
  Status code_;
};

// Backward flags (the C ABI's CSA_ACCUMULATE_GRAD_APE / CSA_DETERMINISTIC).
inline constexpr std::uint32_t kAccumulateGradApe = 1u;
inline constexpr std::uint32_t kDeterministic = 2u;

// Element type of kv, score, out, grad_out, grad_kv and grad_score (ape and grad_ape are
// fp32 in every case). Arithmetic is fp32 with one rounding per output in every type.
enum class DType : std::int32_t { kBf16 = 0, kF16 = 1, kF32 = 2 };

// Where the tokens lie. kThd: packed sequences (total_tokens, coff*head_dim) with cu_seqlens
// offsets. kSbhd: (S, B, coff*head_dim) in, (S / ratio, B, head_dim) out, every batch column
// one segment of S tokens (no offsets, no padding rows). Either layout takes row strides.
enum class Layout : std::int32_t { kThd = 0, kSbhd = 1 };

CSA_API const char* dtype_name(DType dtype) noexcept;     // "bf16", "fp16", "fp32"
CSA_API const char* layout_name(Layout layout) noexcept;  // "thd", "sbhd"

// The compile-time shape of the Compressor's tail after the pooling, every stage optional (all
// off: the pooled rows): y = H(rope(rmsnorm(pooled) ⊙ w)) in fp32, with one rounding of y to
// the element type (docs/user-guide.md, "The tail"). Its tensors are a call's Tail.
struct TailShape {
  // RMSNorm over head_dim, x · (mean(x²) + eps)^-1/2 ⊙ w, with w of norm_weight_dtype (bf16 or
  // fp32).
  bool norm = false;
  DType norm_weight_dtype = DType::kF32;
  // RoPE on the last rope_dim columns (even, <= head_dim; 0: none) at each row's block index
  // in its segment (its position is block * ratio; padding rows are at block 0): the pairs
  // (2i, 2i+1) of those columns (interleaved), or (i, i + rope_dim / 2) with rope_interleaved
  // false. a' = a·cos − b·sin, b' = a·sin + b·cos, cos and sin of row `block`, column i.
  std::int32_t rope_dim = 0;
  bool rope_interleaved = true;
  // The Hadamard transform of size head_dim (a power of two), scaled by head_dim^-1/2.
  bool hadamard = false;

  bool rope() const { return rope_dim > 0; }
  bool any() const { return norm || rope() || hadamard; }
  bool operator==(const TailShape& o) const {
    return norm == o.norm && (!norm || norm_weight_dtype == o.norm_weight_dtype) &&
           rope_dim == o.rope_dim && (rope_dim == 0 || rope_interleaved == o.rope_interleaved) &&
           hadamard == o.hadamard;
  }
  bool operator!=(const TailShape& o) const { return !(*this == o); }
};

// "norm+rope64+hadamard" ("norm-bf16" for a bf16 weight, "rope64-half" for half-split pairs),
// "none" without a tail.
CSA_API std::string tail_name(const TailShape& tail);

// The compile-time shape of one compressor.
struct Config {
  std::int32_t ratio = 4;
  std::int32_t head_dim = 128;
  std::int32_t coff = 2;
  DType dtype = DType::kBf16;
  Layout layout = Layout::kThd;
  // THD calls with row strides run kernels of their own, compiled on the first such call;
  // `strided` has prewarm and plans prepare them too (SBHD kernels always take strides).
  bool strided = false;
  // The fused tail (none by default). Its kernels are kernels of their own: a configuration
  // with a tail is prepared, cached and planned apart from the plain one.
  TailShape tail;
};

// Whether calls of `config` run the long-window family's tail (a tail at a ratio above 16),
// whose forward keeps the pooled rows (ForwardArgs::pooled) that its backward reads.
CSA_API bool keeps_pooled_rows(const Config& config);

// Whether calls of `config` run the short-window family's tail with the norm and without the
// Hadamard transform, whose backward takes its row-stats form where the caller keeps the
// pooled rows (ForwardArgs::pooled, then BackwardArgs::pooled).
CSA_API bool has_row_stats_backward(const Config& config);

// The tensors of a call's tail, as config.tail names its stages (device pointers in calls,
// host pointers in the references).
struct Tail {
  const void* norm_weight = nullptr;  // config.tail.norm: (head_dim,) of norm_weight_dtype
  float eps = 1e-6f;                  // config.tail.norm: > 0
  const float* rope_cos = nullptr;    // config.tail.rope(): (rope_max_blocks, rope_dim / 2)
  const float* rope_sin = nullptr;    // config.tail.rope(): (rope_max_blocks, rope_dim / 2)
  // Table rows. Kernels read row min(block, rope_max_blocks - 1): size the tables for the
  // longest segment (the host cannot see device offsets; SBHD calls are checked).
  std::int64_t rope_max_blocks = 0;
};

// Which kernels serve a call. kAuto routes by the schedule table (short-window for small
// ratios, long-window for large ones). kReference is the plain one-thread-per-element kernel
// of the SPEC op order, slow, for validation.
enum class Family { kAuto, kShortWindow, kLongWindow, kReference };

enum class Direction { kForward, kBackward };

// The schedule a call of (config, direction, rows) gets on one arch, as the runtime picks it.
struct ScheduleChoice {
  Family family = Family::kShortWindow;
  std::string table_arch;  // the schedule table used; empty: built-in rule
  std::string table_source;
  int entry = -1;   // index in the table's entries (-1: built-in rule)
  int bucket = -1;  // index in the entry's buckets
  // The element type and layout the entry is keyed on ("fp32", "sbhd"); empty: it serves
  // every one.
  std::string entry_dtype;
  std::string entry_layout;
  std::string entry_tail;  // the entry's "tail" key (a tail's name or "any"), else empty
  std::int64_t rows_min = 0;
  std::int64_t rows_max = -1;  // -1: unbounded
  std::string schedule;        // every launch parameter, "key=value ..."
  std::string contract;        // "bitwise" (SPEC §2 op order) or "tolerance" (SPEC §2 item 3)
  // Backward: grad_ape is summed with fp32 atomics unless the call is deterministic, so it is
  // not bitwise run to run (max |diff| 1e-3 contract, SPEC §2 item 5); false: fixed order.
  bool grad_ape_atomic = false;
  // With grad_ape_atomic: a call captured into a CUDA graph with little work per CTA, or when
  // the Runtime has no claim words left for graphs (they are set aside by prewarm, a Plan or
  // the first eager atomic backward on the context), takes the fixed order instead
  // (short-window schedules with fixed=1,one=1).
  bool grad_ape_atomic_needs_claim_words = false;
};

// Rows: kv/score/grad_kv/grad_score have total_tokens rows of coff*head_dim elements, out and
// grad_out total_comp rows of head_dim, in config.dtype. SBHD: total_tokens = seq_len *
// num_segments (S * B), total_comp = (seq_len / ratio) * num_segments, no offset arrays; row
// (s, b) is row s * B + b. A row stride (elements from one row to the next) of 0 means dense
// rows (the width); otherwise at least the width, keeping rows as aligned as dense ones.
struct ForwardArgs {
  const void* kv = nullptr;                       // (total_tokens, coff*head_dim)
  const void* score = nullptr;                    // (total_tokens, coff*head_dim)
  const float* ape = nullptr;                     // (ratio, coff*head_dim) fp32
  const std::int32_t* cu_seqlens = nullptr;       // THD: (num_segments + 1) int32
  const std::int32_t* cu_seqlens_comp = nullptr;  // THD: (num_segments + 1) int32
  void* out = nullptr;                            // (total_comp, head_dim)
  std::int64_t total_tokens = 0;
  std::int32_t num_segments = 0;  // SBHD: the batch B
  std::int64_t total_comp = 0;
  Config config;
  std::int64_t seq_len = 0;  // SBHD: S
  std::int64_t kv_stride = 0;
  std::int64_t score_stride = 0;
  std::int64_t out_stride = 0;
  // config.tail's tensors; out then holds y. rstd (optional, needs the norm): total_comp fp32
  // values, each row's (mean(x²) + eps)^-1/2.
  Tail tail;
  float* rstd = nullptr;
  // With a tail: optional, (total_comp, head_dim) fp32 dense, 16-byte aligned, receives the
  // pooled rows before the tail, for the backward (BackwardArgs::pooled). The long-window
  // family's tail (ratio > 16) reads them there (without it the forward keeps them in scratch
  // memory); a short-window tail with the norm and without the Hadamard transform takes its
  // backward's row-stats form from them. Must be null without a tail.
  float* pooled = nullptr;
};

struct BackwardArgs {
  const void* kv = nullptr;
  const void* score = nullptr;
  const float* ape = nullptr;
  const std::int32_t* cu_seqlens = nullptr;
  const std::int32_t* cu_seqlens_comp = nullptr;
  const void* grad_out = nullptr;  // (total_comp, head_dim)
  void* grad_kv = nullptr;         // (total_tokens, coff*head_dim), every row fully written
  void* grad_score = nullptr;      // (total_tokens, coff*head_dim), every row fully written
  float* grad_ape = nullptr;       // (ratio, coff*head_dim) fp32, overwritten unless accumulating
  std::int64_t total_tokens = 0;
  std::int32_t num_segments = 0;
  std::int64_t total_comp = 0;
  Config config;
  std::uint32_t flags = 0;
  std::int64_t seq_len = 0;
  std::int64_t kv_stride = 0;
  std::int64_t score_stride = 0;
  std::int64_t grad_out_stride = 0;
  std::int64_t grad_kv_stride = 0;  // the elements between strided rows are left untouched
  std::int64_t grad_score_stride = 0;
  // config.tail's tensors (grad_out then holds grad_y); with the norm, grad_norm_weight (the
  // weight's gradient, (head_dim,) fp32, summed over the valid rows) is overwritten unless
  // accumulating, like grad_ape.
  Tail tail;
  float* grad_norm_weight = nullptr;
  // The pooled rows the forward wrote to ForwardArgs::pooled: required by the long-window
  // family's tail with the norm; in the short-window family they select the backward's
  // row-stats form (a tail with the norm and without the Hadamard transform only; rejected
  // otherwise). Must be null without a tail.
  const float* pooled = nullptr;
};

struct CSA_API RuntimeOptions {
  std::string cache_dir;   // empty: $CSA_CACHE_DIR, $XDG_CACHE_HOME/csa, ~/.cache/csa
  bool disk_cache = true;  // false: memory only
  // Read-only cache layers searched after cache_dir, in order ($CSA_CACHE_PATH, a ':'
  // separated list); the prebuilt kernels installed with the library are searched last.
  std::vector<std::string> cache_layers;
  // Search the prebuilt kernels installed with the library (the directory csa-kernels beside
  // libcsa.so) last ($CSA_PREBUILT_KERNELS=0: not).
  bool prebuilt_kernels = true;
  std::int64_t cache_max_bytes = std::int64_t{4} << 30;  // bound of cache_dir's entries
  bool jit_enabled = true;    // false: a cache miss is an error (kJitDisabled)
  bool ptxas_verbose = true;  // keep the ptxas resource report of every compile
  bool line_info = false;     // compile with -lineinfo (part of the cache key)
  std::string log_level;      // spdlog level name; empty: warn
  // What from_environment() could not use (a value of the wrong form), logged as warnings by
  // the Runtime built from these options.
  std::vector<std::string> warnings;

  // The options above read from the CSA_* environment variables (README has the table).
  static RuntimeOptions from_environment();
};

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int cc_major = 0;
  int cc_minor = 0;
  int sm_count = 0;
  std::int64_t l2_bytes = 0;
  std::int64_t memory_bytes = 0;
};

struct DriverInfo {
  bool available = false;
  std::string reason;  // why not, when unavailable
  int driver_version = 0;
  std::vector<DeviceInfo> devices;
};

// One directory the kernel cache searches.
struct CacheLayer {
  std::string directory;
  bool read_only_layer = false;  // a layer of cache_layers / the prebuilt kernels: never written
  std::string state;             // "writable", "read-only", "absent ...", "refused: <why>"
  std::int64_t entries = 0;
  std::int64_t bytes = 0;
};

struct CacheInfo {
  std::string directory;     // the directory csa writes to
  bool persistent = false;   // false: memory only (unset, disabled, refused or read-only)
  std::int64_t entries = 0;  // in that directory and in memory
  std::int64_t bytes = 0;
  std::int64_t max_bytes = 0;      // the directory's bound (least recently used entries go)
  std::vector<CacheLayer> layers;  // search order; the first is `directory` (when set)
};

// One module (all kernels of a configuration for one arch) made ready by prewarm.
struct PrewarmReport {
  Config config;
  std::string arch;
  std::string key;        // cache key (hex)
  bool compiled = false;  // false: found in the disk cache
  std::string source;     // where the cubin was read from or stored: a directory, or "memory"
  double seconds = 0.0;
  int kernels = 0;
  int max_registers = -1;  // from the ptxas report, -1 if none
  int spill_bytes = -1;    // spill stores + loads over all kernels
  int stack_bytes = -1;    // largest stack frame (local memory)
  std::string ptxas_log;
};

struct OffsetReport {
  bool ok = true;
  int index = -1;  // first offending entry of cu_seqlens / cu_seqlens_comp
  std::string message;
};

class CSA_API Runtime {
 public:
  explicit Runtime(RuntimeOptions options = RuntimeOptions::from_environment());
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The process-wide default, created on first use from the environment.
  static Runtime& default_runtime();

  // Launch on `stream` in the calling thread's current CUDA context. Inputs are validated on
  // the host first; a rejected call launches nothing and leaves the outputs untouched.
  void forward(const ForwardArgs& args, Stream stream, Family family = Family::kAuto);
  void backward(const BackwardArgs& args, Stream stream, Family family = Family::kAuto);

  // Compile or load every kernel of `config` for a device (the same path a first call takes).
  PrewarmReport prewarm(const Config& config, int device, Family family = Family::kAuto);
  // Compile (or find in the disk cache) for an explicit arch such as "sm_90"; needs no driver.
  PrewarmReport compile_for_arch(const Config& config, std::string_view arch,
                                 Family family = Family::kAuto);

  // Checks the offset arrays on the device (synchronises `stream`).
  OffsetReport check_offsets(const std::int32_t* cu_seqlens, const std::int32_t* cu_seqlens_comp,
                             std::int32_t num_segments, std::int64_t total_tokens,
                             std::int64_t total_comp, std::int32_t ratio, Stream stream);

  // Schedule table (long-window family; SPEC §4). Replaces the table of the arch named inside
  // `json_text`; prepared records made under the old table are retired. Throws Error
  // (kInvalidArgument) naming `source_name`, the entry and the field of a malformed table.
  void set_schedule_table(std::string_view json_text, std::string_view source_name = "api");
  ScheduleChoice select_schedule(const Config& config, Direction direction, std::int64_t rows,
                                 std::string_view arch);
  // The table serving `arch`, as JSON (empty when none).
  std::string schedule_table_json(std::string_view arch);
  std::vector<std::string> schedule_table_archs();

  DriverInfo driver_info();
  CacheInfo cache_info() const;
  // The library, NVRTC, driver, devices, kernel cache (every layer) and the production set as
  // one JSON object (csa_info_json(), `csa info --json`, csa.info()).
  std::string info_json();
  std::int64_t clear_disk_cache();  // entries removed
  const RuntimeOptions& options() const;

  struct Impl;

 private:
  friend struct RuntimeAccess;  // the library's own units (src/api/runtime_impl.hpp)
  std::unique_ptr<Impl> impl_;
};

// A configuration prepared once on one device, for trainers: every kernel (each schedule
// bucket of both directions) is compiled or loaded by the constructor, so calls never compile,
// load or allocate for preparation, and skip the runtime's record lookup. Calls must come from
// a thread whose current device is `device`, with args.config equal to the plan's. A plan
// keeps its kernels when the runtime's schedule table changes; it must not outlive `runtime`.
class CSA_API Plan {
 public:
  Plan(Runtime& runtime, const Config& config, int device, Family family = Family::kAuto);
  ~Plan();
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  Plan(Plan&&) noexcept;
  Plan& operator=(Plan&&) noexcept;

  void forward(const ForwardArgs& args, Stream stream) const;
  void backward(const BackwardArgs& args, Stream stream) const;
  const Config& config() const;
  int device() const;
  Family family() const;  // the family resolved for this device (never kAuto)

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// Free functions on the default runtime.
CSA_API void forward(const ForwardArgs& args, Stream stream);
CSA_API void backward(const BackwardArgs& args, Stream stream);

CSA_API const char* version() noexcept;
CSA_API std::string nvrtc_version();
CSA_API std::vector<std::string> supported_archs();  // NVRTC targets, e.g. "sm_90"

// The checks of a call's configuration and sizes that forward() and backward() make before
// anything else (no pointers): throws Error(kInvalidArgument) naming the value.
CSA_API void validate_shape(const Config& config, std::int64_t total_tokens,
                            std::int32_t num_segments, std::int64_t total_comp);

// Parses and validates a schedule table without installing it (throws Error).
CSA_API void validate_schedule_table(std::string_view json_text, std::string_view source_name);

// The production configurations that `csa prewarm` compiles by default.
CSA_API std::vector<Config> default_configs();

}  // namespace csa
