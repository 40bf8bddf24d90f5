// The bench's clock readings: the summary of a region's samples; the sampler through NVML's
// C ABI, against this build's fake libnvidia-ml.so.1 (tests/fake_nvml.cpp, which ctest puts
// first on LD_LIBRARY_PATH); and a sampler that reads nothing (no crash, no made-up figure)
// where NVML has no such device.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <thread>
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
    auto middle = [&](const std::vector<double>& v) { return v[count / 2]; };  // the upper of an even count's two

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

// Tests against this build's fake NVML (tests/fake_nvml.cpp), opened for its setter: set(SM
// MHz, milliwatts, clock event reasons) is what the driver reports next.
class FakeNvml : public ::testing::Test {
 protected:
  void SetUp() override {
    library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(library_, nullptr) << "run through ctest, which puts this build's fake NVML on LD_LIBRARY_PATH";
    set = reinterpret_cast<void (*)(unsigned, unsigned, unsigned long long)>(dlsym(library_, "fake_nvml_set"));
    ASSERT_NE(set, nullptr) << "libnvidia-ml.so.1 here is not this build's fake (tests/fake_nvml.cpp)";
  }
  void TearDown() override {
    if (library_ != nullptr) dlclose(library_);
  }
  static constexpr unsigned long long kSoftwarePowerCap = 0x4;
  void (*set)(unsigned, unsigned, unsigned long long) = nullptr;

 private:
  void* library_ = nullptr;
};

TEST_F(FakeNvml, TheSamplerReadsWhatTheDriverReports) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const unsigned first_mhz = 1500 + rng() % 500, second_mhz = 1000 + rng() % 500;  // the second lower
  const unsigned first_mw = 200000 + rng() % 100000, second_mw = 600000 + rng() % 100000;
  constexpr unsigned long long kOtherReasons = 0x1 | 0x20;

  set(first_mhz, first_mw, kOtherReasons);
  {
    const NvmlDevice device("0000:01:00.0");
    ASSERT_EQ(device.unavailable_reason(), "");
    const std::optional<ClockSample> sample = device.sample();
    ASSERT_TRUE(sample.has_value());
    EXPECT_EQ(sample->sm_mhz, first_mhz);
    EXPECT_EQ(sample->milliwatts, first_mw);
    EXPECT_FALSE(sample->power_capped);  // other reasons than the power cap

    // A region of two phases; start() samples the first, stop() the second, the thread both.
    ClockSampler sampler(device, 1);
    sampler.start();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    set(second_mhz, second_mw, kSoftwarePowerCap | kOtherReasons);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const std::optional<ClockReading> reading = sampler.stop();
    ASSERT_TRUE(reading.has_value());
    EXPECT_GE(reading->samples, 3);
    EXPECT_EQ(reading->min_sm_mhz, second_mhz);
    EXPECT_GE(reading->median_sm_mhz, second_mhz);
    EXPECT_LE(reading->median_sm_mhz, first_mhz);
    EXPECT_GE(reading->median_watts, first_mw / 1000.0);
    EXPECT_LE(reading->median_watts, second_mw / 1000.0);
    EXPECT_GT(reading->power_capped_share, 0.0);  // the second phase's samples, and only those
    EXPECT_LT(reading->power_capped_share, 1.0);
  }
}

// The rest before a measurement: over at once on an uncapped card, over when the driver clears
// the cap, the whole limit while it stays capped or where NVML reads nothing.
TEST_F(FakeNvml, TheRestWaitsUntilThePowerCapClears) {
  const NvmlDevice device("0000:01:00.0");
  ASSERT_EQ(device.unavailable_reason(), "");
  set(1980, 300000, 0);
  EXPECT_LT(rest_until_uncapped(device, 5000), 1000);
  set(1400, 690000, kSoftwarePowerCap);
  EXPECT_GE(rest_until_uncapped(device, 60), 60);
  std::thread clear([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(80));
    set(1980, 300000, 0);
  });
  const int waited = rest_until_uncapped(device, 5000);
  clear.join();
  EXPECT_GE(waited, 80);
  EXPECT_LT(waited, 5000);
  const NvmlDevice absent("ffff:ff:1f.7");
  EXPECT_GE(rest_until_uncapped(absent, 40), 40);
}

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
