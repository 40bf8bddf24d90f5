// A stand-in for the driver's libnvidia-ml.so.1, with NVML's C ABI for the calls the bench's
// clock sampler makes (tools/epmoe/gpu_clocks.cpp), so that its loading and sampling run in CI,
// where no driver is installed. One device, at kBusId; what it reports is what the test last
// set through fake_nvml_set. Return codes as NVML's: 0 success, 1 uninitialised, 2 invalid
// argument, 6 not found.
#include <atomic>
#include <cstring>

namespace {
constexpr const char* kBusId = "0000:01:00.0";
std::atomic<bool> initialised{false};
std::atomic<unsigned> sm_mhz{0}, milliwatts{0};
std::atomic<unsigned long long> reasons{0};
int device_token;  // the device handle points here
}  // namespace

extern "C" {

void fake_nvml_set(unsigned mhz, unsigned mw, unsigned long long event_reasons) {
  sm_mhz = mhz, milliwatts = mw, reasons = event_reasons;
}

int nvmlInit_v2() {
  initialised = true;
  return 0;
}

int nvmlShutdown() {
  initialised = false;
  return 0;
}

int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  if (!initialised) return 1;
  if (bus_id == nullptr || device == nullptr) return 2;
  if (std::strcmp(bus_id, kBusId) != 0) return 6;
  *device = &device_token;
  return 0;
}

int nvmlDeviceGetClockInfo(void* device, int clock_type, unsigned* mhz) {
  if (!initialised) return 1;
  if (device != &device_token || clock_type != 1 || mhz == nullptr) return 2;  // 1: NVML_CLOCK_SM
  *mhz = sm_mhz;
  return 0;
}

int nvmlDeviceGetPowerUsage(void* device, unsigned* mw) {
  if (!initialised) return 1;
  if (device != &device_token || mw == nullptr) return 2;
  *mw = milliwatts;
  return 0;
}

int nvmlDeviceGetCurrentClocksEventReasons(void* device, unsigned long long* event_reasons) {
  if (!initialised) return 1;
  if (device != &device_token || event_reasons == nullptr) return 2;
  *event_reasons = reasons;
  return 0;
}

}  // extern "C"
