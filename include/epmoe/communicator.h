// Communicator: the only door to other ranks. Collectives over `size()` ranks with the
// semantics of NCCL's (every rank calls the same collectives in the same order with the
// same counts), summing in rank order where they reduce. Backends: in-process threads on
// the CPU (make_thread_group) and NCCL on GPUs (make_nccl_communicator). A collective that
// cannot complete (a rank missing past the timeout, a mismatched call, an abort) returns an
// error on every rank that takes part, and the communicator stays failed from then on.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/status.h"
#include "epmoe/tensor.h"

namespace epmoe {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where buffers passed to the collectives live.
  virtual Device device() const = 0;

  // out [size * count] = every rank's in [count], in rank order.
  virtual Status all_gather(const void* in, void* out, size_t count, DType dtype) = 0;
  // out = every rank's in [counts[r]], in rank order; counts is the same on every rank.
  virtual Status all_gather_v(const void* in, void* out, std::span<const size_t> counts, DType dtype) = 0;
  // out [count] = sum over ranks of block `rank()` of their in [size * count].
  virtual Status reduce_scatter(const void* in, void* out, size_t count, DType dtype) = 0;
  // out [count] = sum over ranks of in [count]; in may equal out.
  virtual Status all_reduce(const void* in, void* out, size_t count, DType dtype) = 0;
  // Sends send_counts[r] elements to rank r (in is those blocks in rank order) and receives
  // recv_counts[r] from rank r into out (in rank order).
  virtual Status all_to_all_v(const void* in, std::span<const size_t> send_counts, void* out,
                              std::span<const size_t> recv_counts, DType dtype) = 0;
  // Holds the calling thread until every rank has reached it.
  virtual Status barrier() = 0;
  // Collectives may return before they complete (NCCL: enqueued on the stream). This waits
  // until every collective this rank issued has completed, and returns the communicator's
  // failure if one failed or timed out.
  virtual Status synchronize() = 0;
  // Fails every pending and later collective on every rank with `reason`.
  virtual void abort(const std::string& reason) = 0;
};

// R communicators joined in one process, one per thread (rank r uses element r). Buffers are
// host memory; sums are f32 (bf16 and f32 data; i32 data can be gathered and exchanged).
// A rank that waits longer than `timeout` for the others fails the group.
std::vector<std::unique_ptr<Communicator>> make_thread_group(int size, std::chrono::milliseconds timeout);

}  // namespace epmoe

struct CUstream_st;

namespace epmoe {

// NCCL: one rank per GPU (one process per rank, or one thread per GPU). The ranks find each
// other through a bootstrap that rank 0 publishes: "file:/shared/path" (rank 0 writes the
// NCCL unique id there, the others wait for it) or "tcp:host:port" (rank 0 listens, the
// others connect). Collectives are enqueued on `stream` on device buffers and return at
// once (CUDA-graph capturable); a watchdog thread follows each one's completion and NCCL's
// asynchronous error, and aborts the communicator with a clear error when one fails or
// outlives `timeout` (a missing peer), instead of hanging. synchronize() reports it.
struct NcclOptions {
  int rank = 0, size = 1;
  std::string bootstrap;  // "file:PATH" or "tcp:HOST:PORT"
  std::chrono::milliseconds timeout{60000};
  int device = 0;                 // CUDA device of this rank
  CUstream_st* stream = nullptr;  // cudaStream_t; null: the default stream
};

// Whether this build has the NCCL backend (make_nccl_communicator fails clearly if not).
bool nccl_available();
Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions& options);

}  // namespace epmoe
