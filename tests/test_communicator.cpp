// The in-process thread backend: each collective on fresh random data for R in {1, 2, 3,
// 5}, rank-order sums, in-place all-reduce, and the failures: a missing rank times out with
// a message naming it, mismatched calls and aborts fail every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <thread>

#include "epmoe/communicator.h"

namespace epmoe {
namespace {

using namespace std::chrono_literals;

// Runs body(rank, comm) on one thread per rank.
void on_ranks(std::vector<std::unique_ptr<Communicator>>& comms, const std::function<void(int, Communicator&)>& body) {
  std::vector<std::jthread> threads;
  for (size_t r = 0; r < comms.size(); ++r) threads.emplace_back([&, r] { body(static_cast<int>(r), *comms[r]); });
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2, 2);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, GatherReduceAndExchangeMatchTheirDefinitions) {
  const int R = GetParam();
  const uint32_t seed = std::random_device{}();
  auto comms = make_thread_group(R, 5000ms);
  std::vector<std::vector<float>> inputs(R);
  for (int r = 0; r < R; ++r) inputs[r] = random_floats(6 * R, seed + r);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), R);
    // all_gather of the first 6 values
    std::vector<float> gathered(6 * R, NAN);
    ASSERT_TRUE(comm.all_gather(inputs[rank].data(), gathered.data(), 6, DType::kF32).ok());
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 6; ++i) ASSERT_EQ(gathered[r * 6 + i], inputs[r][i]);
    // all_gather_v: rank r contributes r values (rank 0 none)
    std::vector<size_t> counts(R);
    size_t total = 0;
    for (int r = 0; r < R; ++r) total += (counts[r] = r);
    std::vector<float> varied(total + 1, NAN);
    ASSERT_TRUE(comm.all_gather_v(inputs[rank].data(), varied.data(), counts, DType::kF32).ok());
    for (int r = 0, at = 0; r < R; ++r)
      for (int i = 0; i < r; ++i) ASSERT_EQ(varied[at++], inputs[r][i]);
    // reduce_scatter: block `rank` summed over ranks, in rank order
    std::vector<float> block(6, NAN);
    ASSERT_TRUE(comm.reduce_scatter(inputs[rank].data(), block.data(), 6, DType::kF32).ok());
    for (int i = 0; i < 6; ++i) {
      float expected = 0;
      for (int r = 0; r < R; ++r) expected += inputs[r][rank * 6 + i];
      ASSERT_EQ(block[i], expected);
    }
    // all_reduce in place
    std::vector<float> mine = inputs[rank];
    ASSERT_TRUE(comm.all_reduce(mine.data(), mine.data(), mine.size(), DType::kF32).ok());
    for (size_t i = 0; i < mine.size(); ++i) {
      float expected = 0;
      for (int r = 0; r < R; ++r) expected += inputs[r][i];
      ASSERT_EQ(mine[i], expected);
    }
    // all_to_all_v: rank s sends (s + d) % 3 values to rank d, the values s * 100 + d * 10 + i
    std::vector<size_t> send(R), recv(R);
    std::vector<float> out_buffer;
    for (int d = 0; d < R; ++d) {
      send[d] = (rank + d) % 3;
      recv[d] = (d + rank) % 3;
      for (size_t i = 0; i < send[d]; ++i) out_buffer.push_back(rank * 100.0f + d * 10.0f + i);
    }
    std::vector<float> received(std::accumulate(recv.begin(), recv.end(), size_t{0}) + 1, NAN);
    ASSERT_TRUE(comm.all_to_all_v(out_buffer.data(), send, received.data(), recv, DType::kF32).ok());
    for (int s = 0, at = 0; s < R; ++s)
      for (size_t i = 0; i < recv[s]; ++i) ASSERT_EQ(received[at++], s * 100.0f + rank * 10.0f + i);
    ASSERT_TRUE(comm.barrier().ok());
    ASSERT_TRUE(comm.synchronize().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(1, 2, 3, 5));

TEST(ThreadCommunicator, MissingRankTimesOutWithItsNumber) {
  auto comms = make_thread_group(3, 200ms);
  std::vector<Status> results(3);
  const auto start = std::chrono::steady_clock::now();
  on_ranks(comms, [&](int rank, Communicator& comm) {
    if (rank == 2) return;  // rank 2 never joins
    results[rank] = comm.barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  for (int r : {0, 1}) {
    EXPECT_FALSE(results[r].ok());
    EXPECT_NE(results[r].message().find("for rank(s) 2 (timeout)"), std::string::npos) << results[r].message();
  }
  // The group stays failed.
  float value = 1;
  EXPECT_FALSE(comms[0]->all_reduce(&value, &value, 1, DType::kF32).ok());
}

TEST(ThreadCommunicator, MismatchedCollectivesFailEveryRank) {
  auto comms = make_thread_group(2, 2000ms);
  std::vector<Status> results(2);
  on_ranks(comms, [&](int rank, Communicator& comm) {
    float value[4] = {1, 2, 3, 4};
    results[rank] = rank == 0 ? comm.all_reduce(value, value, 4, DType::kF32) : comm.all_reduce(value, value, 3, DType::kF32);
  });
  for (const Status& status : results) {
    EXPECT_FALSE(status.ok());
    EXPECT_NE(status.message().find("collective on rank 1"), std::string::npos) << status.message();
  }
}

TEST(ThreadCommunicator, AbortReachesRanksWaitingInACollective) {
  auto comms = make_thread_group(3, 10000ms);
  std::vector<Status> results(3);
  const auto start = std::chrono::steady_clock::now();
  on_ranks(comms, [&](int rank, Communicator& comm) {
    if (rank == 1) {
      std::this_thread::sleep_for(50ms);
      comm.abort("expert weights failed to load");
      return;
    }
    results[rank] = comm.barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);  // far below the 10 s timeout
  for (int r : {0, 2}) {
    EXPECT_EQ(results[r].message(), "communicator failed: rank 1: expert weights failed to load");
    EXPECT_EQ(comms[r]->synchronize().message(), results[r].message());  // the failure stays
  }
}

}  // namespace
}  // namespace epmoe
