// A trainer-style loop over csa's public API: three compressor layers (CSA 4,2,128 and
// 4,2,512, HCA 128,1,512) with static capacities. Each layer is prepared once (csa::Plan),
// forward + backward of all layers are captured into one CUDA graph, and the graph is replayed
// while the packed sequence lengths change from step to step (only the offset arrays' contents
// change). Every step is checked bit for bit against direct calls of the same plans.
//
// Without a GPU it says so and exits 0 (CI builds it; the GPU machine runs it).
#include <csa/csa.hpp>
#include <csa/testing/device.hpp>
#include <csa/reference.hpp>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr std::int64_t kTokenCapacity = 8192 + 21;
constexpr std::int32_t kSegmentCapacity = 4;

struct Layer {
  csa::Config config;
  csa::Plan plan;
  std::int64_t row_capacity;
  csa::device::Buffer kv, score, ape, cu, cuc, grad_out;
  // Outputs of the graph and of the direct calls.
  csa::device::Buffer out[2], grad_kv[2], grad_score[2], grad_ape[2];

  Layer(csa::Runtime& rt, const csa::Config& c, std::mt19937& rng)
      : config(c),
        plan(rt, c, 0),
        row_capacity(kTokenCapacity / c.ratio + 8),
        kv(bytes16(kTokenCapacity * width())),
        score(bytes16(kTokenCapacity * width())),
        ape(sizeof(float) * c.ratio * width()),
        cu(sizeof(std::int32_t) * (kSegmentCapacity + 1)),
        cuc(sizeof(std::int32_t) * (kSegmentCapacity + 1)),
        grad_out(bytes16(row_capacity * c.head_dim)),
        out{csa::device::Buffer(bytes16(row_capacity * c.head_dim)),
            csa::device::Buffer(bytes16(row_capacity * c.head_dim))},
        grad_kv{csa::device::Buffer(bytes16(kTokenCapacity * width())),
                csa::device::Buffer(bytes16(kTokenCapacity * width()))},
        grad_score{csa::device::Buffer(bytes16(kTokenCapacity * width())),
                   csa::device::Buffer(bytes16(kTokenCapacity * width()))},
        grad_ape{csa::device::Buffer(sizeof(float) * c.ratio * width()),
                 csa::device::Buffer(sizeof(float) * c.ratio * width())} {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto random_bf16 = [&](csa::device::Buffer& b, float scale) {
      std::vector<std::uint16_t> h(b.size() / 2);
      for (auto& x : h) x = csa::reference::float_to_bf16(scale * normal(rng));
      b.upload(h.data(), b.size());
    };
    random_bf16(kv, 1.0f);
    random_bf16(score, 1.5f);
    random_bf16(grad_out, 1.0f);
    std::vector<float> a(ape.size() / sizeof(float));
    for (auto& x : a) x = 0.25f * normal(rng);
    ape.upload(a.data(), ape.size());
  }
  std::int64_t width() const { return static_cast<std::int64_t>(config.coff) * config.head_dim; }
  static std::size_t bytes16(std::int64_t n) { return static_cast<std::size_t>(n) * 2; }

  // The true lengths of this step, padded to the static segment capacity with empty segments.
  void set_lengths(const std::vector<std::int32_t>& lens) {
    std::vector<std::int32_t> h_cu = {0}, h_cuc = {0};
    for (std::int32_t s = 0; s < kSegmentCapacity; ++s) {
      const std::int32_t len = s < static_cast<std::int32_t>(lens.size()) ? lens[s] : 0;
      h_cu.push_back(h_cu.back() + len);
      h_cuc.push_back(h_cuc.back() + len / config.ratio);
    }
    cu.upload(h_cu.data(), cu.size());
    cuc.upload(h_cuc.data(), cuc.size());
  }

  csa::ForwardArgs forward_args(int which) const {
    csa::ForwardArgs f;
    f.kv = kv.get();
    f.score = score.get();
    f.ape = ape.as<float>();
    f.cu_seqlens = cu.as<std::int32_t>();
    f.cu_seqlens_comp = cuc.as<std::int32_t>();
    f.out = out[which].get();
    f.total_tokens = kTokenCapacity;
    f.num_segments = kSegmentCapacity;
    f.total_comp = row_capacity;
    f.config = config;
    return f;
  }
  csa::BackwardArgs backward_args(int which) const {
    csa::BackwardArgs b;
    b.kv = kv.get();
    b.score = score.get();
    b.ape = ape.as<float>();
    b.cu_seqlens = cu.as<std::int32_t>();
    b.cu_seqlens_comp = cuc.as<std::int32_t>();
    b.grad_out = grad_out.get();
    b.grad_kv = grad_kv[which].get();
    b.grad_score = grad_score[which].get();
    b.grad_ape = grad_ape[which].as<float>();
    b.total_tokens = kTokenCapacity;
    b.num_segments = kSegmentCapacity;
    b.total_comp = row_capacity;
    b.config = config;
    b.flags = csa::kDeterministic;  // bitwise grad_ape, so graph and direct calls compare exactly
    return b;
  }
};

bool same(const csa::device::Buffer& a, const csa::device::Buffer& b) {
  std::vector<unsigned char> x(a.size()), y(b.size());
  a.download(x.data(), x.size());
  b.download(y.data(), y.size());
  return x == y;
}

}  // namespace

int main() try {
  csa::Runtime rt;
  const csa::DriverInfo info = rt.driver_info();
  if (!info.available || info.devices.empty()) {
    std::printf("trainer_loop: no GPU (%s); skipped\n",
                info.available ? "no device" : info.reason.c_str());
    return 0;
  }
  csa::device::make_current(0);
  csa::device::StreamHandle stream;
  std::mt19937 rng(20261129);
  std::vector<Layer> layers;
  layers.reserve(3);
  for (const csa::Config c :
       {csa::Config{4, 128, 2}, csa::Config{4, 512, 2}, csa::Config{128, 512, 1}})
    layers.emplace_back(rt, c, rng);  // csa::Plan prepares every kernel here

  // Capture forward + backward of every layer once, at the static capacities.
  for (auto& l : layers) l.set_lengths({8192});
  csa::device::Graph graph(stream.get(), [&] {
    for (auto& l : layers) {
      l.plan.forward(l.forward_args(0), stream.get());
      l.plan.backward(l.backward_args(0), stream.get());
    }
  });

  const std::vector<std::vector<std::int32_t>> steps = {
      {8192}, {4096, 4000}, {1023, 2048, 509, 3000}, {300, 0, 7000}, {129}};
  int failures = 0;
  for (std::size_t step = 0; step < steps.size(); ++step) {
    for (auto& l : layers) l.set_lengths(steps[step]);
    graph.launch(stream.get());
    for (auto& l : layers) {
      l.plan.forward(l.forward_args(1), stream.get());
      l.plan.backward(l.backward_args(1), stream.get());
    }
    stream.synchronize();
    for (const auto& l : layers) {
      const bool ok = same(l.out[0], l.out[1]) && same(l.grad_kv[0], l.grad_kv[1]) &&
                      same(l.grad_score[0], l.grad_score[1]) && same(l.grad_ape[0], l.grad_ape[1]);
      std::printf("step %zu ratio=%d coff=%d head_dim=%d: graph replay %s direct calls\n", step,
                  l.config.ratio, l.config.coff, l.config.head_dim,
                  ok ? "matches" : "DIFFERS FROM");
      failures += ok ? 0 : 1;
    }
  }
  std::printf("trainer_loop: %s\n", failures == 0 ? "all steps match" : "MISMATCH");
  return failures == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "trainer_loop: %s\n", e.what());
  return 1;
}
