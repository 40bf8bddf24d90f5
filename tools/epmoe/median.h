// The median the bench reports its timings and clock readings by.
#pragma once

#include <algorithm>
#include <vector>

namespace epmoe::cli {

// The median of `values` (the upper one of the middle two for an even count); not empty.
template <typename T>
T median(std::vector<T> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

}  // namespace epmoe::cli
