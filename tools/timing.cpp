#include "timing.hpp"

#include <algorithm>
#include <chrono>

#include "csa/testing/device.hpp"

namespace csa::tools {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double time_device(Stream stream, int reps, int calls, const std::function<void(int)>& call) {
  device::Event start, stop;
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    start.record(stream);
    for (int i = 0; i < calls; ++i) call(i);
    stop.record(stream);
    stop.synchronize();
    samples.push_back(1000.0 * stop.milliseconds_since(start) / calls);
  }
  return median(samples);
}

double time_graph(Stream stream, int reps, int calls, const std::function<void(int)>& call) {
  device::Graph graph(stream, [&] {
    for (int i = 0; i < calls; ++i) call(i);
  });
  graph.launch(stream);
  device::synchronize(stream);
  device::Event start, stop;
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    start.record(stream);
    graph.launch(stream);
    stop.record(stream);
    stop.synchronize();
    samples.push_back(1000.0 * stop.milliseconds_since(start) / calls);
  }
  return median(samples);
}

double time_host(Stream stream, int samples, const std::function<void(int)>& call) {
  std::vector<double> times;
  for (int i = 0; i < samples; ++i) {
    device::synchronize(stream);
    const auto t0 = std::chrono::steady_clock::now();
    call(i);
    const auto t1 = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  device::synchronize(stream);
  return median(times);
}

}  // namespace csa::tools
