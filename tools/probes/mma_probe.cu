// How fast the specialised tile's consumer K loops run when their operands are already in
// shared memory: no loads, no ring hand-shake, no epilogue. In the layer the e4m3 128-row
// tile reaches ~40% of the e4m3 rate on qwen3-30b-a3b's short K loops where bf16's reaches
// ~72% of its own (~65% on the long-K presets), and leaving out the loads, the promotion or
// the epilogue each bought only 4-12% (docs/KERNELS.md). This says what the loop forms
// themselves reach.
//
// Each CTA (one an SM, on every SM) fills a ring of stages once with random codes and scales,
// then runs one loop form over it for K tiles, the stages in turn, the consumer warpgroups
// each m64 over their rows and the whole B tile, the instructions of grouped_gemm_specialized.cu's
// consumers (gemm_tiles.cuh's wgmma steps and descriptors):
//   in flight: a K tile's wgmma group stays in flight while the next is issued (bf16's loop,
//     and e4m3's where the scales wait for the epilogue: fp8_channel, fp8_tensor);
//   promote: fp8_block's, the sums of each n128 round (the wide tile's two B halves in turn)
//     waited for and added to the accumulator times the K tile's A and B scales;
//   wait: the same rounds and waits with no promotion (what the FFMAs cost beside the wait).
// In lockstep, the consumers meet at a barrier before each K tile, as the layer's do when the
// ring runs dry and both wait for one stage to land; otherwise they drift apart freely.
// Printed per form: clock64 cycles a K tile (median over CTAs) against the tensor cores' peak
// (sm_90: 2048 bf16 or 4096 e4m3 multiply-adds a cycle an SM), so the ratio does not depend
// on the clock the SMs ran at; beside it TFLOP/s by wall time and that clock. Built with the
// CUDA backend; run on the device machine: build/mma_probe [K tiles a CTA, default 4096]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "moe/cuda/gemm_tiles.cuh"
#include "probe_check.h"

namespace {

using namespace epmoe::cuda;

enum class Loop { kInFlight, kPromote, kWait };
const char* loop_name(Loop loop) {
  return loop == Loop::kInFlight ? "in flight" : loop == Loop::kPromote ? "promote" : "wait";
}

constexpr int kStages = 4;
// Shared memory of a form: the ring, then a scale slot a stage (A's rows, B's two halves).
template <int kConsumers, int kCols>
constexpr int kStageBytes = (64 * kConsumers + kCols) * kRowBytes;
template <int kConsumers, int kCols>
constexpr int shared_bytes() {
  return 1024 + kStages * (kStageBytes<kConsumers, kCols> + (64 * kConsumers + 2) * 4);
}

// A random word of operand codes: e4m3 of magnitude below 2 (exponent field up to 7, no NaN
// code), or two bf16 in (-2, 2).
__device__ uint32_t random_codes(uint32_t index, bool fp8) {
  uint32_t h = index * 0x9e3779b9u ^ blockIdx.x * 0x85ebca6bu;
  h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12, h *= 0x297a2d39u, h ^= h >> 15;
  return fp8 ? h & 0xbfbfbfbfu : (h & 0x807f807fu) | 0x3f803f80u;
}

template <bool kFp8, int kCols, Loop kLoop, int kConsumers, bool kLockstep>
__global__ void __launch_bounds__(kConsumers * 128, 1) mma_probe_kernel(int k_tiles, float* sink, long long* cycles) {
  static_assert(kLoop == Loop::kInFlight || (kFp8 && kCols % 128 == 0), "rounds of n128 sums: e4m3 only");
  extern __shared__ uint8_t raw[];
  uint8_t* const ring = aligned_tiles(raw);
  constexpr int kARows = 64 * kConsumers, kStage = kStageBytes<kConsumers, kCols>;
  float* const a_scales = reinterpret_cast<float*>(ring + kStages * kStage);  // [stage][A row]
  float* const b_scales = a_scales + kStages * kARows;                        // [stage][B half]
  const int thread = threadIdx.x;
  for (int i = thread; i < kStages * kStage / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(ring)[i] = random_codes(i, kFp8);
  for (int i = thread; i < kStages * (kARows + 2); i += blockDim.x)
    a_scales[i] = 0.5f + (random_codes(i + (1 << 24), true) & 0xffff) / 65536.0f;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the stores, before the tensor cores read them
  __syncthreads();

  const int consumer = thread / 128, lane = thread % 32;
  const int first_row = consumer * 64 + (thread / 32) % 4 * 16 + lane / 4;
  const int rows[2] = {first_row, first_row + 8};
  const uint32_t a_descriptor0 = wgmma_descriptor_low(ring + consumer * 64 * kRowBytes);
  const uint32_t b_descriptor0 = wgmma_descriptor_low(ring + kARows * kRowBytes);
  constexpr uint32_t kStageStep = kStage >> 4;
  constexpr int kMmaN = kCols / 8, kSumBlocks = 128 / 8, kRounds = kCols / 128;
  float acc[kMmaN][4];
#pragma unroll
  for (int j = 0; j < kMmaN; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
  float sums[kSumBlocks][4];
#pragma unroll
  for (int j = 0; j < kSumBlocks; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) sums[j][q] = 0.0f;

  const long long start = clock64();
  int stage = 0;
  for (int kt = 0; kt < k_tiles; ++kt) {
    const uint32_t a_descriptor = a_descriptor0 + stage * kStageStep;
    const uint32_t b_descriptor = b_descriptor0 + stage * kStageStep;
    if constexpr (kLockstep) asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers * 128) : "memory");
    wgmma_fence();
    if constexpr (kLoop == Loop::kInFlight) {
      wgmma_k_tile<kCols, kFp8>(acc, a_descriptor, b_descriptor, /*fresh=*/false);
      wgmma_commit();
      wgmma_wait<1>();
    } else {
      float a_scale[2], b_scale[2];
#pragma unroll
      for (int round = 0; round < kRounds; ++round) {
        const uint32_t b_round = b_descriptor + round * (128 * kRowBytes >> 4);
        if (round > 0) wgmma_fence();
        wgmma_k_tile<128, true>(sums, a_descriptor, b_round, /*fresh=*/kLoop == Loop::kPromote);
        wgmma_commit();
        if (round == 0) {
          a_scale[0] = a_scales[stage * kARows + rows[0]], a_scale[1] = a_scales[stage * kARows + rows[1]];
          b_scale[0] = b_scales[stage * 2], b_scale[1] = b_scales[stage * 2 + 1];
        }
        wgmma_wait<0>();
        if constexpr (kLoop == Loop::kPromote) promote_round(acc, sums, round, a_scale, b_scale);
      }
    }
    if (++stage == kStages) stage = 0;
  }
  wgmma_wait<0>();
  __syncthreads();
  if (thread == 0) cycles[blockIdx.x] = clock64() - start;
  float total = 0.0f;  // every sum reaches memory, so no FFMA is dead
#pragma unroll
  for (int j = 0; j < kMmaN; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) total += acc[j][q];
#pragma unroll
  for (int j = 0; j < kSumBlocks; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) total += sums[j][q];
  sink[blockIdx.x * blockDim.x + thread] = total;
}

template <bool kFp8, int kCols, Loop kLoop, int kConsumers, bool kLockstep = false>
void run_form(int k_tiles, int sms, float* sink, long long* cycles) {
  auto kernel = mma_probe_kernel<kFp8, kCols, kLoop, kConsumers, kLockstep>;
  // At least half an SM's shared memory, so that one CTA runs an SM.
  const int shared = std::max(shared_bytes<kConsumers, kCols>(), 116 * 1024);
  PROBE_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  cudaEvent_t start, stop;
  PROBE_CHECK(cudaEventCreate(&start));
  PROBE_CHECK(cudaEventCreate(&stop));
  // The fastest run's wall time and its CTAs' cycles (the clock column divides one by the other).
  float best_ms = 1e30f;
  std::vector<long long> spans(sms);
  for (int run = 0; run < 4; ++run) {  // the first pays the module load
    PROBE_CHECK(cudaEventRecord(start));
    kernel<<<sms, kConsumers * 128, shared>>>(k_tiles, sink, cycles);
    PROBE_CHECK(cudaGetLastError());
    PROBE_CHECK(cudaEventRecord(stop));
    PROBE_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    PROBE_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (run == 0 || ms >= best_ms) continue;
    best_ms = ms;
    PROBE_CHECK(cudaMemcpy(spans.data(), cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
  }
  PROBE_CHECK(cudaEventDestroy(start));
  PROBE_CHECK(cudaEventDestroy(stop));
  std::sort(spans.begin(), spans.end());
  const double per_k_tile = static_cast<double>(spans[sms / 2]) / k_tiles;
  const int depth = kRowBytes / (kFp8 ? 1 : 2), peak = kFp8 ? 4096 : 2048;  // multiply-adds a cycle an SM
  const double multiply_adds = 64.0 * kConsumers * kCols * depth, ideal = multiply_adds / peak;
  const double seconds = best_ms * 1e-3;
  std::printf("| %s | %d | m64n%d%s | %s | %d%s | %.0f | %.0f | %.2f | %.0f | %.0f |\n", kFp8 ? "e4m3" : "bf16",
              64 * kConsumers, kLoop == Loop::kInFlight ? kCols : 128,
              kLoop == Loop::kInFlight || kCols == 128 ? "" : " x2", loop_name(kLoop), kConsumers,
              kLockstep ? " in lockstep" : "", per_k_tile, ideal, per_k_tile / ideal,
              2 * multiply_adds * k_tiles * sms / seconds / 1e12, spans[sms / 2] / seconds / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  const int k_tiles = argc > 1 ? std::atoi(argv[1]) : 4096;
  if (k_tiles <= 0) {
    std::fprintf(stderr, "K tiles a CTA: expected a positive count, got %s\n", argv[1]);
    return 2;
  }
  int sms = 0;
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* sink = nullptr;
  long long* cycles = nullptr;
  PROBE_CHECK(cudaMalloc(&sink, sizeof(float) * sms * 384));
  PROBE_CHECK(cudaMalloc(&cycles, sizeof(long long) * sms));
  std::printf("%d K tiles a CTA (%d bytes deep), one CTA an SM on %d SMs, %d stages\n\n", k_tiles, kRowBytes, sms,
              kStages);
  std::printf(
      "| operands | tile rows | wgmma | loop | consumers | cycles a K tile | peak's | ratio | TFLOP/s | MHz |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  // The layer's forms (two consumers: 128-row tiles), the e4m3 ones again in lockstep, then
  // one warpgroup alone (its chain's length: wgmma, wait, promotion) and three (a 192-row tile).
  run_form<false, 256, Loop::kInFlight, 2>(k_tiles, sms, sink, cycles);
  run_form<false, 128, Loop::kInFlight, 2>(k_tiles, sms, sink, cycles);
  run_form<true, 256, Loop::kInFlight, 2>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kInFlight, 2>(k_tiles, sms, sink, cycles);
  run_form<true, 256, Loop::kPromote, 2>(k_tiles, sms, sink, cycles);
  run_form<true, 256, Loop::kWait, 2>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kPromote, 2>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kWait, 2>(k_tiles, sms, sink, cycles);
  run_form<true, 256, Loop::kInFlight, 2, /*kLockstep=*/true>(k_tiles, sms, sink, cycles);
  run_form<true, 256, Loop::kPromote, 2, /*kLockstep=*/true>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kPromote, 2, /*kLockstep=*/true>(k_tiles, sms, sink, cycles);
  run_form<false, 256, Loop::kInFlight, 1>(k_tiles, sms, sink, cycles);
  run_form<true, 256, Loop::kInFlight, 1>(k_tiles, sms, sink, cycles);
  run_form<true, 256, Loop::kPromote, 1>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kPromote, 1>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kWait, 1>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kInFlight, 3>(k_tiles, sms, sink, cycles);
  run_form<true, 128, Loop::kPromote, 3>(k_tiles, sms, sink, cycles);
  PROBE_CHECK(cudaFree(sink));
  PROBE_CHECK(cudaFree(cycles));
  return 0;
}
