#include "epmoe/ep_moe.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "epmoe/moe_case.h"
#include "comm/staged_communicator.h"
#ifdef EPMOE_WITH_CUDA
#include "epmoe/device_case.h"
#endif
#include "epmoe/moe_cpu.h"
#ifdef EPMOE_WITH_CUDA
#include <cuda_runtime.h>

#include "ep/device_compute.h"
#endif

namespace epmoe {

namespace {

constexpr std::pair<EpStrategy, std::string_view> kStrategyNames[] = {
    {EpStrategy::kReplicateAllReduce, "replicate_all_reduce"},
    {EpStrategy::kAllGatherReduceScatter, "all_gather_reduce_scatter"},
    {EpStrategy::kAllToAll, "all_to_all"}};

uint64_t fnv1a(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : text) hash = (hash ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return hash;
}

// This rank's routing of its rows: ids [T, k], weights [T, k].
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Result<Routing> route_rows(const EpLayer& layer, const Tensor& logits) {
  const int64_t T = logits.size(0), k = layer.spec.routing.top_k;
  Routing routing{std::vector<int32_t>(T * k), std::vector<float>(T * k)};
  const Status status = route_cpu(layer.spec.routing, logits, layer.correction_bias,
                                  Tensor::contiguous(routing.ids.data(), DType::kI32, {T, k}),
                                  Tensor::contiguous(routing.weights.data(), DType::kF32, {T, k}));
  if (!status.ok()) return status;
  return routing;
}

// pairs_per_local_expert[l] += the pairs of `topk_ids` on local expert l.
void count_local_pairs(const ExpertMap& experts, const std::vector<int32_t>& topk_ids,
                       std::vector<int64_t>& pairs_per_local_expert) {
  for (int32_t id : topk_ids)
    if (id >= 0 && id < experts.num_experts() && experts.local_index(id) >= 0)
      ++pairs_per_local_expert[experts.local_index(id)];
}

// The CPU operator on `x` [rows, H] with given routing, this rank's experts, and the
// shared experts when `with_shared`; the output has x's dtype.
Result<Buffer> compute_local(const EpLayer& layer, const Tensor& x, Routing& routing, bool with_shared,
                             std::vector<int64_t>& pairs_per_local_expert) {
  const int64_t rows = x.size(0), k = layer.spec.routing.top_k;
  MoeInputs inputs;
  inputs.x = x;
  inputs.topk_ids = Tensor::contiguous(routing.ids.data(), DType::kI32, {rows, k});
  inputs.topk_weights = Tensor::contiguous(routing.weights.data(), DType::kF32, {rows, k});
  inputs.expert_map = layer.experts.view();
  MoeWeights weights = layer.weights;
  if (!with_shared) {
    weights.shared_w13.reset();
    weights.shared_w2.reset();
    weights.shared_w13_scale.reset();
    weights.shared_w2_scale.reset();
  }
  Buffer out(x.dtype, {rows, x.size(1)});
  if (weights.w13.device == Device::kCuda) {
#ifdef EPMOE_WITH_CUDA
    Result<Buffer> computed = moe_on_device(layer.spec, weights, layer.experts, x, routing.ids, routing.weights);
    if (!computed.ok()) return computed.status();
    out = std::move(computed).value();
#else
    return Status::unsupported("EpMoe: device weights in a build without CUDA");
#endif
  } else {
    const Status status = moe_forward_cpu(layer.spec, weights, inputs, out.view());
    if (!status.ok()) return status;
  }
  count_local_pairs(layer.experts, routing.ids, pairs_per_local_expert);
  return out;
}

size_t row_bytes(const Tensor& x) { return static_cast<size_t>(x.size(1)) * dtype_size(x.dtype); }

}  // namespace

EpLayer slice_layer(const MoeCase& whole, const ExpertMap& experts) {
  EpLayer layer;
  layer.spec = whole.spec;
  layer.experts = experts;
  layer.weights = whole.weights;
  layer.correction_bias = whole.inputs.correction_bias;
  auto rows_of = [&](const Tensor& all) {
    std::vector<int64_t> shape(all.shape.begin(), all.shape.begin() + all.rank);
    shape[0] = experts.num_local();
    auto buffer = std::make_shared<Buffer>(all.dtype, shape);
    const size_t per_expert = all.nbytes() / static_cast<size_t>(all.size(0));
    for (int i = 0; i < experts.num_local(); ++i)
      std::memcpy(buffer->data_as<std::byte>() + i * per_expert,
                  static_cast<const std::byte*>(all.data) + experts.global_ids()[i] * per_expert, per_expert);
    layer.storage.push_back(buffer);
    return buffer->view();
  };
  layer.weights.w13 = rows_of(whole.weights.w13);
  layer.weights.w2 = rows_of(whole.weights.w2);
  if (whole.weights.w13_scale) layer.weights.w13_scale = rows_of(*whole.weights.w13_scale);
  if (whole.weights.w2_scale) layer.weights.w2_scale = rows_of(*whole.weights.w2_scale);
  return layer;
}

std::string_view ep_strategy_name(EpStrategy strategy) {
  for (const auto& [value, name] : kStrategyNames)
    if (value == strategy) return name;
  return "unknown";
}

Result<EpStrategy> parse_ep_strategy(std::string_view name) {
  for (const auto& [value, text] : kStrategyNames)
    if (text == name) return value;
  return bad_argument("strategy", "replicate_all_reduce, all_gather_reduce_scatter or all_to_all", in_quotes(name));
}

Result<EpMoe> EpMoe::create(Communicator& device_comm, EpLayer layer, EpStrategy strategy) {
  // The control plane works on host data; a GPU communicator is reached through a host view.
  std::shared_ptr<Communicator> staged;
  if (device_comm.device() == Device::kCuda) {
    Result<std::unique_ptr<Communicator>> view = make_host_view(device_comm);
    if (!view.ok()) return view.status();
    staged = std::move(view).value();
  }
  Communicator& comm = staged ? *staged : device_comm;
  std::optional<Tensor> device_bias;
  if (layer.correction_bias && layer.correction_bias->device == Device::kCuda) {
    device_bias = layer.correction_bias;
#ifdef EPMOE_WITH_CUDA
    auto host_bias = std::make_shared<Buffer>(DType::kF32, std::initializer_list<int64_t>{layer.correction_bias->numel()});
    EPMOE_RETURN_IF_ERROR(copy_to_host(layer.correction_bias->data, host_bias->view()));
    layer.correction_bias = host_bias->view();
    layer.storage.push_back(host_bias);
#endif
  }
  const int R = comm.size(), E = layer.spec.routing.num_experts;
  // What every rank must agree on, and whether this rank's own layer is well formed.
  Status local = validate_spec(layer.spec);
  if (local.ok() && layer.experts.num_experts() != E)
    local = bad_argument("experts", "a map over " + std::to_string(E) + " experts",
                         std::to_string(layer.experts.num_experts()));
  if (local.ok() && (layer.weights.w13.rank != 3 || layer.weights.w13.size(0) != layer.experts.num_local()))
    local = bad_argument("weights.w13", std::to_string(layer.experts.num_local()) + " experts (the rank's) in [E_local, 2I, H]",
                         layer.weights.w13.describe());
  const int64_t H = layer.weights.w13.rank == 3 ? layer.weights.w13.size(2) : 0;
  const int64_t I = layer.weights.w13.rank == 3 ? layer.weights.w13.size(1) / 2 : 0;
  const int64_t Is = layer.weights.shared_w13 ? layer.weights.shared_w13->size(0) / 2 : 0;
  const uint64_t hash = fnv1a(spec_to_json(layer.spec));
  constexpr int kFields = 8;
  const int32_t mine[kFields] = {static_cast<int32_t>(hash), static_cast<int32_t>(hash >> 32), E, static_cast<int32_t>(H),
                                 static_cast<int32_t>(I), static_cast<int32_t>(Is), static_cast<int32_t>(strategy),
                                 local.ok() ? 1 : 0};
  std::vector<int32_t> all(kFields * R);
  EPMOE_RETURN_IF_ERROR(comm.all_gather(mine, all.data(), kFields, DType::kI32));
  for (int r = 0; r < R; ++r) {
    if (all[r * kFields + 7] == 0)
      return r == comm.rank() ? local
                              : Status::invalid_argument("EpMoe: rank " + std::to_string(r) +
                                                         " rejected its layer (its error says why)");
    if (!std::equal(all.begin(), all.begin() + 7, all.begin() + r * kFields))
      return bad_argument("EpMoe on rank " + std::to_string(r),
                          "the spec, sizes and strategy of rank 0 (E=" + std::to_string(all[2]) + " H=" +
                              std::to_string(all[3]) + " I=" + std::to_string(all[4]) + " I_s=" + std::to_string(all[5]) +
                              ", " + std::string(ep_strategy_name(static_cast<EpStrategy>(all[6]))) + ")",
                          "E=" + std::to_string(all[r * kFields + 2]) + " H=" + std::to_string(all[r * kFields + 3]) +
                              " I=" + std::to_string(all[r * kFields + 4]) + " I_s=" + std::to_string(all[r * kFields + 5]) +
                              ", " + std::string(ep_strategy_name(static_cast<EpStrategy>(all[r * kFields + 6]))) +
                              (all[r * kFields] != all[0] || all[r * kFields + 1] != all[1] ? ", a different spec" : ""));
  }
  // The experts must be partitioned: each owned by exactly one rank.
  std::vector<int32_t> owned(E), owners(static_cast<size_t>(E) * R);
  for (int e = 0; e < E; ++e) owned[e] = layer.experts.local_index(e) >= 0 ? 1 : 0;
  EPMOE_RETURN_IF_ERROR(comm.all_gather(owned.data(), owners.data(), E, DType::kI32));
  std::vector<int32_t> owner_of(E);
  for (int e = 0; e < E; ++e) {
    std::string ranks;
    int count = 0;
    for (int r = 0; r < R; ++r)
      if (owners[static_cast<size_t>(r) * E + e]) {
        if (count++) ranks += ", ";
        ranks += std::to_string(r);
        owner_of[e] = r;
      }
    if (count != 1)
      return bad_argument("expert placement", "every expert on exactly one rank",
                          "expert " + std::to_string(e) + (count ? " on ranks " + ranks : " on no rank"));
  }
  std::shared_ptr<DeviceExperts> device_experts;
#ifdef EPMOE_WITH_CUDA
  if (staged && layer.weights.w13.device == Device::kCuda) {
    Result<DeviceExperts> made = DeviceExperts::create(layer.spec, layer.weights, layer.experts, device_bias);
    if (!made.ok()) return made.status();
    device_experts = std::make_shared<DeviceExperts>(std::move(made).value());
  }
#endif
  return EpMoe(comm, device_comm, std::move(staged), std::move(layer), strategy, std::move(owner_of),
               std::move(device_experts));
}

Status EpMoe::forward(const Tensor& x, const Tensor& router_logits, const Tensor& out, EpStats* stats) {
  const int R = comm_->size();
  EpStats local_stats;
  EpStats& s = stats ? *stats : local_stats;
  s = EpStats{};
  s.rows_sent.assign(R, 0);
  s.rows_received.assign(R, 0);
  s.pairs_per_local_expert.assign(layer_.experts.num_local(), 0);
  if (x.rank != 2 || !router_logits.has_shape({x.size(0), layer_.spec.routing.num_experts}) ||
      !out.has_shape({x.size(0), x.size(1)}) || out.dtype != x.dtype)
    return bad_argument("EpMoe::forward", "x [T, H], router_logits [T, E] and out [T, H] of x's dtype",
                        x.describe() + ", " + router_logits.describe() + ", " + out.describe());
  if (x.device == Device::kCuda) {
#ifdef EPMOE_WITH_CUDA
    if (device_experts_ && strategy_ == EpStrategy::kReplicateAllReduce)
      return replicate_all_reduce_on_device(x, router_logits, out, s);
    if (device_experts_ && strategy_ == EpStrategy::kAllGatherReduceScatter)
      return all_gather_reduce_scatter_on_device(x, router_logits, out, s);
    // all_to_all: routing and packing run on the host (copies of x and the logits); experts on the GPU.
    Buffer host_x(x.dtype, {x.size(0), x.size(1)}), host_logits(router_logits.dtype, {x.size(0), router_logits.size(1)});
    Buffer host_out(out.dtype, {out.size(0), out.size(1)});
    EPMOE_RETURN_IF_ERROR(copy_to_host(x.data, host_x.view()));
    EPMOE_RETURN_IF_ERROR(copy_to_host(router_logits.data, host_logits.view()));
    EPMOE_RETURN_IF_ERROR(run_strategy(host_x.view(), host_logits.view(), host_out.view(), s));
    return copy_to_device(host_out.view(), out.data);
#else
    return Status::unsupported("EpMoe: device tensors in a build without CUDA");
#endif
  }
  return run_strategy(x, router_logits, out, s);
}

Status EpMoe::run_strategy(const Tensor& x, const Tensor& router_logits, const Tensor& out, EpStats& s) {
  switch (strategy_) {
    case EpStrategy::kReplicateAllReduce: return replicate_all_reduce(x, router_logits, out, s);
    case EpStrategy::kAllGatherReduceScatter: return all_gather_reduce_scatter(x, router_logits, out, s);
    case EpStrategy::kAllToAll: return all_to_all(x, router_logits, out, s);
  }
  return bad_argument("strategy", "a known strategy", std::to_string(static_cast<int>(strategy_)));
}

Status EpMoe::replicate_all_reduce(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& s) {
  Result<Routing> routing = route_rows(layer_, logits);
  if (!routing.ok()) return routing.status();
  Result<Buffer> partial = compute_local(layer_, x, routing.value(), comm_->rank() == 0, s.pairs_per_local_expert);
  if (!partial.ok()) return partial.status();
  const size_t count = static_cast<size_t>(x.numel());
  // A ring all-reduce moves about 2 (R - 1) / R of the buffer each way.
  s.bytes_sent = s.bytes_received = static_cast<int64_t>(2.0 * (comm_->size() - 1) / comm_->size() * out.nbytes());
  return comm_->all_reduce(partial->view().data, out.data, count, x.dtype);
}

Status EpMoe::all_gather_reduce_scatter(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& s) {
  const int R = comm_->size(), k = layer_.spec.routing.top_k;
  const int64_t T = x.size(0), H = x.size(1);
  std::vector<int32_t> counts(R);
  const int32_t mine = static_cast<int32_t>(T);
  EPMOE_RETURN_IF_ERROR(comm_->all_gather(&mine, counts.data(), 1, DType::kI32));
  const int64_t T_max = *std::max_element(counts.begin(), counts.end());
  Result<Routing> routing = route_rows(layer_, logits);
  if (!routing.ok()) return routing.status();
  // Pad to T_max rows: zero rows with weight 0 contribute exactly zero.
  Buffer x_padded(x.dtype, {T_max, H});
  std::memcpy(x_padded.view().data, x.data, x.nbytes());
  Routing padded{std::vector<int32_t>(T_max * k, 0), std::vector<float>(T_max * k, 0.0f)};
  std::copy(routing->ids.begin(), routing->ids.end(), padded.ids.begin());
  std::copy(routing->weights.begin(), routing->weights.end(), padded.weights.begin());
  Buffer x_all(x.dtype, {R * T_max, H});
  Routing all{std::vector<int32_t>(R * T_max * k), std::vector<float>(R * T_max * k)};
  EPMOE_RETURN_IF_ERROR(comm_->all_gather(x_padded.view().data, x_all.view().data, T_max * H, x.dtype));
  EPMOE_RETURN_IF_ERROR(comm_->all_gather(padded.ids.data(), all.ids.data(), T_max * k, DType::kI32));
  EPMOE_RETURN_IF_ERROR(comm_->all_gather(padded.weights.data(), all.weights.data(), T_max * k, DType::kF32));
  Result<Buffer> partial = compute_local(layer_, x_all.view(), all, comm_->rank() == 0, s.pairs_per_local_expert);
  if (!partial.ok()) return partial.status();
  Buffer mine_out(x.dtype, {T_max, H});
  EPMOE_RETURN_IF_ERROR(comm_->reduce_scatter(partial->view().data, mine_out.view().data, T_max * H, x.dtype));
  std::memcpy(out.data, mine_out.view().data, out.nbytes());
  const int64_t row = static_cast<int64_t>(row_bytes(x) + k * 8);
  for (int r = 0; r < R; ++r) {
    s.rows_sent[r] = r == comm_->rank() ? 0 : T_max;
    s.rows_received[r] = r == comm_->rank() ? 0 : T_max;
  }
  s.bytes_sent = s.bytes_received = (R - 1) * T_max * (row + H * static_cast<int64_t>(dtype_size(x.dtype)));
  return {};
}

Status EpMoe::all_to_all(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& s) {
  const int R = comm_->size(), me = comm_->rank(), k = layer_.spec.routing.top_k;
  const int64_t T = x.size(0), H = x.size(1);
  const size_t row = row_bytes(x);
  Result<Routing> routing = route_rows(layer_, logits);
  if (!routing.ok()) return routing.status();
  const std::vector<int32_t>& owner_of = owner_of_;

  // Rows to send to each other rank: tokens with at least one expert there, in token order.
  std::vector<std::vector<int64_t>> destined(R);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<bool> sent(R, false);
    for (int j = 0; j < k; ++j) {
      const int r = owner_of[routing->ids[t * k + j]];
      if (r != me && !sent[r]) {
        sent[r] = true;
        destined[r].push_back(t);
      }
    }
  }
  std::vector<size_t> send_rows(R), recv_rows(R);
  for (int r = 0; r < R; ++r) send_rows[r] = destined[r].size();
  {
    std::vector<size_t> ones(R, 1);
    std::vector<int64_t> sends(send_rows.begin(), send_rows.end()), received(R);
    EPMOE_RETURN_IF_ERROR(comm_->all_to_all_v(sends.data(), ones, received.data(), ones, DType::kI64));
    for (int r = 0; r < R; ++r) recv_rows[r] = static_cast<size_t>(received[r]);
  }
  const size_t total_send = std::accumulate(send_rows.begin(), send_rows.end(), size_t{0});
  const size_t total_recv = std::accumulate(recv_rows.begin(), recv_rows.end(), size_t{0});
  Buffer send_x(x.dtype, {static_cast<int64_t>(total_send), H});
  Routing send_routing{std::vector<int32_t>(total_send * k), std::vector<float>(total_send * k)};
  size_t cursor = 0;
  for (int r = 0; r < R; ++r)
    for (int64_t t : destined[r]) {
      std::memcpy(send_x.data_as<std::byte>() + cursor * row, static_cast<const std::byte*>(x.data) + t * row, row);
      std::copy_n(routing->ids.begin() + t * k, k, send_routing.ids.begin() + cursor * k);
      std::copy_n(routing->weights.begin() + t * k, k, send_routing.weights.begin() + cursor * k);
      ++cursor;
    }
  auto scaled = [](const std::vector<size_t>& rows, size_t per_row) {
    std::vector<size_t> counts(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) counts[r] = rows[r] * per_row;
    return counts;
  };
  Buffer recv_x(x.dtype, {static_cast<int64_t>(total_recv), H});
  Routing recv_routing{std::vector<int32_t>(total_recv * k), std::vector<float>(total_recv * k)};
  EPMOE_RETURN_IF_ERROR(comm_->all_to_all_v(send_x.view().data, scaled(send_rows, H), recv_x.view().data,
                                            scaled(recv_rows, H), x.dtype));
  EPMOE_RETURN_IF_ERROR(comm_->all_to_all_v(send_routing.ids.data(), scaled(send_rows, k), recv_routing.ids.data(),
                                            scaled(recv_rows, k), DType::kI32));
  EPMOE_RETURN_IF_ERROR(comm_->all_to_all_v(send_routing.weights.data(), scaled(send_rows, k),
                                            recv_routing.weights.data(), scaled(recv_rows, k), DType::kF32));

  // Received rows: this rank's experts only. Own rows: this rank's experts and the shared ones.
  Result<Buffer> partial = compute_local(layer_, recv_x.view(), recv_routing, false, s.pairs_per_local_expert);
  if (!partial.ok()) return partial.status();
  Result<Buffer> own = compute_local(layer_, x, routing.value(), true, s.pairs_per_local_expert);
  if (!own.ok()) return own.status();
  Buffer returned(x.dtype, {static_cast<int64_t>(total_send), H});
  EPMOE_RETURN_IF_ERROR(comm_->all_to_all_v(partial->view().data, scaled(recv_rows, H), returned.view().data,
                                            scaled(send_rows, H), x.dtype));

  // y[t] = own[t] + the returned partials, in rank order.
  std::vector<float> sum(static_cast<size_t>(T * H));
  auto value = [&](const Tensor& tensor, int64_t i) {
    return tensor.dtype == DType::kF32 ? tensor.data_as<float>()[i] : bf16_to_f32(tensor.data_as<uint16_t>()[i]);
  };
  for (int64_t i = 0; i < T * H; ++i) sum[i] = value(own->view(), i);
  cursor = 0;
  for (int r = 0; r < R; ++r)
    for (int64_t t : destined[r]) {
      for (int64_t h = 0; h < H; ++h) sum[t * H + h] += value(returned.view(), static_cast<int64_t>(cursor) * H + h);
      ++cursor;
    }
  for (int64_t i = 0; i < T * H; ++i) {
    if (out.dtype == DType::kF32) {
      out.data_as<float>()[i] = sum[i];
    } else {
      out.data_as<uint16_t>()[i] = f32_to_bf16(sum[i]);
    }
  }
  const int64_t routing_bytes = static_cast<int64_t>(k) * 8;
  for (int r = 0; r < R; ++r) {
    s.rows_sent[r] = static_cast<int64_t>(send_rows[r]);
    s.rows_received[r] = static_cast<int64_t>(recv_rows[r]);
  }
  s.bytes_sent = static_cast<int64_t>(total_send) * (static_cast<int64_t>(row) + routing_bytes) +
                 static_cast<int64_t>(total_recv * row);
  s.bytes_received = static_cast<int64_t>(total_recv) * (static_cast<int64_t>(row) + routing_bytes) +
                     static_cast<int64_t>(total_send * row);
  return {};
}

#ifdef EPMOE_WITH_CUDA

Status EpMoe::replicate_all_reduce_on_device(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& s) {
  std::vector<int32_t> ids;
  EPMOE_RETURN_IF_ERROR(device_experts_->forward(x, logits, device_comm_->rank() == 0, out, ids));
  count_local_pairs(layer_.experts, ids, s.pairs_per_local_expert);
  s.bytes_sent = s.bytes_received = static_cast<int64_t>(2.0 * (comm_->size() - 1) / comm_->size() * out.nbytes());
  EPMOE_RETURN_IF_ERROR(device_comm_->all_reduce(out.data, out.data, static_cast<size_t>(out.numel()), out.dtype));
  return device_comm_->synchronize();
}

Status EpMoe::all_gather_reduce_scatter_on_device(const Tensor& x, const Tensor& logits, const Tensor& out,
                                                  EpStats& s) {
  const int R = comm_->size();
  const int64_t T = x.size(0), H = x.size(1), E = logits.size(1);
  std::vector<int32_t> counts(R);
  const int32_t mine = static_cast<int32_t>(T);
  EPMOE_RETURN_IF_ERROR(comm_->all_gather(&mine, counts.data(), 1, DType::kI32));  // host ints, through the view
  const int64_t T_max = *std::max_element(counts.begin(), counts.end());
  // Rows padded to T_max: zero rows (and zero logits) give exactly zero output rows.
  const size_t row = row_bytes(x), logit_row = static_cast<size_t>(E) * dtype_size(logits.dtype);
  Result<DeviceBuffer> x_padded = DeviceBuffer::allocate(T_max * row), logits_padded = DeviceBuffer::allocate(T_max * logit_row);
  Result<DeviceBuffer> x_all = DeviceBuffer::allocate(R * T_max * row), logits_all = DeviceBuffer::allocate(R * T_max * logit_row);
  Result<DeviceBuffer> partial = DeviceBuffer::allocate(R * T_max * row), mine_out = DeviceBuffer::allocate(T_max * row);
  for (const auto* buffer : {&x_padded, &logits_padded, &x_all, &logits_all, &partial, &mine_out})
    if (!buffer->ok()) return buffer->status();
  auto cuda = [](cudaError_t error, const char* what) {
    return error == cudaSuccess ? Status{} : Status(StatusCode::kInternal, std::string(what) + ": " + cudaGetErrorString(error));
  };
  EPMOE_RETURN_IF_ERROR(cuda(cudaMemsetAsync(x_padded->data(), 0, T_max * row), "padding x"));
  EPMOE_RETURN_IF_ERROR(cuda(cudaMemsetAsync(logits_padded->data(), 0, T_max * logit_row), "padding logits"));
  EPMOE_RETURN_IF_ERROR(cuda(cudaMemcpyAsync(x_padded->data(), x.data, x.nbytes(), cudaMemcpyDeviceToDevice), "copying x"));
  EPMOE_RETURN_IF_ERROR(
      cuda(cudaMemcpyAsync(logits_padded->data(), logits.data, logits.nbytes(), cudaMemcpyDeviceToDevice), "copying logits"));
  EPMOE_RETURN_IF_ERROR(device_comm_->all_gather(x_padded->data(), x_all->data(), T_max * H, x.dtype));
  EPMOE_RETURN_IF_ERROR(device_comm_->all_gather(logits_padded->data(), logits_all->data(), T_max * E, logits.dtype));
  EPMOE_RETURN_IF_ERROR(device_comm_->synchronize());  // the experts run on the default stream
  const Tensor all_rows = Tensor::contiguous(x_all->data(), x.dtype, {R * T_max, H}, Device::kCuda);
  const Tensor all_logits = Tensor::contiguous(logits_all->data(), logits.dtype, {R * T_max, E}, Device::kCuda);
  const Tensor partial_view = Tensor::contiguous(partial->data(), x.dtype, {R * T_max, H}, Device::kCuda);
  std::vector<int32_t> ids;
  EPMOE_RETURN_IF_ERROR(device_experts_->forward(all_rows, all_logits, device_comm_->rank() == 0, partial_view, ids));
  count_local_pairs(layer_.experts, ids, s.pairs_per_local_expert);
  EPMOE_RETURN_IF_ERROR(device_comm_->reduce_scatter(partial->data(), mine_out->data(), T_max * H, x.dtype));
  EPMOE_RETURN_IF_ERROR(device_comm_->synchronize());
  EPMOE_RETURN_IF_ERROR(cuda(cudaMemcpy(out.data, mine_out->data(), out.nbytes(), cudaMemcpyDeviceToDevice), "copying out"));
  const int64_t row_and_routing = static_cast<int64_t>(row + logit_row);
  for (int r = 0; r < R; ++r) {
    s.rows_sent[r] = r == comm_->rank() ? 0 : T_max;
    s.rows_received[r] = r == comm_->rank() ? 0 : T_max;
  }
  s.bytes_sent = s.bytes_received = (R - 1) * T_max * (row_and_routing + static_cast<int64_t>(row));
  return {};
}

#endif

}  // namespace epmoe
