#include "cpu_ceilings.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace epmoe::cli {

namespace {

volatile float g_sink;  // a result nothing can optimise away

template <typename Work>
double best_seconds(int repeats, Work work) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    work();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

template <typename Body>
void on_threads(int threads, Body body) {
  std::vector<std::jthread> workers;
  for (int t = 1; t < threads; ++t) workers.emplace_back(body, t);
  body(0);
}

// Independent multiply-add chains, wide enough for the vector units to stay busy.
float fma_chains(int64_t iterations, float seed) {
  constexpr int kChains = 64;
  float acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = seed + static_cast<float>(i);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma omp simd
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  }
  float sum = 0;
  for (float value : acc) sum += value;
  return sum;
}

}  // namespace

Ceilings measure_cpu_ceilings(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Ceilings ceilings;
  constexpr size_t kBytes = size_t{256} << 20;
  std::vector<char> source(kBytes, 1), target(kBytes, 0);
  const size_t slice = kBytes / threads;
  const double copy = best_seconds(3, [&] {
    on_threads(threads, [&](int t) { std::memcpy(target.data() + t * slice, source.data() + t * slice, slice); });
  });
  ceilings.bytes_per_second = 2.0 * static_cast<double>(slice * threads) / copy;

  constexpr int64_t kIterations = 20'000'000;
  const double compute = best_seconds(3, [&] {
    on_threads(threads, [&](int t) { g_sink = fma_chains(kIterations, static_cast<float>(t)); });
  });
  ceilings.flops_per_second = 2.0 * 64 * static_cast<double>(kIterations) * threads / compute;
  return ceilings;
}

}  // namespace epmoe::cli
