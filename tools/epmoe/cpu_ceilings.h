// The two ceilings of this CPU, measured at start so a benchmark's floor is this machine's:
// memory bandwidth (a large multithreaded copy, bytes read + written) and the f32
// multiply-add rate of code built like ours.
#pragma once

namespace epmoe::cli {

struct Ceilings {
  double bytes_per_second = 0;
  double flops_per_second = 0;
};

Ceilings measure_cpu_ceilings(int threads);

}  // namespace epmoe::cli
