#include "ep_runner.h"

#include <chrono>
#include <thread>
#include <unistd.h>

#include "epmoe/naive_moe.h"

#ifdef EPMOE_WITH_CUDA
#include "epmoe/device_case.h"
#endif

namespace epmoe::cli {

namespace {

using namespace std::chrono_literals;

Status run_rank(Communicator& comm, EpRank& rank, const EpSetup& setup, int forwards, int warmup) {
  const MoeCase& whole = setup.whole;
  const int64_t H = whole.inputs.x.size(1), E = whole.spec.routing.num_experts;
  const size_t row = static_cast<size_t>(H) * dtype_size(whole.inputs.x.dtype);
  Tensor x = Tensor::contiguous(static_cast<std::byte*>(whole.inputs.x.data) + rank.first_row * row, whole.inputs.x.dtype,
                                {rank.rows, H});
  Tensor logits = Tensor::contiguous(whole.inputs.router_logits->data_as<float>() + rank.first_row * E, DType::kF32,
                                     {rank.rows, E});
  Buffer out(x.dtype, {rank.rows, H});
  Tensor out_view = out.view();
  EpLayer layer = rank.layer;
#ifdef EPMOE_WITH_CUDA
  std::vector<DeviceBuffer> device_storage;
  if (setup.nccl) {
    EPMOE_RETURN_IF_ERROR(upload_weights(layer.weights, device_storage));
    EPMOE_RETURN_IF_ERROR(move_to_device(x, device_storage));
    EPMOE_RETURN_IF_ERROR(move_to_device(logits, device_storage));
    EPMOE_RETURN_IF_ERROR(move_to_device(out_view, device_storage));
  }
#else
  if (setup.nccl) return Status::unsupported("--backend nccl: this build has no CUDA");
#endif
  Result<EpMoe> moe = EpMoe::create(comm, layer, setup.strategy);
  if (!moe.ok()) return moe.status();
  for (int i = 0; i < forwards; ++i) {
    const auto start = std::chrono::steady_clock::now();
    EPMOE_RETURN_IF_ERROR(moe->forward(x, logits, out_view, &rank.stats));
    if (i >= warmup) rank.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
#ifdef EPMOE_WITH_CUDA
  if (setup.nccl) EPMOE_RETURN_IF_ERROR(copy_to_host(out_view.data, out.view()));
#endif
  rank.out = to_doubles(out.view());
  return {};
}

}  // namespace

Result<EpSetup> prepare_ep(const Problem& problem, int64_t tokens, EpStrategy strategy, const std::string& backend) {
  RandomCaseOptions options = problem.options;
  const int R = options.num_ranks, E = options.spec.routing.num_experts;
  options.tokens = tokens;
  options.num_ranks = 1;
  options.rank = 0;
  options.touched_experts_only = false;  // EpMoe needs every expert placed somewhere
  if (backend != "threads" && backend != "nccl")
    return bad_argument("option --backend", "threads or nccl", in_quotes(backend));
  if (backend == "nccl" && !nccl_available())
    return Status::unsupported("--backend nccl: this build has no NCCL backend");
  const double element = is_fp8(options.spec.quant.scheme) ? 1.0 : 2.0;
  const double weight_bytes = element * 3.0 * options.hidden * (E * options.intermediate + options.shared_intermediate);
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  if (2 * weight_bytes > 0.6 * memory)  // the whole layer plus the ranks' copies
    return Status(StatusCode::kOutOfMemory,
                  "--strategy holds all " + std::to_string(E) + " experts in this process (" +
                      std::to_string(static_cast<int>(2 * weight_bytes / (1 << 30))) +
                      " GiB with the ranks' copies), more than this machine can spare; use --ep R alone (one rank's "
                      "share at a time)");
  EpSetup setup;
  setup.strategy = strategy;
  setup.nccl = backend == "nccl";
  Result<MoeCase> whole = make_random_case(options);
  if (!whole.ok()) return whole.status();
  setup.whole = std::move(whole).value();
  int64_t first = 0;
  for (int r = 0; r < R; ++r) {
    Result<ExpertMap> experts = ExpertMap::build(options.placement, E, R, r);
    if (!experts.ok()) return experts.status();
    EpRank rank;
    rank.layer = slice_layer(setup.whole, experts.value());
    const bool replicate = strategy == EpStrategy::kReplicateAllReduce;
    rank.first_row = replicate ? 0 : first;
    rank.rows = replicate ? tokens : tokens / R + (r < tokens % R ? 1 : 0);
    first += rank.rows;
    setup.ranks.push_back(std::move(rank));
  }
  return setup;
}

Status run_ep(EpSetup& setup, int forwards, int warmup) {
  const int R = static_cast<int>(setup.ranks.size());
  std::vector<std::unique_ptr<Communicator>> comms;
  if (!setup.nccl) comms = make_thread_group(R, 60000ms);
  const std::string bootstrap = "file:/tmp/epmoe-nccl-" + std::to_string(::getpid());
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        EpRank& rank = setup.ranks[r];
        if (!setup.nccl) {
          rank.status = run_rank(*comms[r], rank, setup, forwards, warmup);
          if (!rank.status.ok()) comms[r]->abort(rank.status.message());
          return;
        }
        Result<std::unique_ptr<Communicator>> nccl =
            make_nccl_communicator({.rank = r, .size = R, .bootstrap = bootstrap, .timeout = 60000ms, .device = r});
        rank.status = nccl.ok() ? run_rank(*nccl.value(), rank, setup, forwards, warmup) : nccl.status();
        if (!rank.status.ok() && nccl.ok()) nccl.value()->abort(rank.status.message());
      });
  }
  for (int r = 0; r < R; ++r)
    if (!setup.ranks[r].status.ok())
      return Status(setup.ranks[r].status.code(), "rank " + std::to_string(r) + ": " + setup.ranks[r].status.message());
  return {};
}

}  // namespace epmoe::cli
