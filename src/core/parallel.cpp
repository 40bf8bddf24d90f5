#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace epmoe {

int default_thread_count() { return std::max(1u, std::thread::hardware_concurrency()); }

void parallel_for(int64_t count, int num_threads, const std::function<void(int64_t)>& body) {
  if (num_threads <= 0) num_threads = default_thread_count();
  const int workers = static_cast<int>(std::min<int64_t>(num_threads, count));
  if (workers <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto drain = [&] {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) body(i);
  };
  std::vector<std::jthread> threads;
  for (int w = 1; w < workers; ++w) threads.emplace_back(drain);
  drain();
}

}  // namespace epmoe
