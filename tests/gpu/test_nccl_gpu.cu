// The NCCL backend on one GPU (a world of one): every collective on device buffers against
// its definition, both bootstraps, collectives that return before they complete (queued
// behind a kernel) and the watchdog that fails one past its timeout, and a world of two
// with one rank missing, which must fail with a clear error within the timeout instead of
// hanging.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <numeric>
#include <random>

#include "epmoe/communicator.h"
#include "epmoe/device_case.h"
#include "epmoe/ep_moe.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/naive_moe.h"
#include "epmoe/presets.h"

namespace epmoe {
namespace {

using namespace std::chrono_literals;

std::string temp_path(const char* name) { return ::testing::TempDir() + "/" + name + std::to_string(::getpid()); }

// Holds its stream for about `nanoseconds` (globaltimer is wall-clock time).
__global__ void spin_for(uint64_t nanoseconds) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

std::vector<float> to_host(const DeviceBuffer& buffer, size_t count) {
  std::vector<float> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), buffer.data(), count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

TEST(NcclBackend, WorldOfOneRunsEveryCollective) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  Result<std::unique_ptr<Communicator>> made =
      make_nccl_communicator({.rank = 0, .size = 1, .bootstrap = "file:" + temp_path("nccl_id"), .timeout = 20000ms});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Communicator& comm = *made.value();
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.device(), Device::kCuda);
  std::mt19937 rng(std::random_device{}());
  std::vector<float> values(64);
  for (float& v : values) v = std::uniform_real_distribution<float>(-3, 3)(rng);
  DeviceBuffer in = DeviceBuffer::allocate(256).value(), out = DeviceBuffer::allocate(256).value();
  ASSERT_EQ(cudaMemcpy(in.data(), values.data(), 256, cudaMemcpyHostToDevice), cudaSuccess);
  auto poison = [&] { ASSERT_EQ(cudaMemset(out.data(), 0xff, 256), cudaSuccess); };

  poison();
  ASSERT_TRUE(comm.all_gather(in.data(), out.data(), 64, DType::kF32).ok());
  ASSERT_TRUE(comm.synchronize().ok());
  EXPECT_EQ(to_host(out, 64), values);
  poison();
  ASSERT_TRUE(comm.all_reduce(in.data(), out.data(), 64, DType::kF32).ok());
  ASSERT_TRUE(comm.synchronize().ok());
  EXPECT_EQ(to_host(out, 64), values);
  poison();
  ASSERT_TRUE(comm.reduce_scatter(in.data(), out.data(), 64, DType::kF32).ok());
  ASSERT_TRUE(comm.synchronize().ok());
  EXPECT_EQ(to_host(out, 64), values);
  poison();
  const std::vector<size_t> counts = {40};
  ASSERT_TRUE(comm.all_gather_v(in.data(), out.data(), counts, DType::kF32).ok());
  ASSERT_TRUE(comm.synchronize().ok());
  EXPECT_EQ(to_host(out, 40), std::vector<float>(values.begin(), values.begin() + 40));
  poison();
  ASSERT_TRUE(comm.all_to_all_v(in.data(), counts, out.data(), counts, DType::kF32).ok());
  ASSERT_TRUE(comm.synchronize().ok());
  EXPECT_EQ(to_host(out, 40), std::vector<float>(values.begin(), values.begin() + 40));
  ASSERT_TRUE(comm.barrier().ok());
}

TEST(NcclBackend, CollectivesReturnBeforeTheyCompleteOnTheirStream) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Result<std::unique_ptr<Communicator>> made = make_nccl_communicator(
      {.rank = 0, .size = 1, .bootstrap = "file:" + temp_path("nccl_async"), .timeout = 20000ms, .stream = stream});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Communicator& comm = *made.value();
  DeviceBuffer buffer = DeviceBuffer::allocate(4096).value();
  std::vector<float> values(1024);
  std::iota(values.begin(), values.end(), 0.5f);
  ASSERT_EQ(cudaMemcpy(buffer.data(), values.data(), 4096, cudaMemcpyHostToDevice), cudaSuccess);
  // A 300 ms kernel ahead of the all-reduce: an asynchronous call returns long before it ends.
  spin_for<<<1, 1, 0, stream>>>(300'000'000);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(comm.all_reduce(buffer.data(), buffer.data(), 1024, DType::kF32).ok());
  const auto returned = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(comm.synchronize().ok());
  const auto completed = std::chrono::steady_clock::now() - start;
  EXPECT_LT(returned, 100ms);
  EXPECT_GT(completed, 200ms);
  EXPECT_EQ(to_host(buffer, 1024), values);
  made.value().reset();
  cudaStreamDestroy(stream);
}

TEST(NcclBackend, WatchdogFailsACollectivePastItsTimeout) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Result<std::unique_ptr<Communicator>> made = make_nccl_communicator(
      {.rank = 0, .size = 1, .bootstrap = "file:" + temp_path("nccl_late"), .timeout = 400ms, .stream = stream});
  ASSERT_TRUE(made.ok()) << made.status().message();
  Communicator& comm = *made.value();
  DeviceBuffer buffer = DeviceBuffer::allocate(256).value();
  // The stream is held for 1.5 s, past the 400 ms timeout: as with a peer that never comes.
  spin_for<<<1, 1, 0, stream>>>(1'500'000'000);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(comm.all_reduce(buffer.data(), buffer.data(), 64, DType::kF32).ok());
  const Status waited = comm.synchronize();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(waited.ok());
  EXPECT_EQ(waited.message(), "communicator failed: all_reduce on rank 0 did not finish within 400 ms (a peer missing?)");
  EXPECT_LT(elapsed, 3s) << "the watchdog, not the kernel, ends the wait";
  // The communicator stays failed.
  const Status later = comm.all_reduce(buffer.data(), buffer.data(), 64, DType::kF32);
  EXPECT_EQ(later.message(), waited.message());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  made.value().reset();
  cudaStreamDestroy(stream);
}

TEST(NcclBackend, TcpBootstrapWorldOfOne) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  Result<std::unique_ptr<Communicator>> made =
      make_nccl_communicator({.rank = 0, .size = 1, .bootstrap = "tcp:127.0.0.1:29517", .timeout = 20000ms});
  ASSERT_TRUE(made.ok()) << made.status().message();
  EXPECT_TRUE(made.value()->barrier().ok());
}

TEST(NcclBackend, MissingPeerIsAnErrorWithinTheTimeout) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 of 2 waits for rank 0's id, which never comes.
  Result<std::unique_ptr<Communicator>> made =
      make_nccl_communicator({.rank = 1, .size = 2, .bootstrap = "file:" + temp_path("nccl_none"), .timeout = 1500ms});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("no NCCL id from rank 0 before the timeout"), std::string::npos)
      << made.status().message();
  // Rank 0 of 2 publishes the id, but its peer never joins: init must give up.
  Result<std::unique_ptr<Communicator>> alone =
      make_nccl_communicator({.rank = 0, .size = 2, .bootstrap = "file:" + temp_path("nccl_alone"), .timeout = 3000ms});
  ASSERT_FALSE(alone.ok());
  EXPECT_NE(alone.status().message().find("did not complete within 3000 ms"), std::string::npos)
      << alone.status().message();
}

// EpMoe over NCCL with one GPU: every strategy gives the single-rank CPU operator's output.
TEST(NcclBackend, EpMoeEveryStrategyOnOneGpuMatchesTheCpuOperator) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  Result<std::unique_ptr<Communicator>> comm =
      make_nccl_communicator({.rank = 0, .size = 1, .bootstrap = "file:" + temp_path("nccl_ep"), .timeout = 20000ms});
  ASSERT_TRUE(comm.ok()) << comm.status().message();
  for (QuantScheme scheme : {QuantScheme::kBf16, QuantScheme::kFp8Block}) {
    RandomCaseOptions options;
    options.spec = find_preset("deepseek-v3")->spec;
    options.spec.quant.scheme = scheme;
    options.tokens = 37;
    options.hidden = 256;
    options.intermediate = 128;
    options.shared_intermediate = 128;
    options.correction_bias = true;
    options.seed = std::random_device{}();
    const MoeCase host = make_random_case(options).value();
    Buffer expected(DType::kBF16, {37, 256});
    ASSERT_TRUE(moe_forward_cpu(host.spec, host.weights, host.inputs, expected.view()).ok());
    const DeviceCase device = upload(host).value();
    for (EpStrategy strategy : {EpStrategy::kReplicateAllReduce, EpStrategy::kAllGatherReduceScatter, EpStrategy::kAllToAll}) {
      const std::string what = std::string(quant_scheme_name(scheme)) + " " + std::string(ep_strategy_name(strategy));
      EpLayer layer{host.spec, ExpertMap::build(Placement::kLinear, 256, 1, 0).value(), device.weights,
                    device.inputs.correction_bias, {}};
      Result<EpMoe> moe = EpMoe::create(*comm.value(), layer, strategy);
      ASSERT_TRUE(moe.ok()) << moe.status().message();
      DeviceBuffer out = DeviceBuffer::allocate(37 * 256 * 2).value();
      ASSERT_EQ(cudaMemset(out.data(), 0xff, out.bytes()), cudaSuccess);
      const Tensor out_view = Tensor::contiguous(out.data(), DType::kBF16, {37, 256}, Device::kCuda);
      EpStats stats;
      const Status status = moe->forward(device.inputs.x, *device.inputs.router_logits, out_view, &stats);
      ASSERT_TRUE(status.ok()) << what << ": " << status.message();
      Buffer result(DType::kBF16, {37, 256});
      ASSERT_TRUE(copy_to_host(out.data(), result.view()).ok());
      EXPECT_LT(relative_error(to_doubles(result.view()), to_doubles(expected.view())), is_fp8(scheme) ? 3e-2 : 1e-2)
          << what;
      EXPECT_EQ(std::accumulate(stats.pairs_per_local_expert.begin(), stats.pairs_per_local_expert.end(), int64_t{0}),
                int64_t{37 * 8})
          << what;
    }
  }
}

TEST(NcclBackend, BadBootstrapIsRejected) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  EXPECT_EQ(make_nccl_communicator({.rank = 0, .size = 1, .bootstrap = "udp:x"}).status().message(),
            "bootstrap: expected file:PATH or tcp:HOST:PORT, got 'udp:x'");
}

}  // namespace
}  // namespace epmoe
