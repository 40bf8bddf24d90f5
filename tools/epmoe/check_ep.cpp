// epmoe check --strategy S: the layer split over R ranks by EpMoe (threads in this process,
// or one NCCL rank per GPU), every rank's output against the naive loop over the whole layer.
#include <cstdio>
#include <thread>
#include <unistd.h>

#include "check_ep.h"
#include "commands.h"
#include "epmoe/ep_moe.h"
#include "epmoe/naive_moe.h"
#ifdef EPMOE_WITH_CUDA
#include "epmoe/device_case.h"
#endif

namespace epmoe::cli {

namespace {

using namespace std::chrono_literals;

std::string kib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f KiB", static_cast<double>(bytes) / 1024);
  return text;
}

// One rank's run: its communicator, its layer, its rows of x and the logits.
struct RankRun {
  EpLayer layer;
  int64_t first_row = 0, rows = 0;
  std::vector<double> out;
  EpStats stats;
  Status status;
};

Status run_rank(Communicator& comm, RankRun& run, EpStrategy strategy, const MoeCase& whole, bool on_gpu) {
  const int64_t H = whole.inputs.x.size(1), E = whole.spec.routing.num_experts;
  const size_t row = static_cast<size_t>(H) * dtype_size(whole.inputs.x.dtype);
  Tensor x = Tensor::contiguous(static_cast<std::byte*>(whole.inputs.x.data) + run.first_row * row, whole.inputs.x.dtype,
                                {run.rows, H});
  Tensor logits = Tensor::contiguous(whole.inputs.router_logits->data_as<float>() + run.first_row * E, DType::kF32,
                                     {run.rows, E});
  Buffer out(x.dtype, {run.rows, H});
  Tensor out_view = out.view();
#ifdef EPMOE_WITH_CUDA
  std::vector<DeviceBuffer> device_storage;
  if (on_gpu) {
    EPMOE_RETURN_IF_ERROR(upload_weights(run.layer.weights, device_storage));
    EPMOE_RETURN_IF_ERROR(move_to_device(x, device_storage));
    EPMOE_RETURN_IF_ERROR(move_to_device(logits, device_storage));
    Result<DeviceBuffer> device_out = DeviceBuffer::allocate(out.view().nbytes());
    if (!device_out.ok()) return device_out.status();
    out_view.data = device_out->data();
    out_view.device = Device::kCuda;
    device_storage.push_back(std::move(device_out).value());
  }
#else
  if (on_gpu) return Status::unsupported("--backend nccl: this build has no CUDA");
#endif
  Result<EpMoe> layer = EpMoe::create(comm, run.layer, strategy);
  if (!layer.ok()) return layer.status();
  EPMOE_RETURN_IF_ERROR(layer->forward(x, logits, out_view, &run.stats));
#ifdef EPMOE_WITH_CUDA
  if (on_gpu) EPMOE_RETURN_IF_ERROR(copy_to_host(out_view.data, out.view()));
#endif
  run.out = to_doubles(out.view());
  return {};
}

}  // namespace

int check_ep_layer(const Problem& problem, int64_t tokens, EpStrategy strategy, const std::string& backend) {
  RandomCaseOptions options = problem.options;
  const int R = options.num_ranks, E = options.spec.routing.num_experts;
  options.tokens = tokens;
  options.num_ranks = 1;
  options.rank = 0;
  options.touched_experts_only = false;  // EpMoe needs every expert placed somewhere
  const double element = is_fp8(options.spec.quant.scheme) ? 1.0 : 2.0;
  const double weight_bytes = element * 3.0 * options.hidden * (E * options.intermediate + options.shared_intermediate);
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  if (2 * weight_bytes > 0.6 * memory)  // the whole layer plus the ranks' copies
    return usage_error("check", "--strategy holds all " + std::to_string(E) + " experts in this process: " +
                                    std::to_string(2 * weight_bytes / (1 << 30)) + " GiB, more than this machine can " +
                                    "spare; check that preset with --ep R alone (one rank's share at a time)");
  const bool on_gpu = backend == "nccl";
  if (!on_gpu && backend != "threads") return usage_error("check", "option --backend: expected threads or nccl, got " + in_quotes(backend));
  if (on_gpu && !nccl_available()) return usage_error("check", "--backend nccl: this build has no NCCL backend");
  std::printf("check %s, T=%lld, strategy %s, backend %s\n", describe(problem).c_str(), static_cast<long long>(tokens),
              std::string(ep_strategy_name(strategy)).c_str(), backend.c_str());
  Result<MoeCase> whole = make_random_case(options);
  if (!whole.ok()) return usage_error("check", whole.status().to_string());
  Result<std::vector<double>> reference = naive_moe(whole->spec, whole->weights, whole->inputs,
                                                    {.quantize_activations = true, .num_threads = problem.threads});
  if (!reference.ok()) return usage_error("check", reference.status().to_string());

  std::vector<RankRun> runs(R);
  for (int r = 0, first = 0; r < R; ++r) {
    Result<ExpertMap> experts = ExpertMap::build(options.placement, E, R, r);
    if (!experts.ok()) return usage_error("check", experts.status().message());
    runs[r].layer = slice_layer(whole.value(), experts.value());
    const bool replicate = strategy == EpStrategy::kReplicateAllReduce;
    runs[r].first_row = replicate ? 0 : first;
    runs[r].rows = replicate ? tokens : tokens / R + (r < tokens % R ? 1 : 0);
    first += static_cast<int>(runs[r].rows);
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  if (!on_gpu) comms = make_thread_group(R, 60000ms);
  const std::string bootstrap = "file:/tmp/epmoe-nccl-" + std::to_string(::getpid());
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        if (!on_gpu) {
          runs[r].status = run_rank(*comms[r], runs[r], strategy, whole.value(), false);
          if (!runs[r].status.ok()) comms[r]->abort(runs[r].status.message());
          return;
        }
        Result<std::unique_ptr<Communicator>> nccl =
            make_nccl_communicator({.rank = r, .size = R, .bootstrap = bootstrap, .timeout = 60000ms, .device = r});
        runs[r].status = nccl.ok() ? run_rank(*nccl.value(), runs[r], strategy, whole.value(), true) : nccl.status();
      });
  }
  std::vector<double> got, want;
  for (int r = 0; r < R; ++r) {
    const RankRun& run = runs[r];
    if (!run.status.ok()) return usage_error("check", "rank " + std::to_string(r) + ": " + run.status.to_string());
    int64_t fewest = INT64_MAX, most = 0;
    for (int64_t pairs : run.stats.pairs_per_local_expert) {
      fewest = std::min(fewest, pairs);
      most = std::max(most, pairs);
    }
    std::string rows_sent;
    for (int64_t rows : run.stats.rows_sent) {
      rows_sent += ' ';
      rows_sent += std::to_string(rows);
    }
    std::printf("  rank %d: %lld tokens, sent %s (rows to each rank:%s), received %s, pairs per local expert %lld..%lld\n", r,
                static_cast<long long>(run.rows), kib(run.stats.bytes_sent).c_str(), rows_sent.c_str(),
                kib(run.stats.bytes_received).c_str(), static_cast<long long>(fewest == INT64_MAX ? 0 : fewest),
                static_cast<long long>(most));
    got.insert(got.end(), run.out.begin(), run.out.end());
    const int64_t H = options.hidden;
    want.insert(want.end(), reference->begin() + run.first_row * H, reference->begin() + (run.first_row + run.rows) * H);
  }
  const double error = relative_error(got, want), tolerance = tolerance_for(options.spec.quant.scheme);
  const bool pass = error <= tolerance;
  std::printf("rel_error=%.3e tolerance=%.1e %s\n", error, tolerance, pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace epmoe::cli
