// Benchmark inputs: packs of segments, seeded random tensors (kv, grad_out ~ N(0,1),
// score ~ N(0, 1.5^2), ape ~ N(0, 0.25^2)), and their byte counts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "csa/csa.hpp"
#include "csa/reference.hpp"
#include "csa/testing/device.hpp"

namespace csa::tools {

struct Pack {
  std::vector<std::int32_t> seqlens;
  std::string label;  // "3x8192"
};

// "3x8192" or "1023+2048+509".
Pack parse_pack(const std::string& text);

struct HostInputs {
  Config config;
  std::vector<std::int32_t> cu, cuc;
  std::int64_t total_tokens = 0;
  std::int64_t total_comp = 0;
  std::vector<std::uint16_t> kv, score, grad_out;
  std::vector<float> ape;
};

HostInputs make_inputs(const Config& config, const Pack& pack, std::uint64_t seed);

// The tensors of `in` as a call takes them: `dtype` elements, in SBHD one segment per batch
// column (the segments must have equal lengths: std::invalid_argument otherwise), kv / score
// rows `stride` elements apart (0: packed; the gaps hold 0xff).
struct LaidInputs {
  std::vector<std::uint8_t> kv, score, grad_out;
  std::int64_t seq_len = 0;  // SBHD: S
};
LaidInputs lay_out(const HostInputs& in, DType dtype, Layout layout, std::int64_t stride = 0);

// The CPU references' view of `in` laid out as `laid` (both must outlive it).
reference::HostProblem host_problem(const HostInputs& in, const LaidInputs& laid);

// One problem's inputs uploaded to the current device in the element type and layout of
// `host.config` (packed rows), with its output buffers sized from them, and the call arguments
// over them (sizes as `host` gives them: the benchmark's have no spare capacity, the GPU
// tests' do).
struct DeviceInputs {
  explicit DeviceInputs(HostInputs host);
  ForwardArgs forward() const;
  BackwardArgs backward(std::uint32_t flags = 0) const;
  static std::vector<std::uint16_t> download16(const device::Buffer& buffer);
  static std::vector<std::uint8_t> download(const device::Buffer& buffer);

  HostInputs in;
  std::int64_t seq_len = 0;  // SBHD: S
  device::Buffer cu, cuc, ape, kv, score, grad_out, out, grad_kv, grad_score, grad_ape;
};

// The tensors of config.tail for `in` (empty where a stage is off): the norm weight as
// config.tail.norm_weight_dtype bytes (values 1 + N(0, 0.1^2)), and RoPE tables (max_blocks,
// rope_dim / 2) of the angles block * ratio * 10000^(-2i / rope_dim), max_blocks covering the
// longest segment.
struct TailInputs {
  std::vector<std::uint8_t> weight;
  std::vector<float> weight_f32;  // the same values in fp32 (for references)
  std::vector<float> cos, sin;
  std::int64_t max_blocks = 0;
};
TailInputs make_tail_inputs(const Config& config, const HostInputs& in, std::uint64_t seed);

// The tail's tensors on the current device (16-byte placeholders where a stage is off) and the
// call's `csa::Tail` over them (eps: Tail's default); `host_tail` is the same over `t`'s host
// vectors, for the references.
struct DeviceTail {
  DeviceTail(const Config& config, const TailInputs& t);
  Tail tail() const;
  TailShape shape;
  std::int64_t max_blocks = 0;
  device::Buffer weight, cos, sin;
};
Tail host_tail(const Config& config, const TailInputs& t);

// Bytes the operation must move: each input read once, each output written once, elements of
// `element_bytes` (ape and grad_ape, which stay in L2, are not counted).
std::int64_t forward_bytes(const HostInputs& in, int element_bytes = 2);
std::int64_t backward_bytes(const HostInputs& in, int element_bytes = 2);

// Input sets to rotate so that back-to-back calls moving `bytes_per_call` each cycle through at
// least three times the L2 (every call then reads from DRAM): 2..256.
int rotation_sets(std::int64_t bytes_per_call, std::int64_t l2_bytes);

}  // namespace csa::tools
