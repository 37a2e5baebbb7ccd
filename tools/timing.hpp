// Device timing for `csa bench` and `csa tune`: device events around back-to-back calls or
// around the replay of a CUDA graph of them, and the host's wall clock per call.
#pragma once

#include <functional>
#include <vector>

#include "csa/csa.hpp"

namespace csa::tools {

double median(std::vector<double> v);

// Median per-call microseconds of `calls` back-to-back calls, timed with events.
double time_device(Stream stream, int reps, int calls, const std::function<void(int)>& call);

// Median per-call microseconds of `calls` calls captured in one CUDA graph and replayed: the
// kernel time without the host's launch gaps.
double time_graph(Stream stream, int reps, int calls, const std::function<void(int)>& call);

// Median wall-clock microseconds of one call through the C++ API, issued to an idle stream:
// the host's own cost per call, not the pace of a full launch queue.
double time_host(Stream stream, int samples, const std::function<void(int)>& call);

}  // namespace csa::tools
