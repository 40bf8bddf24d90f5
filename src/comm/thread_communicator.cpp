// The in-process thread backend: R ranks in one process share a ThreadGroup. A collective
// is a rendezvous in two phases:
//   arrive: each rank publishes its contribution (op, counts, dtype, input pointer) and
//           waits for all R; then each rank computes its own output from everyone's inputs
//           (read in place: no rank can leave, so no input can change);
//   depart: each rank waits until all R have read; the last one resets the rendezvous.
// Outputs are built in a scratch buffer and copied out after depart, so in == out is safe.
// A wait past the timeout, or an abort, fails the group for good with the reason, and
// every rank waiting in it returns that error.
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>

#include "epmoe/communicator.h"

namespace epmoe {

namespace {

struct Contribution {
  std::string op;
  const void* in = nullptr;
  std::vector<size_t> counts;  // op-specific: count, counts per rank, send counts
  DType dtype = DType::kF32;
};

class ThreadGroup {
 public:
  ThreadGroup(int size, std::chrono::milliseconds timeout)
      : size_(size), timeout_(timeout), slots_(size), arrived_in_(size, ~uint64_t{0}) {}

  // Runs `compute(contributions)` for `rank` between the two phases.
  template <typename Compute>
  Status rendezvous(int rank, Contribution mine, Compute compute) {
    std::unique_lock lock(mutex_);
    if (failed_) return failure();
    const uint64_t generation = generation_;
    slots_[rank] = std::move(mine);
    arrived_in_[rank] = generation;
    ++arrived_;
    if (arrived_ == size_) {
      changed_.notify_all();
    } else if (!changed_.wait_for(lock, timeout_, [&] { return arrived_ == size_ || failed_; })) {
      fail("rank " + std::to_string(rank) + " waited " + std::to_string(timeout_.count()) + " ms in " +
           slots_[rank].op + " for rank(s) " + missing_ranks() + " (timeout)");
    }
    if (failed_) return failure();
    // Every rank checks the same thing, so every rank reaches the same verdict.
    Status status = check_same_op();
    if (status.ok()) {
      lock.unlock();
      status = compute(slots_);
      lock.lock();
    }
    ++departed_;
    if (departed_ == size_) {
      arrived_ = departed_ = 0;
      ++generation_;
      changed_.notify_all();
    } else if (!changed_.wait_for(lock, timeout_, [&] { return generation_ != generation || failed_; })) {
      fail("rank " + std::to_string(rank) + " timed out leaving " + slots_[rank].op);
    }
    if (failed_) return failure();
    return status;
  }

  void abort(const std::string& reason) {
    std::lock_guard lock(mutex_);
    fail(reason);
  }

  Status state() {
    std::lock_guard lock(mutex_);
    return failed_ ? failure() : Status{};
  }

  int size() const { return size_; }

 private:
  void fail(const std::string& reason) {
    if (!failed_) reason_ = reason;
    failed_ = true;
    changed_.notify_all();
  }
  Status failure() const { return {StatusCode::kInternal, "communicator failed: " + reason_}; }

  std::string missing_ranks() const {
    std::string ranks;
    for (int r = 0; r < size_; ++r) {
      if (arrived_in_[r] == generation_) continue;
      if (!ranks.empty()) ranks += ", ";
      ranks += std::to_string(r);
    }
    return ranks;
  }

  Status check_same_op() const {
    for (int r = 1; r < size_; ++r)
      if (slots_[r].op != slots_[0].op || slots_[r].dtype != slots_[0].dtype ||
          (slots_[r].op != "all_to_all_v" && slots_[r].counts != slots_[0].counts))
        return bad_argument("collective on rank " + std::to_string(r),
                            "the call rank 0 made (" + slots_[0].op + " of " + std::to_string(slots_[0].counts.size()) +
                                " count(s), " + std::string(dtype_name(slots_[0].dtype)) + ")",
                            slots_[r].op + ", " + std::string(dtype_name(slots_[r].dtype)));
    return {};
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Contribution> slots_;
  std::vector<uint64_t> arrived_in_;  // the generation each rank last arrived in
  int arrived_ = 0, departed_ = 0;
  uint64_t generation_ = 0;
  bool failed_ = false;
  std::string reason_;
};

float load(const void* data, DType dtype, size_t i) {
  return dtype == DType::kF32 ? static_cast<const float*>(data)[i] : bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
}

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Device device() const override { return Device::kCpu; }

  Status all_gather(const void* in, void* out, size_t count, DType dtype) override {
    std::vector<size_t> counts(size(), count);
    return gather("all_gather", in, out, counts, dtype);
  }

  Status all_gather_v(const void* in, void* out, std::span<const size_t> counts, DType dtype) override {
    if (static_cast<int>(counts.size()) != size())
      return bad_argument("all_gather_v counts", std::to_string(size()) + " entries", std::to_string(counts.size()));
    return gather("all_gather_v", in, out, {counts.begin(), counts.end()}, dtype);
  }

  Status reduce_scatter(const void* in, void* out, size_t count, DType dtype) override {
    return reduce("reduce_scatter", in, out, count, static_cast<size_t>(rank_) * count, dtype);
  }

  Status all_reduce(const void* in, void* out, size_t count, DType dtype) override {
    return reduce("all_reduce", in, out, count, 0, dtype);
  }

  Status all_to_all_v(const void* in, std::span<const size_t> send_counts, void* out,
                      std::span<const size_t> recv_counts, DType dtype) override {
    if (static_cast<int>(send_counts.size()) != size() || static_cast<int>(recv_counts.size()) != size())
      return bad_argument("all_to_all_v counts", std::to_string(size()) + " entries each",
                          std::to_string(send_counts.size()) + " and " + std::to_string(recv_counts.size()));
    const size_t element = dtype_size(dtype);
    std::vector<std::byte> scratch;
    Status status = group_->rendezvous(
        rank_, {"all_to_all_v", in, {send_counts.begin(), send_counts.end()}, dtype},
        [&](const std::vector<Contribution>& all) -> Status {
          for (int source = 0; source < size(); ++source) {
            const std::vector<size_t>& sent = all[source].counts;
            if (sent[rank_] != recv_counts[source])
              return bad_argument("all_to_all_v recv_counts[" + std::to_string(source) + "] on rank " + std::to_string(rank_),
                                  std::to_string(sent[rank_]) + " (what rank " + std::to_string(source) + " sends)",
                                  std::to_string(recv_counts[source]));
            const size_t offset = std::accumulate(sent.begin(), sent.begin() + rank_, size_t{0});
            const auto* block = static_cast<const std::byte*>(all[source].in) + offset * element;
            scratch.insert(scratch.end(), block, block + sent[rank_] * element);
          }
          return {};
        });
    if (status.ok() && !scratch.empty()) std::memcpy(out, scratch.data(), scratch.size());
    return status;
  }

  Status barrier() override {
    static const int kToken = 0;
    return group_->rendezvous(rank_, {"barrier", &kToken, {}, DType::kI32}, [](const auto&) { return Status(); });
  }

  // Every collective completes before it returns: only the group's failure is left to report.
  Status synchronize() override { return group_->state(); }

  void abort(const std::string& reason) override { group_->abort("rank " + std::to_string(rank_) + ": " + reason); }

 private:
  Status gather(const char* op, const void* in, void* out, std::vector<size_t> counts, DType dtype) {
    const size_t element = dtype_size(dtype);
    std::vector<std::byte> scratch;
    Status status = group_->rendezvous(rank_, {op, in, counts, dtype}, [&](const std::vector<Contribution>& all) {
      for (int r = 0; r < size(); ++r) {
        const auto* block = static_cast<const std::byte*>(all[r].in);
        scratch.insert(scratch.end(), block, block + counts[r] * element);
      }
      return Status();
    });
    if (status.ok() && !scratch.empty()) std::memcpy(out, scratch.data(), scratch.size());
    return status;
  }

  Status reduce(const char* op, const void* in, void* out, size_t count, size_t offset, DType dtype) {
    if (dtype != DType::kF32 && dtype != DType::kBF16)
      return bad_argument(std::string(op) + " dtype", "f32 or bf16", std::string(dtype_name(dtype)));
    std::vector<float> sum(count, 0.0f);
    Status status = group_->rendezvous(rank_, {op, in, {count}, dtype}, [&](const std::vector<Contribution>& all) {
      for (int r = 0; r < size(); ++r)  // rank order: the same sum on every rank, every run
        for (size_t i = 0; i < count; ++i) sum[i] += load(all[r].in, dtype, offset + i);
      return Status();
    });
    if (!status.ok()) return status;
    for (size_t i = 0; i < count; ++i) {
      if (dtype == DType::kF32) {
        static_cast<float*>(out)[i] = sum[i];
      } else {
        static_cast<uint16_t*>(out)[i] = f32_to_bf16(sum[i]);
      }
    }
    return {};
  }

  std::shared_ptr<ThreadGroup> group_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_group(int size, std::chrono::milliseconds timeout) {
  auto group = std::make_shared<ThreadGroup>(size, timeout);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(std::make_unique<ThreadCommunicator>(group, r));
  return ranks;
}

}  // namespace epmoe
