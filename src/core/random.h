// A small, fast, seedable generator (splitmix64) for test and benchmark data. Streams are
// keyed by (seed, stream id), so an expert's weights do not depend on which experts were
// drawn before it.
#pragma once

#include <cstdint>

namespace epmoe {

class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream) : state_(seed * 0x9e3779b97f4a7c15ull ^ (stream + 0x632be59bd9b4e019ull)) {
    next();
  }

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [low, high).
  float uniform(float low, float high) {
    return low + (high - low) * static_cast<float>(next() >> 40) * 0x1p-24f;
  }
  // Uniform with mean 0 and standard deviation `stddev`.
  float centered(float stddev) { return uniform(-1.7320508f * stddev, 1.7320508f * stddev); }

 private:
  uint64_t state_;
};

}  // namespace epmoe
