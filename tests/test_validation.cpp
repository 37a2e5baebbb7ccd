// Every host-side rejection (SPEC §3, §6): a clear error naming the argument, before anything is
// launched, outputs untouched. Runs without a GPU: validation never touches the driver or the
// buffers, so host memory stands in for device memory here.
#include <gtest/gtest.h>

#include <functional>

#include "csa/csa.h"
#include "test_util.hpp"

namespace csa::test {
namespace {

struct Buffers {
  // 16-byte aligned host storage with a recognisable pattern.
  alignas(16) std::uint16_t kv[4096];
  alignas(16) std::uint16_t score[4096];
  alignas(16) float ape[1024];
  alignas(16) std::int32_t cu[4] = {0, 64, 64, 64};
  alignas(16) std::int32_t cuc[4] = {0, 16, 16, 16};
  alignas(16) std::uint16_t out[4096];
  alignas(16) std::uint16_t grad_kv[4096];
  alignas(16) std::uint16_t grad_score[4096];
  alignas(16) float grad_ape[1024];
  Buffers() {
    std::fill(std::begin(out), std::end(out), 0xabcd);
    std::fill(std::begin(grad_kv), std::end(grad_kv), 0xabcd);
    std::fill(std::begin(grad_score), std::end(grad_score), 0xabcd);
    std::fill(std::begin(grad_ape), std::end(grad_ape), 42.0f);
  }
  bool untouched() const {
    auto same16 = [](const std::uint16_t* p, int n) {
      return std::all_of(p, p + n, [](auto v) { return v == 0xabcd; });
    };
    return same16(out, 4096) && same16(grad_kv, 4096) && same16(grad_score, 4096) &&
           std::all_of(std::begin(grad_ape), std::end(grad_ape),
                       [](float v) { return v == 42.0f; });
  }
};

class Validation : public ::testing::Test {
 protected:
  Validation() : runtime_(options()) {}
  static RuntimeOptions options() {
    RuntimeOptions o;
    o.disk_cache = false;
    return o;
  }
  ForwardArgs forward_args() {
    ForwardArgs a;
    a.kv = b_.kv;
    a.score = b_.score;
    a.ape = b_.ape;
    a.cu_seqlens = b_.cu;
    a.cu_seqlens_comp = b_.cuc;
    a.out = b_.out;
    a.total_tokens = 64;
    a.num_segments = 3;
    a.total_comp = 16;
    a.config = {4, 16, 2};
    return a;
  }
  BackwardArgs backward_args() {
    const ForwardArgs f = forward_args();
    BackwardArgs a;
    a.kv = f.kv;
    a.score = f.score;
    a.ape = f.ape;
    a.cu_seqlens = f.cu_seqlens;
    a.cu_seqlens_comp = f.cu_seqlens_comp;
    a.grad_out = b_.out;
    a.grad_kv = b_.grad_kv;
    a.grad_score = b_.grad_score;
    a.grad_ape = b_.grad_ape;
    a.total_tokens = f.total_tokens;
    a.num_segments = f.num_segments;
    a.total_comp = f.total_comp;
    a.config = f.config;
    return a;
  }
  // Expects `call` to throw `code` with a message containing `needle`, outputs untouched.
  void expect_rejected(const std::function<void()>& call, Status code, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(b_.untouched());
  }
  void forward_rejected(const std::function<void(ForwardArgs&)>& edit, Status code,
                        const std::string& needle) {
    ForwardArgs a = forward_args();
    edit(a);
    expect_rejected([&] { runtime_.forward(a, nullptr); }, code, needle);
  }
  void backward_rejected(const std::function<void(BackwardArgs&)>& edit, Status code,
                         const std::string& needle) {
    BackwardArgs a = backward_args();
    edit(a);
    expect_rejected([&] { runtime_.backward(a, nullptr); }, code, needle);
  }

  Runtime runtime_;
  Buffers b_;
};

constexpr auto kBad = Status::kInvalidArgument;

TEST_F(Validation, ElementTypeAndLayoutMustBeKnown) {
  forward_rejected([](auto& a) { a.config.dtype = static_cast<DType>(3); }, kBad, "dtype is 3");
  backward_rejected([](auto& a) { a.config.dtype = static_cast<DType>(-1); }, kBad, "dtype");
  forward_rejected([](auto& a) { a.config.layout = static_cast<Layout>(2); }, kBad, "layout is 2");
  forward_rejected([](auto& a) { a.seq_len = 64; }, kBad, "seq_len is 64 but the layout is THD");
}

// The fused tail: its stages (config.tail) and tensors (args.tail, rstd) must agree, and only
// the short-window forward serves it.
TEST_F(Validation, TailStagesAndTensorsMustAgree) {
  alignas(16) static float weight[16] = {};
  alignas(16) static float table[64] = {};
  auto norm = [](ForwardArgs& a) {
    a.config.tail.norm = true;
    a.tail.norm_weight = weight;
  };
  auto rope = [](ForwardArgs& a) {
    a.config.tail.rope_dim = 8;
    a.tail.rope_cos = table;
    a.tail.rope_sin = table;
    a.tail.rope_max_blocks = 16;
  };
  forward_rejected([](auto& a) { a.config.tail.norm = true; }, kBad,
                   "tail.norm_weight is null but config.tail.norm is true");
  forward_rejected([](auto& a) { a.tail.norm_weight = weight; }, kBad,
                   "tail.norm_weight is set but config.tail.norm is false");
  forward_rejected(
      [&](auto& a) {
        norm(a);
        a.tail.eps = -1.0f;
      },
      kBad, "tail.eps is -1");
  forward_rejected(
      [&](auto& a) {
        norm(a);
        a.config.tail.norm_weight_dtype = DType::kF16;
      },
      kBad, "config.tail.norm_weight_dtype is 1");
  forward_rejected(
      [&](auto& a) {
        norm(a);
        a.tail.norm_weight = reinterpret_cast<const char*>(weight) + 4;
      },
      kBad, "tail.norm_weight");
  forward_rejected([&](auto& a) { a.rstd = table; }, kBad, "rstd is set but config.tail.norm");
  forward_rejected(
      [&](auto& a) {
        rope(a);
        a.config.tail.rope_dim = 18;  // > head_dim 16
      },
      kBad, "config.tail.rope_dim is 18");
  forward_rejected(
      [&](auto& a) {
        rope(a);
        a.tail.rope_cos = nullptr;
      },
      kBad, "tail.rope_cos is null");
  forward_rejected(
      [&](auto& a) {
        rope(a);
        a.tail.rope_max_blocks = 0;
      },
      kBad, "tail.rope_max_blocks is 0");
  forward_rejected([&](auto& a) { a.tail.rope_cos = table; }, kBad,
                   "set but config.tail.rope_dim is 0");
  forward_rejected(
      [&](auto& a) {
        a.config = {4, 24, 2};  // head_dim 24: no power of two
        a.config.tail.hadamard = true;
      },
      kBad, "config.tail.hadamard needs a power-of-two head_dim, not 24");
  // SBHD: every block of S / ratio must have a table row.
  forward_rejected(
      [&](auto& a) {
        rope(a);
        a.config.layout = Layout::kSbhd;
        a.cu_seqlens = a.cu_seqlens_comp = nullptr;
        a.num_segments = 1;
        a.seq_len = 64;
        a.tail.rope_max_blocks = 15;
      },
      kBad, "gives 16 blocks");
  // Served: the short-window family, head_dim a power of two or a multiple of 32; the
  // long-window family (ratio > 16), head_dim a power of two.
  forward_rejected(
      [&](auto& a) {
        a.config = {32, 24, 2};
        norm(a);
        a.total_comp = 2;
      },
      Status::kUnsupported, "in the long-window family (ratio 32) needs head_dim a power of two");
  forward_rejected(
      [&](auto& a) {
        a.config = {4, 24, 2};
        a.config.tail.rope_dim = 8;
        rope(a);
      },
      Status::kUnsupported, "power of two or a multiple of 32, at most 1024, not 24");
  expect_rejected(
      [&] {
        ForwardArgs a = forward_args();
        norm(a);
        runtime_.forward(a, nullptr, Family::kReference);
      },
      Status::kUnsupported, "runs in the short-window and long-window families");
  // The long-window tail's pooled rows: with a tail only, 16-byte aligned.
  forward_rejected([&](auto& a) { a.pooled = table; }, kBad,
                   "pooled is set but config.tail has no stage");
  backward_rejected([&](auto& a) { a.pooled = table; }, kBad,
                    "pooled is set but config.tail has no stage");
  forward_rejected(
      [&](auto& a) {
        norm(a);
        a.pooled = table + 1;
      },
      kBad, "pooled (");
  backward_rejected(
      [](auto& a) {
        a.config.tail.norm = true;
        a.tail.norm_weight = weight;
      },
      kBad, "grad_norm_weight is null but config.tail.norm is true");
  backward_rejected([](auto& a) { a.grad_norm_weight = table; }, kBad,
                    "grad_norm_weight is set but config.tail.norm is false");
  backward_rejected(
      [](auto& a) {
        a.config.tail.norm = true;
        a.tail.norm_weight = weight;
        a.grad_norm_weight = table + 1;  // 4-byte aligned: fine; then a bad eps
        a.tail.eps = 0.0f;
      },
      kBad, "tail.eps is 0");
}

TEST_F(Validation, RowStridesKeepWidthAlignmentAndInt32Offsets) {
  // Width 32 (coff 2, head_dim 16): bf16 rows are read 16 bytes (8 elements) at a time.
  forward_rejected([](auto& a) { a.kv_stride = 31; }, kBad, "kv_stride is 31");
  forward_rejected([](auto& a) { a.score_stride = -32; }, kBad, "score_stride");
  forward_rejected([](auto& a) { a.kv_stride = 36; }, kBad, "multiple of 8");
  forward_rejected([](auto& a) { a.out_stride = 8; }, kBad, "out_stride is 8");
  forward_rejected([](auto& a) { a.out_stride = 20; }, kBad, "multiple of 8");
  backward_rejected([](auto& a) { a.grad_out_stride = 12; }, kBad, "grad_out_stride");
  backward_rejected([](auto& a) { a.grad_kv_stride = 40 + 4; }, kBad, "grad_kv_stride");
  backward_rejected([](auto& a) { a.grad_score_stride = 16; }, kBad, "grad_score_stride");
  // fp32 rows: 4 elements per 16 bytes.
  forward_rejected(
      [](auto& a) {
        a.config.dtype = DType::kF32;
        a.kv_stride = 34;
      },
      kBad, "multiple of 4");
  // An odd head_dim is read one element at a time: any stride >= the width keeps alignment.
  // The last strided row must end below 2^31 elements.
  forward_rejected([](auto& a) { a.kv_stride = std::int64_t{1} << 26; }, kBad,
                   "overflows int32 offsets");
}

TEST_F(Validation, SbhdSizesFollowFromSeqLenAndBatch) {
  auto sbhd = [](auto& a) {
    a.config.layout = Layout::kSbhd;
    a.cu_seqlens = nullptr;
    a.cu_seqlens_comp = nullptr;
    a.seq_len = 32;
    a.num_segments = 2;  // B
    a.total_tokens = 64;
    a.total_comp = 16;  // (32 / 4) * 2
  };
  forward_rejected(
      [&](auto& a) {
        sbhd(a);
        a.num_segments = 0;
        a.total_tokens = 0;
        a.total_comp = 0;
      },
      kBad, "batch B) is 0");
  forward_rejected(
      [&](auto& a) {
        sbhd(a);
        a.cu_seqlens = b_.cu;
      },
      kBad, "cu_seqlens is set but the layout is SBHD");
  backward_rejected(
      [&](auto& a) {
        sbhd(a);
        a.cu_seqlens_comp = b_.cuc;
      },
      kBad, "cu_seqlens_comp is set");
  forward_rejected(
      [&](auto& a) {
        sbhd(a);
        a.total_tokens = 65;
      },
      kBad, "total_tokens is 65 but SBHD");
  backward_rejected(
      [&](auto& a) {
        sbhd(a);
        a.total_comp = 17;
      },
      kBad, "total_comp is 17 but SBHD");
  forward_rejected(
      [&](auto& a) {
        sbhd(a);
        a.seq_len = -1;
      },
      kBad, "seq_len");
  forward_rejected(
      [&](auto& a) {
        sbhd(a);
        a.kv_stride = 33;
      },
      kBad, "kv_stride");
}

TEST_F(Validation, StridedAndSbhdBuffersNeedNoGpuWhenEmpty) {
  // Nothing to pool: accepted on the host with nothing launched (no GPU here).
  ForwardArgs a = forward_args();
  a.config.layout = Layout::kSbhd;
  a.cu_seqlens = nullptr;
  a.cu_seqlens_comp = nullptr;
  a.seq_len = 3;  // < ratio: no rows
  a.num_segments = 2;
  a.total_tokens = 6;
  a.total_comp = 0;
  a.kv_stride = 64;
  EXPECT_NO_THROW(runtime_.forward(a, nullptr));
  EXPECT_TRUE(b_.untouched());
}

TEST_F(Validation, ConfigurationEnvelope) {
  forward_rejected([](auto& a) { a.config.ratio = 0; }, kBad, "ratio");
  forward_rejected([](auto& a) { a.config.ratio = 257; }, kBad, "ratio");
  forward_rejected([](auto& a) { a.config.coff = 0; }, kBad, "coff");
  forward_rejected([](auto& a) { a.config.coff = 3; }, kBad, "coff");
  forward_rejected([](auto& a) { a.config.head_dim = 0; }, kBad, "head_dim");
  forward_rejected([](auto& a) { a.config.head_dim = 4097; }, kBad, "head_dim");
  backward_rejected([](auto& a) { a.config.ratio = -4; }, kBad, "ratio");
  backward_rejected([](auto& a) { a.config.head_dim = 100000; }, kBad, "head_dim");
}

TEST_F(Validation, RatiosBeyondTheShortWindowFamilyAreUnsupportedThere) {
  ForwardArgs f = forward_args();
  f.config.ratio = 32;
  f.total_comp = 2;
  expect_rejected([&] { runtime_.forward(f, nullptr, Family::kShortWindow); }, Status::kUnsupported,
                  "beyond the short-window family");
  BackwardArgs b = backward_args();
  b.config.ratio = 128;
  b.total_comp = 0;
  expect_rejected([&] { runtime_.backward(b, nullptr, Family::kShortWindow); },
                  Status::kUnsupported, "ratio 128");
}

TEST_F(Validation, Sizes) {
  forward_rejected([](auto& a) { a.num_segments = -1; }, kBad, "num_segments");
  forward_rejected([](auto& a) { a.total_tokens = -1; }, kBad, "total_tokens");
  forward_rejected([](auto& a) { a.total_comp = -3; }, kBad, "total_comp");
  forward_rejected(
      [](auto& a) {
        a.total_tokens = 3;
        a.total_comp = 1;
      },
      kBad, "total_tokens (3) < ratio (4)");
  backward_rejected([](auto& a) { a.total_tokens = 2; }, kBad, "ratio");
}

TEST_F(Validation, Int32Bounds) {
  // W = 2 * 16 = 32: 2^31 / 32 = 2^26 tokens is one too many; 2^26 - 1 passes the bound.
  forward_rejected([](auto& a) { a.total_tokens = std::int64_t{1} << 26; }, kBad,
                   "overflows int32");
  forward_rejected([](auto& a) { a.total_comp = std::int64_t{1} << 27; }, kBad, "overflows int32");
  backward_rejected([](auto& a) { a.total_tokens = std::int64_t{1} << 40; }, kBad, "total_tokens");
  backward_rejected(
      [](auto& a) {
        a.config.head_dim = 4096;
        a.total_comp = 1 << 19;
      },
      kBad, "total_comp");
}

TEST_F(Validation, NullPointers) {
  forward_rejected([](auto& a) { a.kv = nullptr; }, kBad, "kv is null");
  forward_rejected([](auto& a) { a.score = nullptr; }, kBad, "score is null");
  forward_rejected([](auto& a) { a.ape = nullptr; }, kBad, "ape is null");
  forward_rejected([](auto& a) { a.cu_seqlens = nullptr; }, kBad, "cu_seqlens is null");
  forward_rejected([](auto& a) { a.cu_seqlens_comp = nullptr; }, kBad, "cu_seqlens_comp is null");
  forward_rejected([](auto& a) { a.out = nullptr; }, kBad, "out is null");
  backward_rejected([](auto& a) { a.grad_out = nullptr; }, kBad, "grad_out is null");
  backward_rejected([](auto& a) { a.grad_kv = nullptr; }, kBad, "grad_kv is null");
  backward_rejected([](auto& a) { a.grad_score = nullptr; }, kBad, "grad_score is null");
  backward_rejected([](auto& a) { a.grad_ape = nullptr; }, kBad, "grad_ape is null");
}

TEST_F(Validation, NullIsFineForEmptyBuffers) {
  ForwardArgs a = forward_args();
  a.out = nullptr;
  a.total_comp = 0;
  EXPECT_NO_THROW(runtime_.forward(a, nullptr));  // nothing to write: no launch, no driver
  a.kv = nullptr;
  a.score = nullptr;
  a.total_tokens = 0;
  EXPECT_NO_THROW(runtime_.forward(a, nullptr));
  EXPECT_TRUE(b_.untouched());
}

TEST_F(Validation, MisalignedPointers) {
  auto off = [](const void* p, int bytes) { return static_cast<const char*>(p) + bytes; };
  forward_rejected([&](auto& a) { a.kv = off(b_.kv, 2); }, kBad, "kv (");
  forward_rejected([&](auto& a) { a.score = off(b_.score, 8); }, kBad, "16-byte aligned");
  forward_rejected([&](auto& a) { a.ape = reinterpret_cast<const float*>(off(b_.ape, 4)); }, kBad,
                   "ape");
  forward_rejected(
      [&](auto& a) { a.cu_seqlens = reinterpret_cast<const std::int32_t*>(off(b_.cu, 2)); }, kBad,
      "4-byte aligned");
  forward_rejected([&](auto& a) { a.out = const_cast<char*>(off(b_.out, 2)); }, kBad, "out");
  backward_rejected([&](auto& a) { a.grad_kv = const_cast<char*>(off(b_.grad_kv, 6)); }, kBad,
                    "grad_kv");
  backward_rejected([&](auto& a) { a.grad_out = off(b_.out, 2); }, kBad, "grad_out");
  backward_rejected(
      [&](auto& a) {
        a.grad_ape = reinterpret_cast<float*>(const_cast<char*>(off(b_.grad_ape, 4)));
      },
      kBad, "grad_ape");
}

TEST_F(Validation, UnknownFlags) {
  backward_rejected([](auto& a) { a.flags = 4; }, kBad, "flags");
}

TEST(CAbi, ReportsErrorsThroughStatusAndLastError) {
  alignas(16) static std::uint16_t buf[64];
  alignas(16) static float ape[64];
  alignas(16) static std::int32_t cu[2] = {0, 8};
  const int rc = csa_compressor_forward(buf, buf, ape, cu, cu, buf, 8, 1, 2, 4, 8, 3, nullptr);
  EXPECT_EQ(rc, CSA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(csa_last_error()).find("coff"), std::string::npos) << csa_last_error();
  EXPECT_EQ(csa_compressor_forward(buf, buf, ape, cu, cu, nullptr, 8, 1, 0, 4, 8, 2, nullptr),
            CSA_OK);
  EXPECT_STREQ(csa_last_error(), "");
  EXPECT_EQ(csa_compressor_backward(buf, buf, ape, cu, cu, buf, buf, buf, nullptr, 8, 1, 2, 4, 8, 2,
                                    0, nullptr),
            CSA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(csa_last_error()).find("grad_ape"), std::string::npos);
  EXPECT_STREQ(csa_version(), csa::version());
}

}  // namespace
}  // namespace csa::test
