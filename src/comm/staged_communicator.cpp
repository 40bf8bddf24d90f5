#include "comm/staged_communicator.h"

#include <numeric>

#ifdef EPMOE_WITH_CUDA
#include "epmoe/device_case.h"
#endif

namespace epmoe {

#ifdef EPMOE_WITH_CUDA
namespace {

class StagedCommunicator final : public Communicator {
 public:
  explicit StagedCommunicator(Communicator& device) : device_(device) {}

  int rank() const override { return device_.rank(); }
  int size() const override { return device_.size(); }
  Device device() const override { return Device::kCpu; }

  Status all_gather(const void* in, void* out, size_t count, DType dtype) override {
    return staged(in, count, out, count * size(), dtype,
                  [&](const void* d_in, void* d_out) { return device_.all_gather(d_in, d_out, count, dtype); });
  }
  Status all_gather_v(const void* in, void* out, std::span<const size_t> counts, DType dtype) override {
    const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    return staged(in, counts[rank()], out, total, dtype,
                  [&](const void* d_in, void* d_out) { return device_.all_gather_v(d_in, d_out, counts, dtype); });
  }
  Status reduce_scatter(const void* in, void* out, size_t count, DType dtype) override {
    return staged(in, count * size(), out, count, dtype,
                  [&](const void* d_in, void* d_out) { return device_.reduce_scatter(d_in, d_out, count, dtype); });
  }
  Status all_reduce(const void* in, void* out, size_t count, DType dtype) override {
    return staged(in, count, out, count, dtype,
                  [&](const void* d_in, void* d_out) { return device_.all_reduce(d_in, d_out, count, dtype); });
  }
  Status all_to_all_v(const void* in, std::span<const size_t> send_counts, void* out,
                      std::span<const size_t> recv_counts, DType dtype) override {
    const size_t sent = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
    const size_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    return staged(in, sent, out, received, dtype, [&](const void* d_in, void* d_out) {
      return device_.all_to_all_v(d_in, send_counts, d_out, recv_counts, dtype);
    });
  }
  Status barrier() override { return device_.barrier(); }
  Status synchronize() override { return device_.synchronize(); }
  void abort(const std::string& reason) override { device_.abort(reason); }

 private:
  template <typename Collective>
  Status staged(const void* in, size_t in_count, void* out, size_t out_count, DType dtype, Collective collective) {
    const size_t element = dtype_size(dtype);
    Result<DeviceBuffer> d_in = DeviceBuffer::allocate(in_count * element);
    Result<DeviceBuffer> d_out = DeviceBuffer::allocate(out_count * element);
    if (!d_in.ok()) return d_in.status();
    if (!d_out.ok()) return d_out.status();
    const auto as_tensor = [&](const void* data, size_t count) {
      return Tensor::contiguous(const_cast<void*>(data), dtype, {static_cast<int64_t>(count)});
    };
    EPMOE_RETURN_IF_ERROR(copy_to_device(as_tensor(in, in_count), d_in->data()));
    EPMOE_RETURN_IF_ERROR(collective(d_in->data(), d_out->data()));
    EPMOE_RETURN_IF_ERROR(device_.synchronize());  // the collective runs on its own stream
    return copy_to_host(d_out->data(), as_tensor(out, out_count));
  }

  Communicator& device_;
};

}  // namespace
#endif

Result<std::unique_ptr<Communicator>> make_host_view(Communicator& device) {
#ifdef EPMOE_WITH_CUDA
  if (device.device() == Device::kCuda) return std::unique_ptr<Communicator>(std::make_unique<StagedCommunicator>(device));
#endif
  return bad_argument("communicator", "a device communicator to stage", std::string(device_name(device.device())));
}

}  // namespace epmoe
