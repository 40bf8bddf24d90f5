// The bench's clock readings: the summary of a region's samples, and a sampler that reads
// nothing (no crash, no made-up figure) where NVML has no such device.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gpu_clocks.h"

namespace epmoe::cli {
namespace {

TEST(ClockSummary, TakesTheMedianTheMinimumAndTheCappedShare) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const size_t count : {size_t{1}, size_t{2}, size_t{7}, size_t{64}}) {
    SCOPED_TRACE("samples " + std::to_string(count));
    std::vector<ClockSample> samples(count);
    for (ClockSample& s : samples)
      s = {static_cast<unsigned>(1000 + rng() % 1000), static_cast<unsigned>(100000 + rng() % 600000), rng() % 3 == 0};
    std::vector<double> mhz, watts;
    int capped = 0;
    for (const ClockSample& s : samples)
      mhz.push_back(s.sm_mhz), watts.push_back(s.milliwatts / 1000.0), capped += s.power_capped;
    std::sort(mhz.begin(), mhz.end());
    std::sort(watts.begin(), watts.end());
    auto middle = [&](const std::vector<double>& v) { return (v[(count - 1) / 2] + v[count / 2]) / 2; };

    const std::optional<ClockReading> reading = summarize(samples);
    ASSERT_TRUE(reading.has_value());
    EXPECT_EQ(reading->samples, static_cast<int>(count));
    EXPECT_DOUBLE_EQ(reading->median_sm_mhz, middle(mhz));
    EXPECT_DOUBLE_EQ(reading->min_sm_mhz, mhz.front());
    EXPECT_NEAR(reading->median_watts, middle(watts), 1e-9);
    EXPECT_DOUBLE_EQ(reading->power_capped_share, static_cast<double>(capped) / count);
  }
}

TEST(ClockSummary, NoSamplesNoReading) { EXPECT_FALSE(summarize({}).has_value()); }

TEST(ClockSampler, ReadsNothingWhereNvmlHasNoSuchDevice) {
  // No such bus on any machine: without NVML the library is missing, with it the lookup fails.
  const NvmlDevice device("ffff:ff:1f.7");
  EXPECT_FALSE(device.unavailable_reason().empty());
  EXPECT_FALSE(device.sample().has_value());
  ClockSampler sampler(device, 1);
  sampler.start();
  EXPECT_FALSE(sampler.stop().has_value());
}

}  // namespace
}  // namespace epmoe::cli
