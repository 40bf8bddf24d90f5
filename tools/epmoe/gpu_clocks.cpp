#include "gpu_clocks.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <type_traits>

#include "median.h"

namespace epmoe::cli {

// The few entry points of NVML's C ABI the sampler calls (nvml.h's names and signatures; its
// return codes are ints, 0 is NVML_SUCCESS, and a device is an opaque pointer).
struct NvmlDevice::Api {
  int (*init)();
  int (*shutdown)();
  int (*handle_by_pci_bus_id)(const char*, void**);
  int (*clock_info)(void*, int, unsigned*);
  int (*power_usage)(void*, unsigned*);
  int (*throttle_reasons)(void*, unsigned long long*);
};

namespace {

constexpr int kClockSm = 1;                               // nvmlClockType_t NVML_CLOCK_SM
constexpr unsigned long long kSoftwarePowerCap = 0x4ull;  // nvmlClocksThrottleReasonSwPowerCap

// Looks up every entry point, or names the first one missing.
std::optional<NvmlDevice::Api> load_api(void* library, std::string& missing) {
  NvmlDevice::Api api{};
  auto resolve = [&](auto& function, const char* name) {
    function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(library, name));
    if (function == nullptr && missing.empty()) missing = name;
  };
  resolve(api.init, "nvmlInit_v2");
  resolve(api.shutdown, "nvmlShutdown");
  resolve(api.handle_by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
  resolve(api.clock_info, "nvmlDeviceGetClockInfo");
  resolve(api.power_usage, "nvmlDeviceGetPowerUsage");
  // (the reasons' newer name, else the one older drivers export; the same call and bits)
  api.throttle_reasons =
      reinterpret_cast<decltype(api.throttle_reasons)>(dlsym(library, "nvmlDeviceGetCurrentClocksEventReasons"));
  if (api.throttle_reasons == nullptr) resolve(api.throttle_reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");
  if (!missing.empty()) return std::nullopt;
  return api;
}

}  // namespace

NvmlDevice::NvmlDevice(const std::string& pci_bus_id) {
  library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    unavailable_ = "libnvidia-ml.so.1 not found";
    return;
  }
  std::string missing;
  const std::optional<Api> loaded = load_api(library_, missing);
  if (!loaded) {
    unavailable_ = "libnvidia-ml.so.1 lacks " + missing;
    return;
  }
  if (const int error = loaded->init(); error != 0) {
    unavailable_ = "nvmlInit_v2 failed with code " + std::to_string(error);
    return;
  }
  api_ = std::make_unique<const Api>(*loaded);
  if (const int error = api_->handle_by_pci_bus_id(pci_bus_id.c_str(), &device_); error != 0) {
    unavailable_ = "no NVML device at PCI bus id " + pci_bus_id + " (code " + std::to_string(error) + ")";
    device_ = nullptr;
  }
}

NvmlDevice::~NvmlDevice() {
  if (api_ != nullptr) api_->shutdown();
  if (library_ != nullptr) dlclose(library_);
}

std::optional<ClockSample> NvmlDevice::sample() const {
  if (device_ == nullptr) return std::nullopt;
  ClockSample sample;
  unsigned long long reasons = 0;
  if (api_->clock_info(device_, kClockSm, &sample.sm_mhz) != 0 || api_->power_usage(device_, &sample.milliwatts) != 0 ||
      api_->throttle_reasons(device_, &reasons) != 0)
    return std::nullopt;
  sample.power_capped = (reasons & kSoftwarePowerCap) != 0;
  return sample;
}

std::optional<ClockReading> summarize(const std::vector<ClockSample>& samples) {
  if (samples.empty()) return std::nullopt;
  std::vector<double> mhz, watts;
  int capped = 0;
  for (const ClockSample& s : samples) {
    mhz.push_back(s.sm_mhz);
    watts.push_back(s.milliwatts / 1000.0);  // (correctly rounded, where * 1e-3 is not)
    capped += s.power_capped ? 1 : 0;
  }
  ClockReading reading;
  reading.median_sm_mhz = median(mhz);
  reading.min_sm_mhz = *std::min_element(mhz.begin(), mhz.end());
  reading.median_watts = median(watts);
  reading.power_capped_share = static_cast<double>(capped) / static_cast<double>(samples.size());
  reading.samples = static_cast<int>(samples.size());
  return reading;
}

int rest_until_uncapped(const NvmlDevice& device, int limit_ms) {
  constexpr int kPollMs = 5;
  const auto begin = std::chrono::steady_clock::now();
  auto waited_ms = [&] {
    return static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - begin).count());
  };
  while (waited_ms() < limit_ms) {
    if (const std::optional<ClockSample> sample = device.sample(); sample && !sample->power_capped) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
  }
  return waited_ms();
}

void ClockSampler::take() {
  if (const std::optional<ClockSample> sample = device_.sample()) samples_.push_back(*sample);
}

void ClockSampler::join() {
  if (!thread_.joinable()) return;
  running_ = false;
  thread_.join();
}

void ClockSampler::start() {
  join();
  samples_.clear();
  take();
  running_ = true;
  thread_ = std::thread([this] {
    while (running_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(period_ms_));
      if (running_) take();
    }
  });
}

std::optional<ClockReading> ClockSampler::stop() {
  const bool was_running = thread_.joinable();
  join();
  if (was_running) take();
  return summarize(samples_);
}

}  // namespace epmoe::cli
