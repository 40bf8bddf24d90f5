// epmoe bench --device cuda. Measures the device's two ceilings (a 2 GiB device-to-device
// copy, bytes read + written; an 8192^3 bf16 cuBLAS GEMM on random data, or for fp8 schemes
// an 8192^3 e4m3 cuBLASLt GEMM: the copy and the GEMM's burst rate before the timed calls, its
// sustained rate, the floor's, after them: RatePhase), fills rank 0's local experts with random
// weights (bf16, or e4m3 codes with their scales) on the device, and for each T times
// replays of one CUDA graph with CUDA events (queued back to back, so the host's launch cost
// is not in the figure); the graph holds several calls in a row, rotating over input sets
// (and, where the weights are small, weight copies) so no call finds the previous call's
// weights in L2, and a call's time is the replay's / calls. Prints the median beside the
// floor of DESIGN.md.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "bench_cuda.h"
#include "commands.h"
#include "epmoe/device_case.h"
#include "epmoe/moe_cuda.h"
#include "epmoe/quantize.h"
#include "gpu_clocks.h"

namespace epmoe::cli {

namespace {

// A CUDA call of the bench: a failure ends the command, naming the call and the runtime's reason.
#define BENCH_CHECK(expr)                                                                             \
  do {                                                                                                \
    const cudaError_t bench_error_ = (expr);                                                          \
    if (bench_error_ != cudaSuccess)                                                                  \
      return run_error("bench", std::string(#expr) + " failed: " + cudaGetErrorString(bench_error_)); \
  } while (0)

// Uniform values in [-scale * sqrt(3), scale * sqrt(3)) from a counter hash (unit variance *
// scale), stored as bf16, or as e4m3 codes (saturating).
template <typename Element>
__global__ void fill_random(Element* data, int64_t count, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (static_cast<uint64_t>(i) + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float value = (static_cast<float>(z >> 40) * 0x1p-24f * 2.0f - 1.0f) * 1.7320508f * scale;
    if constexpr (sizeof(Element) == 2) {
      data[i] = __bfloat16_as_ushort(__float2bfloat16_rn(value));
    } else {
      data[i] = __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

cudaError_t fill(void* data, int64_t count, uint64_t seed, float scale) {
  fill_random<<<1024, 256>>>(static_cast<uint16_t*>(data), count, seed, scale);
  return cudaGetLastError();
}

cudaError_t fill_fp8(void* data, int64_t count, uint64_t seed, float scale) {
  fill_random<<<1024, 256>>>(static_cast<uint8_t*>(data), count, seed, scale);
  return cudaGetLastError();
}

__global__ void fill_constant(float* data, int64_t count, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    data[i] = value;
}

// A GEMM's tensor rate, flop/s, and the clocks it ran at; two ways (RatePhase).
struct RateReading {
  double flops_per_second = 0;
  std::optional<ClockReading> clocks;
};
// Burst: 10 runs, each timed alone after a warm-up, the card rested (rest_until_uncapped) and
// at its boost clock; measured before the timed calls. Sustained: blocks of back-to-back runs
// after kSustainMs of them, the card at its power limit as the layer's timed replays run (a
// few hundred ms back to back at large T): DESIGN.md's ceiling and the floor's; measured after
// the timed calls, so that the clock it leaves held down does not fall on them. (On an H100
// the bench's T=16384 layers ran at 1440-1550 MHz while a burst GEMM ran at 1980, and the
// calls timed right after a sustained GEMM at ~1305 for a second or more; docs/KERNELS.md,
// thirtieth session.)
enum class RatePhase { kBurst, kSustained };
struct GemmRate {
  RateReading burst, sustained;
  RateReading& at(RatePhase phase) { return phase == RatePhase::kBurst ? burst : sustained; }
};

struct DeviceCeilings {
  double bytes_per_second = 0;
  GemmRate bf16;
  std::optional<GemmRate> e4m3;  // fp8 schemes: the floor's rate
  const GemmRate& floor_rate() const { return e4m3 ? *e4m3 : bf16; }
};

// The median time in ms of `repeats` runs of work(i) on the default stream, by CUDA events;
// an error of the event calls, or one the work left (cudaGetLastError), fails it.
template <typename Work>
Result<float> median_ms(int repeats, Work work) {
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t error = cudaEventCreate(&start);
  if (error == cudaSuccess) error = cudaEventCreate(&stop);
  std::vector<float> times;
  for (int i = 0; i < repeats && error == cudaSuccess; ++i) {
    error = cudaEventRecord(start);
    work(i);
    float ms = 0;
    if (error == cudaSuccess) error = cudaEventRecord(stop);
    if (error == cudaSuccess) error = cudaEventSynchronize(stop);
    if (error == cudaSuccess) error = cudaEventElapsedTime(&ms, start, stop);
    if (error == cudaSuccess) error = cudaGetLastError();
    times.push_back(ms);
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (error != cudaSuccess) return Status::io_error(std::string("timing a ceiling: ") + cudaGetErrorString(error));
  return median(times);
}

// gemm(i) queues one run of `flops` on the default stream (its own errors it keeps for the
// caller to check).
template <typename Gemm>
Result<RateReading> measure_gemm_rate(double flops, RatePhase phase, ClockSampler& sampler, Gemm gemm) {
  constexpr double kSustainMs = 200, kBlockMs = 10;
  constexpr int kSamples = 10;
  const Result<float> run_ms = median_ms(3, gemm);  // (also the warm-up)
  if (!run_ms.ok()) return run_ms.status();
  if (!(run_ms.value() > 0)) return Status::io_error("a ceiling's GEMM took no time");
  int runs_per_sample = 1;
  if (phase == RatePhase::kSustained) {
    for (int i = 0; i < static_cast<int>(std::ceil(kSustainMs / run_ms.value())); ++i) gemm(i);
    runs_per_sample = std::max(1, static_cast<int>(std::ceil(kBlockMs / run_ms.value())));
  }
  RateReading rate;
  sampler.start();
  const Result<float> sample_ms = median_ms(kSamples, [&](int) {
    for (int i = 0; i < runs_per_sample; ++i) gemm(i);
  });
  rate.clocks = sampler.stop();
  if (!sample_ms.ok()) return sample_ms.status();
  rate.flops_per_second = flops * runs_per_sample / (sample_ms.value() * 1e-3);
  return rate;
}

// The device copy's rate, bytes read + written a second.
Result<double> measure_copy_rate() {
  constexpr size_t kCopyBytes = size_t{2} << 30;
  Result<DeviceBuffer> source = DeviceBuffer::allocate(kCopyBytes), target = DeviceBuffer::allocate(kCopyBytes);
  if (!source.ok()) return source.status();
  if (!target.ok()) return target.status();
  if (fill(source->data(), kCopyBytes / 2, 7, 1.0f) != cudaSuccess) return Status::io_error("fill failed");
  if (cudaMemcpy(target->data(), source->data(), kCopyBytes, cudaMemcpyDeviceToDevice) != cudaSuccess)  // warm-up
    return Status::io_error("the ceiling's device copy failed");
  const Result<float> copy_ms =
      median_ms(10, [&](int) { cudaMemcpyAsync(target->data(), source->data(), kCopyBytes, cudaMemcpyDeviceToDevice); });
  if (!copy_ms.ok()) return copy_ms.status();
  return 2.0 * kCopyBytes / (copy_ms.value() * 1e-3);
}

// The bf16 tensor rate: an 8192^3 cuBLAS GEMM on random data.
Result<RateReading> measure_bf16_rate(RatePhase phase, ClockSampler& sampler) {
  constexpr int kN = 8192;
  const size_t matrix_bytes = size_t{kN} * kN * 2;
  Result<DeviceBuffer> a = DeviceBuffer::allocate(matrix_bytes), b = DeviceBuffer::allocate(matrix_bytes),
                       c = DeviceBuffer::allocate(matrix_bytes);
  if (!a.ok() || !b.ok() || !c.ok()) return Status(StatusCode::kOutOfMemory, "GEMM ceiling buffers");
  if (fill(a->data(), int64_t{kN} * kN, 11, 1.0f) != cudaSuccess ||
      fill(b->data(), int64_t{kN} * kN, 12, 1.0f) != cudaSuccess)
    return Status::io_error("fill failed");
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return Status::io_error("cublasCreate failed");
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t gemm_status = CUBLAS_STATUS_SUCCESS;
  auto gemm = [&](int) {
    if (gemm_status != CUBLAS_STATUS_SUCCESS) return;
    gemm_status = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, kN, kN, kN, &alpha, a->data(), CUDA_R_16BF, kN,
                               b->data(), CUDA_R_16BF, kN, &beta, c->data(), CUDA_R_16BF, kN, CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT);
  };
  Result<RateReading> rate = measure_gemm_rate(2.0 * kN * kN * double{kN}, phase, sampler, gemm);
  cublasDestroy(handle);
  if (gemm_status != CUBLAS_STATUS_SUCCESS) return Status::io_error("cublasGemmEx failed");
  return rate;
}

// The e4m3 tensor rate: an 8192^3 cuBLASLt GEMM (A^T B, both K-major e4m3, f32 accumulate,
// bf16 out) on random codes.
Result<RateReading> measure_e4m3_rate(RatePhase phase, ClockSampler& sampler) {
  constexpr int kN = 8192;
  constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  Result<DeviceBuffer> a = DeviceBuffer::allocate(size_t{kN} * kN), b = DeviceBuffer::allocate(size_t{kN} * kN),
                       c = DeviceBuffer::allocate(size_t{kN} * kN * 2), workspace = DeviceBuffer::allocate(kWorkspaceBytes);
  if (!a.ok() || !b.ok() || !c.ok() || !workspace.ok()) return Status(StatusCode::kOutOfMemory, "fp8 GEMM ceiling buffers");
  if (fill_fp8(a->data(), int64_t{kN} * kN, 13, 8.0f) != cudaSuccess || fill_fp8(b->data(), int64_t{kN} * kN, 14, 8.0f) != cudaSuccess)
    return Status::io_error("fill failed");
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a_layout = nullptr, b_layout = nullptr, c_layout = nullptr;
  const cublasOperation_t transpose = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  cublasStatus_t status = cublasLtCreate(&handle);
  if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatmulDescCreate(&operation, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulDescSetAttribute(operation, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulDescSetAttribute(operation, CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof(plain));
  if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatrixLayoutCreate(&a_layout, CUDA_R_8F_E4M3, kN, kN, kN);
  if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatrixLayoutCreate(&b_layout, CUDA_R_8F_E4M3, kN, kN, kN);
  if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatrixLayoutCreate(&c_layout, CUDA_R_16BF, kN, kN, kN);
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&](int) {
    if (status != CUBLAS_STATUS_SUCCESS) return;
    status = cublasLtMatmul(handle, operation, &alpha, a->data(), a_layout, b->data(), b_layout, &beta, c->data(),
                            c_layout, c->data(), c_layout, nullptr, workspace->data(), kWorkspaceBytes, nullptr);
  };
  const Result<RateReading> rate = measure_gemm_rate(2.0 * kN * kN * double{kN}, phase, sampler, gemm);
  for (cublasLtMatrixLayout_t layout : {a_layout, b_layout, c_layout})
    if (layout) cublasLtMatrixLayoutDestroy(layout);
  if (operation) cublasLtMatmulDescDestroy(operation);
  if (handle) cublasLtDestroy(handle);
  if (status != CUBLAS_STATUS_SUCCESS)
    return Status::io_error("cuBLASLt e4m3 GEMM failed with status " + std::to_string(static_cast<int>(status)));
  return rate;
}

// " at 1980 MHz, 690 W, power-capped 40%" (medians), or nothing without a reading.
std::string describe_clocks(const std::optional<ClockReading>& clocks) {
  if (!clocks) return "";
  char text[96];
  std::snprintf(text, sizeof(text), " at %.0f MHz, %.0f W, power-capped %.0f%%", clocks->median_sm_mhz,
                clocks->median_watts, 100 * clocks->power_capped_share);
  return text;
}

// "bf16 GEMM 640 TFLOP/s sustained at ... (burst 807 at ...)"
std::string describe_rate(const char* name, const GemmRate& rate) {
  return std::string(name) + " GEMM " + std::to_string(std::lround(rate.sustained.flops_per_second / 1e12)) +
         " TFLOP/s sustained" + describe_clocks(rate.sustained.clocks) + " (burst " +
         std::to_string(std::lround(rate.burst.flops_per_second / 1e12)) + describe_clocks(rate.burst.clocks) + ")";
}

nlohmann::json clocks_json(const std::optional<ClockReading>& clocks) {
  if (!clocks) return nullptr;
  return {{"sm_mhz_median", clocks->median_sm_mhz},
          {"sm_mhz_min", clocks->min_sm_mhz},
          {"watts_median", clocks->median_watts},
          {"power_capped_share", clocks->power_capped_share},
          {"samples", clocks->samples}};
}

}  // namespace

bool cuda_device_present() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

int bench_cuda(const Problem& problem, const std::vector<int64_t>& token_counts, int iterations, int graph_calls,
               const std::string& json_path) {
  const RandomCaseOptions& base = problem.options;
  if (base.activation_dtype != DType::kBF16)
    return usage_error("bench", "the GPU takes bf16 activations: add --dtype bf16");
  const QuantSpec& quant = base.spec.quant;
  const bool fp8 = is_fp8(quant.scheme);
  cudaDeviceProp properties{};
  BENCH_CHECK(cudaGetDeviceProperties(&properties, 0));
  char pci_bus_id[32] = {};
  BENCH_CHECK(cudaDeviceGetPCIBusId(pci_bus_id, sizeof(pci_bus_id), 0));
  const NvmlDevice nvml(pci_bus_id);
  ClockSampler sampler(nvml);
  // The ceilings: the copy and the burst GEMM rates now, on a rested card (a bench run just
  // before may have left it capped); the sustained rates after the timed calls.
  constexpr int kRestLimitMs = 3000;
  const int rested_ms = rest_until_uncapped(nvml, kRestLimitMs);
  DeviceCeilings ceilings;
  auto measure_rates = [&](RatePhase phase) -> Status {
    Result<RateReading> bf16 = measure_bf16_rate(phase, sampler);
    if (!bf16.ok()) return bf16.status();
    ceilings.bf16.at(phase) = bf16.value();
    if (!fp8) return Status{};
    Result<RateReading> e4m3 = measure_e4m3_rate(phase, sampler);  // the floor of an fp8 layer
    if (!e4m3.ok()) return e4m3.status();
    if (!ceilings.e4m3) ceilings.e4m3 = GemmRate{};
    ceilings.e4m3->at(phase) = e4m3.value();
    return Status{};
  };
  const Result<double> copy_rate = measure_copy_rate();
  if (!copy_rate.ok()) return run_error("bench", copy_rate.status().to_string());
  ceilings.bytes_per_second = copy_rate.value();
  if (const Status burst = measure_rates(RatePhase::kBurst); !burst.ok()) return run_error("bench", burst.to_string());

  const int E = base.spec.routing.num_experts;
  const ExpertMap owned = ExpertMap::build(base.placement, E, base.num_ranks, 0).value();
  const int64_t H = base.hidden, I = base.intermediate, Is = base.shared_intermediate;
  const int64_t E_local = owned.num_local();
  const int64_t weight_elements = E_local * 3 * H * I + 3 * H * Is;
  const int64_t element_bytes = fp8 ? 1 : 2;
  // fp8: the scale tensors follow the codes, in the checkpoint's layout of the scheme.
  auto scale_count = [&](std::optional<int64_t> experts, int64_t n, int64_t k) {
    int64_t count = 1;
    for (int64_t extent : weight_scale_shape(quant, experts, n, k)) count *= extent;
    return fp8 ? count : 0;
  };
  const int64_t scale_counts[4] = {scale_count(E_local, 2 * I, H), scale_count(E_local, H, I),
                                   Is > 0 ? scale_count(std::nullopt, 2 * Is, H) : 0,
                                   Is > 0 ? scale_count(std::nullopt, H, Is) : 0};
  int64_t scale_elements = 0;
  for (int64_t count : scale_counts) scale_elements += (count + 63) / 64 * 64;  // 256-byte aligned pieces
  const int64_t code_bytes = (weight_elements * element_bytes + 255) / 256 * 256;
  const double weight_bytes = static_cast<double>(code_bytes + scale_elements * 4);
  // Enough weight copies that a rotation spans 4x the L2, within a third of the memory.
  size_t free_bytes = 0, total_bytes = 0;
  BENCH_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  int copies = static_cast<int>(std::ceil(4.0 * properties.l2CacheSize / weight_bytes));
  copies = std::clamp(copies, 1, 8);
  while (copies > 1 && copies * weight_bytes > free_bytes / 3.0) --copies;
  if (weight_bytes > free_bytes * 0.8)
    return usage_error("bench", "the rank's weights need " + std::to_string(weight_bytes / (1 << 30)) +
                                    " GiB, more than the device has free; use --ep");
  // Weights of unit variance / sqrt(K); fp8 codes spread over the e4m3 range (x 64), their
  // scales 1/64 bring them back.
  const float code_range = fp8 ? 64.0f : 1.0f;
  auto fill_weights = [&](void* data, int64_t count, uint64_t seed, float scale) {
    return fp8 ? fill_fp8(data, count, seed, scale * code_range) : fill(data, count, seed, scale);
  };
  std::vector<DeviceBuffer> weight_sets;
  for (int copy = 0; copy < copies; ++copy) {
    Result<DeviceBuffer> buffer = DeviceBuffer::allocate(static_cast<size_t>(weight_bytes));
    if (!buffer.ok()) return run_error("bench", buffer.status().to_string());
    auto* w = static_cast<uint8_t*>(buffer->data());
    BENCH_CHECK(fill_weights(w, E_local * 2 * I * H + 2 * Is * H, 100 + copy, 1.0f / std::sqrt(static_cast<float>(H))));
    BENCH_CHECK(fill_weights(w + (E_local * 2 * I * H + 2 * Is * H) * element_bytes, E_local * H * I + H * Is, 200 + copy,
                             1.0f / std::sqrt(static_cast<float>(I))));
    if (fp8) {
      fill_constant<<<256, 256>>>(reinterpret_cast<float*>(w + code_bytes), scale_elements, 1.0f / code_range);
      BENCH_CHECK(cudaGetLastError());
    }
    weight_sets.push_back(std::move(buffer).value());
  }
  auto weights_of = [&](int copy) {
    auto* next = static_cast<uint8_t*>(weight_sets[copy].data());
    const DType dtype = fp8 ? DType::kFP8E4M3 : DType::kBF16;
    auto take = [&](std::initializer_list<int64_t> shape) {
      const Tensor tensor = Tensor::contiguous(next, dtype, shape, Device::kCuda);
      next += tensor.nbytes();
      return tensor;
    };
    MoeWeights w;
    w.w13 = take({E_local, 2 * I, H});
    if (Is > 0) w.shared_w13 = take({2 * Is, H});
    w.w2 = take({E_local, H, I});
    if (Is > 0) w.shared_w2 = take({H, Is});
    if (!fp8) return w;
    auto* scales = reinterpret_cast<float*>(static_cast<uint8_t*>(weight_sets[copy].data()) + code_bytes);
    auto take_scale = [&](int which, std::optional<int64_t> experts, int64_t n, int64_t k) {
      const Tensor tensor = Tensor::contiguous(scales, DType::kF32, weight_scale_shape(quant, experts, n, k), Device::kCuda);
      scales += (scale_counts[which] + 63) / 64 * 64;
      return tensor;
    };
    w.w13_scale = take_scale(0, E_local, 2 * I, H);
    w.w2_scale = take_scale(1, E_local, H, I);
    if (Is > 0) {
      w.shared_w13_scale = take_scale(2, std::nullopt, 2 * Is, H);
      w.shared_w2_scale = take_scale(3, std::nullopt, H, Is);
    }
    return w;
  };
  Result<DeviceBuffer> map_buffer = DeviceBuffer::allocate(E * sizeof(int32_t));
  if (!map_buffer.ok()) return run_error("bench", map_buffer.status().to_string());
  if (!copy_to_device(owned.view(), map_buffer->data()).ok()) return run_error("bench", "expert map upload failed");

  std::printf("bench %s, rank 0's share, %s (%d SMs, %d MB L2), %d weight cop%s of %.2f GiB\n",
              describe(problem).c_str(), properties.name, properties.multiProcessorCount,
              properties.l2CacheSize >> 20, copies, copies == 1 ? "y" : "ies", weight_bytes / (1 << 30));
  std::fflush(stdout);
  // What each T's timing gave; its floor waits for the sustained rate.
  struct Timed {
    int64_t T;
    double seconds;
    std::optional<ClockReading> clocks;
    std::vector<Workload> rotation;  // the work of each call of the rotation
    int calls_per_graph, replays;
  };
  std::vector<Timed> timed;
  constexpr int kInputSets = 4;
  for (int64_t T : token_counts) {
    RandomCaseOptions options = base;
    options.tokens = T;
    // Input sets: x on the device, logits drawn and routed on the host (the floor needs their routing).
    std::vector<DeviceBuffer> buffers;
    std::vector<MoeInputs> inputs(kInputSets);
    std::vector<Workload> workloads;
    Result<BenchRouting> routing = draw_bench_routing(options, T, kInputSets);
    if (!routing.ok()) return run_error("bench", "host routing: " + routing.status().to_string());
    Result<DeviceBuffer> bias_buffer = DeviceBuffer::allocate(E * sizeof(float));
    if (!bias_buffer.ok()) return run_error("bench", bias_buffer.status().to_string());
    if (!copy_to_device(Tensor::contiguous(routing->bias.data(), DType::kF32, {E}), bias_buffer->data()).ok())
      return run_error("bench", "bias upload failed");
    for (int set = 0; set < kInputSets; ++set) {
      Result<DeviceBuffer> x = DeviceBuffer::allocate(T * H * 2), logits = DeviceBuffer::allocate(T * E * 4);
      if (!x.ok() || !logits.ok()) return run_error("bench", "input buffers: out of device memory");
      BENCH_CHECK(fill(x->data(), T * H, 300 + set, 1.0f));
      if (!copy_to_device(Tensor::contiguous(routing->logits[set].data(), DType::kF32, {T, E}), logits->data()).ok())
        return run_error("bench", "logits upload failed");
      workloads.push_back(count_workload(options, routing->ids[set], owned, Is > 0));
      inputs[set].x = Tensor::contiguous(x->data(), DType::kBF16, {T, H}, Device::kCuda);
      inputs[set].router_logits = Tensor::contiguous(logits->data(), DType::kF32, {T, E}, Device::kCuda);
      if (base.correction_bias)
        inputs[set].correction_bias = Tensor::contiguous(bias_buffer->data(), DType::kF32, {E}, Device::kCuda);
      inputs[set].expert_map = Tensor::contiguous(map_buffer->data(), DType::kI32, {E}, Device::kCuda);
      buffers.push_back(std::move(x).value());
      buffers.push_back(std::move(logits).value());
    }
    Result<DeviceBuffer> out = DeviceBuffer::allocate(T * H * 2);
    if (!out.ok()) return run_error("bench", out.status().to_string());
    const Tensor out_view = Tensor::contiguous(out->data(), DType::kBF16, {T, H}, Device::kCuda);
    MoeWeights first_weights = weights_of(0);
    Result<MoeShape> shape = validate_moe(base.spec, first_weights, inputs[0], &out_view, Device::kCuda);
    if (!shape.ok()) return run_error("bench", shape.status().to_string());
    Result<DeviceBuffer> workspace = DeviceBuffer::allocate(moe_workspace_bytes(base.spec, shape.value()));
    if (!workspace.ok()) return run_error("bench", workspace.status().to_string());

    // Graphs of `calls` calls back to back, each call on its own (input set, weight copy)
    // pairing of the rotation, as a model's layers follow one another in a served graph (by
    // default one graph holds the whole rotation). A call's time is its graph's replay time /
    // its calls (vLLM's benchmark_moe divides a graph of 10 calls the same way); the median
    // is taken over the replays.
    const int rotation = std::max(kInputSets, copies);
    const int calls = graph_calls > 0 ? std::min(graph_calls, rotation) : rotation;
    cudaStream_t stream;
    BENCH_CHECK(cudaStreamCreate(&stream));
    const CudaWorkspace ws{workspace->data(), workspace->bytes()};
    auto call = [&](int r) {
      return moe_forward_cuda(base.spec, weights_of(r % copies), inputs[r % kInputSets], out_view, ws, stream);
    };
    for (int r = 0; r < rotation; ++r)  // warm-up, and any error surfaces outside a capture
      if (const Status warm = call(r); !warm.ok()) return run_error("bench", warm.to_string());
    std::vector<std::pair<cudaGraphExec_t, int>> graphs;  // with their call counts
    for (int first = 0; first < rotation; first += calls) {
      const int count = std::min(calls, rotation - first);
      cudaGraph_t graph;
      BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      const Status captured = [&]() -> Status {
        for (int r = first; r < first + count; ++r) EPMOE_RETURN_IF_ERROR(call(r));
        return {};
      }();
      BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
      if (!captured.ok()) return run_error("bench", captured.to_string());
      cudaGraphExec_t exec;
      BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      BENCH_CHECK(cudaGraphDestroy(graph));
      graphs.emplace_back(exec, count);
    }
    for (const auto& [exec, count] : graphs) BENCH_CHECK(cudaGraphLaunch(exec, stream));
    BENCH_CHECK(cudaStreamSynchronize(stream));
    // Replays are queued back to back, each between its own pair of events, so the host's
    // launch cost stays out of the device time (it runs ahead while the GPU works).
    const int replays = iterations * static_cast<int>(graphs.size());
    std::vector<cudaEvent_t> events(2 * replays);
    for (cudaEvent_t& event : events) BENCH_CHECK(cudaEventCreate(&event));
    sampler.start();
    for (int i = 0; i < replays; ++i) {
      BENCH_CHECK(cudaEventRecord(events[2 * i], stream));
      BENCH_CHECK(cudaGraphLaunch(graphs[i % graphs.size()].first, stream));
      BENCH_CHECK(cudaEventRecord(events[2 * i + 1], stream));
    }
    BENCH_CHECK(cudaStreamSynchronize(stream));
    const std::optional<ClockReading> clocks = sampler.stop();
    std::vector<float> times;
    for (int i = 0; i < replays; ++i) {
      float ms = 0;
      BENCH_CHECK(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
      times.push_back(ms / graphs[i % graphs.size()].second);
    }
    for (cudaEvent_t event : events) cudaEventDestroy(event);
    for (const auto& [exec, count] : graphs) cudaGraphExecDestroy(exec);
    cudaStreamDestroy(stream);
    Timed& t = timed.emplace_back(Timed{T, median(times) * 1e-3, clocks, {}, calls, replays});
    for (int r = 0; r < rotation; ++r) t.rotation.push_back(workloads[r % kInputSets]);
  }
  if (const Status sustained = measure_rates(RatePhase::kSustained); !sustained.ok())
    return run_error("bench", sustained.to_string());

  std::printf("ceilings: copy %.2f TB/s, %s", ceilings.bytes_per_second / 1e12,
              describe_rate("bf16", ceilings.bf16).c_str());
  if (fp8) std::printf(", %s (the floor's)", describe_rate("e4m3", *ceilings.e4m3).c_str());
  std::printf("; rested %d ms before\n", rested_ms);
  if (!nvml.unavailable_reason().empty()) std::printf("clocks: not read (%s)\n", nvml.unavailable_reason().c_str());
  std::printf("%7s %8s %8s %11s %8s %9s %11s %7s %6s %7s %5s %5s\n", "T", "pairs", "experts", "time us", "TB/s",
              "TFLOP/s", "floor us", "ratio", "bound", "SM MHz", "W", "cap%");
  const double flops_per_second = ceilings.floor_rate().sustained.flops_per_second;
  const double burst_flops_per_second = ceilings.floor_rate().burst.flops_per_second;
  auto floor_at = [&](double bytes, double flops, double rate) {  // DESIGN.md's floor, at a GEMM rate
    return std::max(bytes / ceilings.bytes_per_second, flops / rate);
  };
  nlohmann::json results = nlohmann::json::array();
  for (const Timed& t : timed) {
    // The floor and the work of one call: their means over the rotation.
    double floor_sum = 0, burst_floor_sum = 0;  // (burst: the same at the GEMM's burst rate)
    Workload mean;
    for (const Workload& w : t.rotation) {
      floor_sum += floor_at(w.bytes, w.flops, flops_per_second);
      burst_floor_sum += floor_at(w.bytes, w.flops, burst_flops_per_second);
      mean.local_pairs += w.local_pairs;
      mean.experts_touched += w.experts_touched;
      mean.bytes += w.bytes;
      mean.flops += w.flops;
    }
    const double calls = static_cast<double>(t.rotation.size());
    const double seconds = t.seconds, floor_seconds = floor_sum / calls;
    const double bytes = mean.bytes / calls, flops = mean.flops / calls;
    const bool bandwidth_bound = bytes / ceilings.bytes_per_second >= flops / flops_per_second;
    std::printf("%7lld %8lld %8lld %11.1f %8.2f %9.1f %11.1f %7.2f %6s", static_cast<long long>(t.T),
                static_cast<long long>(mean.local_pairs / calls), static_cast<long long>(mean.experts_touched / calls),
                seconds * 1e6, bytes / seconds / 1e12, flops / seconds / 1e12, floor_seconds * 1e6,
                seconds / floor_seconds, bandwidth_bound ? "memory" : "math");
    if (t.clocks)
      std::printf(" %7.0f %5.0f %5.0f\n", t.clocks->median_sm_mhz, t.clocks->median_watts,
                  100 * t.clocks->power_capped_share);
    else
      std::printf(" %7s %5s %5s\n", "-", "-", "-");
    results.push_back({{"tokens", t.T},
                       {"local_pairs", mean.local_pairs / calls},
                       {"experts_touched", mean.experts_touched / calls},
                       {"seconds", seconds},
                       {"bytes", bytes},
                       {"flops", flops},
                       {"floor_seconds", floor_seconds},
                       {"ratio", seconds / floor_seconds},
                       {"burst_floor_seconds", burst_floor_sum / calls},
                       {"bound", bandwidth_bound ? "memory" : "math"},
                       {"calls_per_graph", t.calls_per_graph},
                       {"replays", t.replays},
                       {"clocks", clocks_json(t.clocks)}});
  }
  std::fflush(stdout);
  if (!json_path.empty()) {
    const nlohmann::json document = {{"device", properties.name},
                                     {"problem", describe(problem)},
                                     {"model", std::string(problem.preset->name)},
                                     {"ep", base.num_ranks},
                                     {"quant", std::string(quant_scheme_name(quant.scheme))},
                                     {"ceilings",
                                      {{"bytes_per_second", ceilings.bytes_per_second},
                                       {"flops_per_second", flops_per_second},
                                       {"burst_flops_per_second", burst_flops_per_second},
                                       {"bf16_flops_per_second", ceilings.bf16.sustained.flops_per_second},
                                       {"bf16_burst_flops_per_second", ceilings.bf16.burst.flops_per_second},
                                       {"rate_clocks", clocks_json(ceilings.floor_rate().sustained.clocks)},
                                       {"burst_rate_clocks", clocks_json(ceilings.floor_rate().burst.clocks)},
                                       {"bf16_rate_clocks", clocks_json(ceilings.bf16.sustained.clocks)},
                                       {"bf16_burst_rate_clocks", clocks_json(ceilings.bf16.burst.clocks)},
                                       {"rested_ms", rested_ms}}},
                                     {"results", results}};
    std::ofstream file(json_path);
    file << document.dump(2) << "\n";
    if (!file) return run_error("bench", "cannot write " + json_path);
  }
  return 0;
}

}  // namespace epmoe::cli
