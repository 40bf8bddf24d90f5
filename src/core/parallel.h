// parallel_for: runs body(i) for i in [0, count) on a few threads. Items write disjoint
// outputs, so results do not depend on the schedule.
#pragma once

#include <cstdint>
#include <functional>

namespace epmoe {

int default_thread_count();

void parallel_for(int64_t count, int num_threads, const std::function<void(int64_t)>& body);

}  // namespace epmoe
