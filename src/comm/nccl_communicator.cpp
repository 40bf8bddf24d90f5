// The NCCL backend. Init is non-blocking (ncclCommInitRankConfig with blocking = 0) and
// polled with a deadline; every collective is enqueued on the rank's stream and returns at
// once, and a watchdog thread polls its completion and ncclCommGetAsyncError, so a peer
// that died or never came turns into an error (and ncclCommAbort) after the timeout, not
// a hang.
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>
#include <thread>

#include "epmoe/communicator.h"

namespace epmoe {

namespace {

using Clock = std::chrono::steady_clock;

Status nccl_error(const std::string& what, ncclResult_t result) {
  return {StatusCode::kInternal, what + ": " + ncclGetErrorString(result)};
}
Status cuda_failure(const std::string& what, cudaError_t error) {
  return {StatusCode::kInternal, what + ": " + cudaGetErrorString(error)};
}

Result<ncclDataType_t> nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kFP8E4M3: return ncclUint8;  // moved, never summed
  }
  return bad_argument("dtype", "a type NCCL can move", std::string(dtype_name(dtype)));
}

// The unique id through a file: rank 0 writes it atomically (rename), the others poll.
Status exchange_id_file(const std::string& path, int rank, ncclUniqueId& id, Clock::time_point deadline) {
  if (rank == 0) {
    const std::string temporary = path + ".tmp" + std::to_string(::getpid());
    std::ofstream out(temporary, std::ios::binary);
    out.write(id.internal, sizeof(id.internal));
    out.close();
    if (!out || std::rename(temporary.c_str(), path.c_str()) != 0)
      return Status::io_error("bootstrap file " + path + ": cannot write the NCCL id");
    return {};
  }
  while (Clock::now() < deadline) {
    std::ifstream in(path, std::ios::binary);
    if (in && in.read(id.internal, sizeof(id.internal))) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Status::io_error("bootstrap file " + path + ": no NCCL id from rank 0 before the timeout");
}

// The unique id over TCP: rank 0 listens on host:port and sends the id to size - 1 peers.
Status exchange_id_tcp(const std::string& host, const std::string& port, int rank, int size, ncclUniqueId& id,
                       Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* address = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &address) != 0 || !address)
    return bad_argument("bootstrap", "tcp:HOST:PORT with a resolvable host", host + ":" + port);
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned(address, freeaddrinfo);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status::io_error("bootstrap: socket() failed");
  auto close_fd = [&] { ::close(fd); };
  if (rank == 0) {
    const int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (bind(fd, address->ai_addr, address->ai_addrlen) != 0 || listen(fd, size) != 0) {
      close_fd();
      return Status::io_error("bootstrap: cannot listen on " + host + ":" + port);
    }
    for (int peer = 1; peer < size; ++peer) {
      timeval wait{static_cast<long>(std::chrono::duration_cast<std::chrono::seconds>(deadline - Clock::now()).count()) + 1, 0};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof(wait));
      const int client = accept(fd, nullptr, nullptr);
      if (client < 0) {
        close_fd();
        return Status::io_error("bootstrap: only " + std::to_string(peer - 1) + " of " + std::to_string(size - 1) +
                                " peers connected to " + host + ":" + port + " before the timeout");
      }
      const bool sent = send(client, id.internal, sizeof(id.internal), 0) == static_cast<ssize_t>(sizeof(id.internal));
      ::close(client);
      if (!sent) {
        close_fd();
        return Status::io_error("bootstrap: sending the NCCL id failed");
      }
    }
    close_fd();
    return {};
  }
  while (connect(fd, address->ai_addr, address->ai_addrlen) != 0) {
    if (Clock::now() >= deadline) {
      close_fd();
      return Status::io_error("bootstrap: rank 0 at " + host + ":" + port + " did not answer before the timeout");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  size_t received = 0;
  while (received < sizeof(id.internal)) {
    const ssize_t n = recv(fd, id.internal + received, sizeof(id.internal) - received, 0);
    if (n <= 0) break;
    received += static_cast<size_t>(n);
  }
  close_fd();
  if (received != sizeof(id.internal)) return Status::io_error("bootstrap: short NCCL id from rank 0");
  return {};
}

// Collectives are enqueued and return at once; a watchdog thread follows each one's
// completion event and NCCL's asynchronous error, and aborts the communicator when one
// fails or outlives the timeout, so a dead peer becomes an error, never a hang.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, const NcclOptions& options)
      : comm_(comm), options_(options), watchdog_([this] { watch(); }) {}
  ~NcclCommunicator() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    watchdog_.join();
    for (const Pending& pending : pending_) cudaEventDestroy(pending.done);
    if (comm_) ncclCommDestroy(comm_);
    if (scratch_) cudaFree(scratch_);
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  Device device() const override { return Device::kCuda; }

  Status all_gather(const void* in, void* out, size_t count, DType dtype) override {
    return run("all_gather", dtype, [&](ncclDataType_t type) {
      return ncclAllGather(in, out, count, type, comm_, stream());
    });
  }

  Status all_gather_v(const void* in, void* out, std::span<const size_t> counts, DType dtype) override {
    if (static_cast<int>(counts.size()) != size())
      return bad_argument("all_gather_v counts", std::to_string(size()) + " entries", std::to_string(counts.size()));
    std::vector<size_t> sends(size(), counts[rank()]);
    return exchange("all_gather_v", in, sends, out, counts, dtype, /*same_block_to_all=*/true);
  }

  Status reduce_scatter(const void* in, void* out, size_t count, DType dtype) override {
    return run("reduce_scatter", dtype, [&](ncclDataType_t type) {
      return ncclReduceScatter(in, out, count, type, ncclSum, comm_, stream());
    });
  }

  Status all_reduce(const void* in, void* out, size_t count, DType dtype) override {
    return run("all_reduce", dtype, [&](ncclDataType_t type) {
      return ncclAllReduce(in, out, count, type, ncclSum, comm_, stream());
    });
  }

  Status all_to_all_v(const void* in, std::span<const size_t> send_counts, void* out,
                      std::span<const size_t> recv_counts, DType dtype) override {
    if (static_cast<int>(send_counts.size()) != size() || static_cast<int>(recv_counts.size()) != size())
      return bad_argument("all_to_all_v counts", std::to_string(size()) + " entries each",
                          std::to_string(send_counts.size()) + " and " + std::to_string(recv_counts.size()));
    return exchange("all_to_all_v", in, send_counts, out, recv_counts, dtype, false);
  }

  // A barrier holds the host: an all-reduce of one value, then its completion.
  Status barrier() override {
    if (!scratch_) {
      if (const cudaError_t e = cudaMalloc(&scratch_, sizeof(int32_t)); e != cudaSuccess)
        return cuda_failure("barrier scratch", e);
    }
    EPMOE_RETURN_IF_ERROR(all_reduce(scratch_, scratch_, 1, DType::kI32));
    return synchronize();
  }

  Status synchronize() override {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return pending_.empty() || failed_; });
    return failed_ ? failure() : Status{};
  }

  // Aborting the NCCL communicator releases this rank; its peers' pending collectives
  // then fail at their timeout.
  void abort(const std::string& reason) override {
    std::lock_guard lock(mutex_);
    (void)fail_locked("rank " + std::to_string(rank()) + ": " + reason);
  }

 private:
  // One enqueued collective: its completion event and the time by which it must be done.
  struct Pending {
    cudaEvent_t done;
    const char* op;
    Clock::time_point deadline;
  };

  cudaStream_t stream() const { return reinterpret_cast<cudaStream_t>(options_.stream); }

  Status failure() const { return {StatusCode::kInternal, "communicator failed: " + reason_}; }

  // Enqueues `enqueue(type)` on the stream and hands its completion to the watchdog. The
  // lock keeps an abort from the watchdog or another thread out of the NCCL calls.
  template <typename Enqueue>
  Status run(const char* op, DType dtype, Enqueue enqueue) {
    std::unique_lock lock(mutex_);
    if (failed_) return failure();
    Result<ncclDataType_t> type = nccl_type(dtype);
    if (!type.ok()) return type.status();
    if (const cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess) return cuda_failure("cudaSetDevice", e);
    const auto deadline = Clock::now() + options_.timeout;
    ncclResult_t result = enqueue(type.value());
    // A non-blocking communicator may still be enqueueing (connecting to peers, say).
    while (result == ncclInProgress) {
      if (const ncclResult_t r = ncclCommGetAsyncError(comm_, &result); r != ncclSuccess) result = r;
      if (result == ncclInProgress && Clock::now() >= deadline) return fail_locked(timed_out(op).message());
      if (result == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (result != ncclSuccess) return fail_locked(nccl_error(op, result).message());
    // Inside a CUDA graph capture nothing runs yet: there is no completion to watch.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (const cudaError_t e = cudaStreamIsCapturing(stream(), &capture); e != cudaSuccess)
      return fail_locked(cuda_failure(op, e).message());
    if (capture != cudaStreamCaptureStatusNone) return {};
    cudaEvent_t done = nullptr;
    if (const cudaError_t e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming); e != cudaSuccess)
      return fail_locked(cuda_failure(op, e).message());
    if (const cudaError_t e = cudaEventRecord(done, stream()); e != cudaSuccess) {
      cudaEventDestroy(done);
      return fail_locked(cuda_failure(op, e).message());
    }
    pending_.push_back({done, op, deadline});
    lock.unlock();
    changed_.notify_all();
    return {};
  }

  // Grouped point-to-point: to each peer its block of `in`, from each peer into `out`.
  Status exchange(const char* op, const void* in, std::span<const size_t> send_counts, void* out,
                  std::span<const size_t> recv_counts, DType dtype, bool same_block_to_all) {
    const size_t element = dtype_size(dtype);
    return run(op, dtype, [&](ncclDataType_t type) {
      const auto* source = static_cast<const std::byte*>(in);
      auto* target = static_cast<std::byte*>(out);
      ncclResult_t result = ncclGroupStart();
      size_t send_offset = 0, recv_offset = 0;
      for (int peer = 0; peer < size() && result == ncclSuccess; ++peer) {
        if (send_counts[peer] > 0)
          result = ncclSend(source + (same_block_to_all ? 0 : send_offset) * element, send_counts[peer], type, peer,
                            comm_, stream());
        if (result == ncclSuccess && recv_counts[peer] > 0)
          result = ncclRecv(target + recv_offset * element, recv_counts[peer], type, peer, comm_, stream());
        send_offset += send_counts[peer];
        recv_offset += recv_counts[peer];
      }
      const ncclResult_t ended = ncclGroupEnd();
      return result != ncclSuccess ? result : ended;
    });
  }

  Status timed_out(const char* op) const {
    return {StatusCode::kInternal, std::string(op) + " on rank " + std::to_string(rank()) + " did not finish within " +
                                       std::to_string(options_.timeout.count()) + " ms (a peer missing?)"};
  }

  // The watchdog: retires completed collectives in order, and fails the communicator on
  // NCCL's asynchronous error, a CUDA error, or a collective past its deadline.
  void watch() {
    const cudaError_t device_set = cudaSetDevice(options_.device);
    std::unique_lock lock(mutex_);
    // (Its event queries would ask another device: the communicator fails instead.)
    if (device_set != cudaSuccess) (void)fail_locked(cuda_failure("the watchdog's cudaSetDevice", device_set).message());
    while (true) {
      changed_.wait(lock, [&] { return stopping_ || (!pending_.empty() && !failed_); });
      if (stopping_) return;
      ncclResult_t state = ncclSuccess;
      const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
      if (asked != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
        (void)fail_locked(nccl_error(pending_.front().op, asked != ncclSuccess ? asked : state).message());
        continue;
      }
      while (!pending_.empty()) {
        const cudaError_t query = cudaEventQuery(pending_.front().done);
        if (query == cudaErrorNotReady) break;
        if (query != cudaSuccess) {
          (void)fail_locked(cuda_failure(pending_.front().op, query).message());
          break;
        }
        cudaEventDestroy(pending_.front().done);
        pending_.pop_front();
      }
      if (failed_) continue;
      if (pending_.empty()) {
        changed_.notify_all();
        continue;
      }
      if (Clock::now() >= pending_.front().deadline) {
        (void)fail_locked(timed_out(pending_.front().op).message());
        continue;
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lock.lock();
    }
  }

  // The first failure wins; the NCCL communicator is aborted once, waiters are woken.
  Status fail_locked(const std::string& reason) {
    if (!failed_) {
      failed_ = true;
      reason_ = reason;
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    changed_.notify_all();
    return failure();
  }

  ncclComm_t comm_;
  NcclOptions options_;
  void* scratch_ = nullptr;
  std::mutex mutex_;                  // guards what follows, and comm_ against abort
  std::condition_variable changed_;   // pending_, failed_ or stopping_ changed
  std::deque<Pending> pending_;       // enqueued collectives, oldest first
  bool failed_ = false;
  bool stopping_ = false;
  std::string reason_;
  std::thread watchdog_;  // last: started once everything above exists
};

}  // namespace

bool nccl_available() { return true; }

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions& options) {
  if (options.size <= 0 || options.rank < 0 || options.rank >= options.size)
    return bad_argument("rank/size", "0 <= rank < size", std::to_string(options.rank) + "/" + std::to_string(options.size));
  if (const cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess)
    return cuda_failure("cudaSetDevice(" + std::to_string(options.device) + ")", e);
  const auto deadline = Clock::now() + options.timeout;
  ncclUniqueId id{};
  if (options.rank == 0)
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return nccl_error("ncclGetUniqueId", r);
  const std::string& how = options.bootstrap;
  Status shared;
  if (how.rfind("file:", 0) == 0) {
    shared = exchange_id_file(how.substr(5), options.rank, id, deadline);
  } else if (how.rfind("tcp:", 0) == 0 && how.find(':', 4) != std::string::npos) {
    const size_t colon = how.rfind(':');
    shared = exchange_id_tcp(how.substr(4, colon - 4), how.substr(colon + 1), options.rank, options.size, id, deadline);
  } else {
    return bad_argument("bootstrap", "file:PATH or tcp:HOST:PORT", in_quotes(how));
  }
  if (!shared.ok()) return shared;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t result = ncclCommInitRankConfig(&comm, options.size, id, options.rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) return nccl_error("ncclCommInitRankConfig", result);
  while (true) {
    ncclResult_t state = ncclInProgress;
    if (comm) ncclCommGetAsyncError(comm, &state);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      ncclCommAbort(comm);
      return nccl_error("NCCL init on rank " + std::to_string(options.rank), state);
    }
    if (Clock::now() >= deadline) {
      if (comm) ncclCommAbort(comm);
      return Status(StatusCode::kInternal, "NCCL init on rank " + std::to_string(options.rank) + " of " +
                                               std::to_string(options.size) + " did not complete within " +
                                               std::to_string(options.timeout.count()) + " ms (are all ranks running?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(comm, options));
}

}  // namespace epmoe
