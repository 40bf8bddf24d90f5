// The NCCL backend on one GPU (a world of one): every collective on device buffers against
// its definition, both bootstraps, and a world of two with one rank missing, which must
// fail with a clear error within the timeout instead of hanging.
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
  EXPECT_EQ(to_host(out, 64), values);
  poison();
  ASSERT_TRUE(comm.all_reduce(in.data(), out.data(), 64, DType::kF32).ok());
  EXPECT_EQ(to_host(out, 64), values);
  poison();
  ASSERT_TRUE(comm.reduce_scatter(in.data(), out.data(), 64, DType::kF32).ok());
  EXPECT_EQ(to_host(out, 64), values);
  poison();
  const std::vector<size_t> counts = {40};
  ASSERT_TRUE(comm.all_gather_v(in.data(), out.data(), counts, DType::kF32).ok());
  EXPECT_EQ(to_host(out, 40), std::vector<float>(values.begin(), values.begin() + 40));
  poison();
  ASSERT_TRUE(comm.all_to_all_v(in.data(), counts, out.data(), counts, DType::kF32).ok());
  EXPECT_EQ(to_host(out, 40), std::vector<float>(values.begin(), values.begin() + 40));
  ASSERT_TRUE(comm.barrier().ok());
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
  RandomCaseOptions options;
  options.spec = find_preset("deepseek-v3")->spec;
  options.spec.quant.scheme = QuantScheme::kBf16;
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
  Result<std::unique_ptr<Communicator>> comm =
      make_nccl_communicator({.rank = 0, .size = 1, .bootstrap = "file:" + temp_path("nccl_ep"), .timeout = 20000ms});
  ASSERT_TRUE(comm.ok()) << comm.status().message();
  for (EpStrategy strategy : {EpStrategy::kReplicateAllReduce, EpStrategy::kAllGatherReduceScatter, EpStrategy::kAllToAll}) {
    EpLayer layer{host.spec, ExpertMap::build(Placement::kLinear, 256, 1, 0).value(), device.weights,
                  device.inputs.correction_bias, {}};
    Result<EpMoe> moe = EpMoe::create(*comm.value(), layer, strategy);
    ASSERT_TRUE(moe.ok()) << moe.status().message();
    DeviceBuffer out = DeviceBuffer::allocate(37 * 256 * 2).value();
    ASSERT_EQ(cudaMemset(out.data(), 0xff, out.bytes()), cudaSuccess);
    const Tensor out_view = Tensor::contiguous(out.data(), DType::kBF16, {37, 256}, Device::kCuda);
    EpStats stats;
    const Status status = moe->forward(device.inputs.x, *device.inputs.router_logits, out_view, &stats);
    ASSERT_TRUE(status.ok()) << ep_strategy_name(strategy) << ": " << status.message();
    Buffer result(DType::kBF16, {37, 256});
    ASSERT_TRUE(copy_to_host(out.data(), result.view()).ok());
    EXPECT_LT(relative_error(to_doubles(result.view()), to_doubles(expected.view())), 1e-2) << ep_strategy_name(strategy);
    EXPECT_EQ(std::accumulate(stats.pairs_per_local_expert.begin(), stats.pairs_per_local_expert.end(), int64_t{0}),
              int64_t{37 * 8});
  }
}

TEST(NcclBackend, BadBootstrapIsRejected) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  EXPECT_EQ(make_nccl_communicator({.rank = 0, .size = 1, .bootstrap = "udp:x"}).status().message(),
            "bootstrap: expected file:PATH or tcp:HOST:PORT, got 'udp:x'");
}

}  // namespace
}  // namespace epmoe
