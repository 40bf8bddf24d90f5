// The GPU's SM clock, board power and power-cap state while a measurement runs, sampled on a
// host thread through NVML. A GPU at its power limit lowers its clock under a long run of
// tensor-core work, so a time taken over hundreds of milliseconds of e4m3 GEMMs may come at a
// lower clock than the short GEMM that measured the floor's rate; the bench prints the clocks
// beside each figure so that a reader can tell. NVML is loaded at run time (the driver ships
// libnvidia-ml.so.1; the toolkit has neither its header nor a library to link): where it is
// missing or a call fails, the sampler reads nothing and the bench goes on without clocks.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace epmoe::cli {

// What the samples of one measured region say.
struct ClockReading {
  double median_sm_mhz = 0, min_sm_mhz = 0;
  double median_watts = 0;        // (recent drivers average the board's power over up to a second)
  double power_capped_share = 0;  // of the samples, those the driver marked as held down by the power cap
  int samples = 0;
};

// One sample of the GPU's state; what NvmlDevice::sample reads.
struct ClockSample {
  unsigned sm_mhz = 0, milliwatts = 0;
  bool power_capped = false;
};

// The median, the minimum and the capped share over `samples` (none: nullopt).
std::optional<ClockReading> summarize(const std::vector<ClockSample>& samples);

// NVML's handle of one GPU, opened by its PCI bus id (as cudaDeviceGetPCIBusId writes it).
class NvmlDevice {
 public:
  explicit NvmlDevice(const std::string& pci_bus_id);
  ~NvmlDevice();
  NvmlDevice(const NvmlDevice&) = delete;
  NvmlDevice& operator=(const NvmlDevice&) = delete;

  // Empty when the device was opened; else why not (the library or the call that failed).
  const std::string& unavailable_reason() const { return unavailable_; }
  std::optional<ClockSample> sample() const;

  struct Api;  // NVML's entry points (gpu_clocks.cpp)

 private:
  void* library_ = nullptr;
  std::unique_ptr<const Api> api_;  // set once NVML is initialised
  void* device_ = nullptr;
  std::string unavailable_;
};

// Waits, idle, until the driver no longer marks the clock as held down by the power cap (NVML
// polled every few ms), at most limit_ms; where NVML reads nothing, the whole limit. Returns the
// milliseconds waited. (After a long run of tensor work the card stays capped for a second or
// more: what is measured right after it runs at the lowered clock.)
int rest_until_uncapped(const NvmlDevice& device, int limit_ms);

// Samples `device` every `period_ms` from start() to stop(), on a thread of its own (and once
// at each end, so that a region shorter than the period still has a reading).
class ClockSampler {
 public:
  explicit ClockSampler(const NvmlDevice& device, int period_ms = 5) : device_(device), period_ms_(period_ms) {}
  ~ClockSampler() { join(); }
  ClockSampler(const ClockSampler&) = delete;
  ClockSampler& operator=(const ClockSampler&) = delete;

  void start();
  std::optional<ClockReading> stop();

 private:
  void take();
  void join();  // ends the sampling thread, if one runs
  const NvmlDevice& device_;
  const int period_ms_;
  std::atomic<bool> running_{false};
  std::thread thread_;
  std::vector<ClockSample> samples_;
};

}  // namespace epmoe::cli
