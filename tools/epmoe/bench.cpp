// epmoe bench: times the operator on one rank's share of a preset's layer and prints it
// beside the roofline floor of DESIGN.md, max(bytes / bandwidth, flops / rate), with the
// ceilings measured on this machine at start.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "commands.h"
#include "cpu_ceilings.h"
#include "epmoe/moe_cpu.h"
#include "ep_runner.h"
#include "problem.h"
#ifdef EPMOE_WITH_CUDA
#include "bench_cuda.h"
#endif

namespace epmoe::cli {

namespace {

// The routing of a case's logits, [T, k] global ids.
std::vector<int32_t> routed_ids(const MoeCase& moe_case) {
  const Tensor& x = moe_case.inputs.x;
  const int k = moe_case.spec.routing.top_k;
  std::vector<int32_t> ids(x.size(0) * k);
  std::vector<float> weights(ids.size());
  const Status status = route_cpu(moe_case.spec.routing, *moe_case.inputs.router_logits, moe_case.inputs.correction_bias,
                                  Tensor::contiguous(ids.data(), DType::kI32, {x.size(0), k}),
                                  Tensor::contiguous(weights.data(), DType::kF32, {x.size(0), k}));
  if (!status.ok()) ids.clear();
  return ids;
}

double median_seconds(const MoeCase& moe_case, const Tensor& out, int iterations, int threads, Status& status) {
  std::vector<double> times;
  for (int i = 0; i <= iterations; ++i) {  // the first run warms up and is not counted
    const auto start = std::chrono::steady_clock::now();
    status = moe_forward_cpu(moe_case.spec, moe_case.weights, moe_case.inputs, out, {threads});
    if (!status.ok()) return 0;
    if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return median(times);
}

// Weight bytes the rank's share could need at most, to refuse sizes that do not fit.
double worst_case_weight_bytes(const Problem& problem, int64_t tokens) {
  const RandomCaseOptions& o = problem.options;
  const int64_t E_rank = (o.spec.routing.num_experts + o.num_ranks - 1) / o.num_ranks;
  const int64_t experts = std::min(E_rank, tokens * o.spec.routing.top_k);
  const double element = is_fp8(o.spec.quant.scheme) ? 1.0 : 2.0;
  return element * 3.0 * o.hidden * (experts * o.intermediate + o.shared_intermediate);
}

// The whole layer over the ranks: each rank's median forward time (host clock; the GPU path
// synchronises per collective), and its traffic per second.
int bench_ep_layer(const Problem& problem, const std::vector<int64_t>& token_counts, EpStrategy strategy,
                   const std::string& backend, int iterations) {
  std::printf("bench %s, whole layer, strategy %s, backend %s\n", describe(problem).c_str(),
              std::string(ep_strategy_name(strategy)).c_str(), backend.c_str());
  std::printf("%8s %5s %8s %11s %12s %12s\n", "T", "rank", "tokens", "time ms", "sent GB/s", "recv GB/s");
  for (int64_t tokens : token_counts) {
    Result<EpSetup> setup = prepare_ep(problem, tokens, strategy, backend);
    if (!setup.ok()) return run_error("bench", setup.status().to_string());
    if (Status status = run_ep(setup.value(), iterations + 1, 1); !status.ok())
      return run_error("bench", status.to_string());
    for (size_t r = 0; r < setup->ranks.size(); ++r) {
      EpRank& rank = setup->ranks[r];
      const double seconds = median(rank.seconds);
      std::printf("%8lld %5zu %8lld %11.3f %12.3f %12.3f\n", static_cast<long long>(tokens), r,
                  static_cast<long long>(rank.rows), seconds * 1e3, rank.stats.bytes_sent / seconds / 1e9,
                  rank.stats.bytes_received / seconds / 1e9);
    }
  }
  return 0;
}

bool cuda_available() {
#ifdef EPMOE_WITH_CUDA
  return cuda_device_present();
#else
  return false;
#endif
}

}  // namespace

int run_bench(const std::vector<std::string>& arguments) {
  Args args("epmoe bench --model NAME --tokens LIST [--ep R] [options]",
            "Times the MoE operator (GPU or CPU) for one rank's share of a preset's layer (routing\n"
            "over all E, only the rank's experts computed) and prints the median time beside the\n"
            "roofline floor max(bytes / bandwidth, flops / rate) and the ratio time / floor.\n"
            "Bytes count each local expert's weights once if any pair touches it, plus x, the\n"
            "logits and y; flops are 2 * pairs * 3 * H * I. Both ceilings are measured by the bench:\n"
            "on the GPU a 2 GiB device copy and an 8192^3 cuBLAS bf16 GEMM (e4m3 cuBLASLt for fp8),\n"
            "the GEMM's rate sustained (back-to-back runs after the timed calls, the card at its power\n"
            "limit, as the timed calls run), its burst rate (runs timed alone, before) beside it.\n"
            "On the GPU a run is one replay of a CUDA graph of several calls in a row, rotating\n"
            "inputs and weight copies past the L2, timed with events; a call is its share.");
  declare_problem_options(args, "1,16,64");
  args.option("iterations", "N", "timed runs per size (median reported; GPU: graph replays)", "5");
  args.option("graph-calls", "N", "GPU: calls per CUDA graph (0: the whole rotation of inputs in one graph)", "0");
  args.option("json", "FILE", "also write every figure to FILE");
  args.option("device", "D", "cpu or cuda", "cuda when built with CUDA and a GPU is present, else cpu");
  args.option("strategy", "S", "time the whole layer split over --ep ranks by EpMoe (replicate_all_reduce, "
              "all_gather_reduce_scatter, all_to_all) instead of one rank's share");
  args.option("backend", "B", "with --strategy: threads (ranks in this process) or nccl (one GPU a rank)", "threads");
  if (Status status = args.parse(arguments); !status.ok()) return usage_error("bench", status.message());
  if (args.help_requested()) {
    std::fputs(args.help().c_str(), stdout);
    return 0;
  }
  Result<Problem> problem = read_problem(args);
  if (!problem.ok()) return usage_error("bench", problem.status().message());
  Result<std::vector<int64_t>> token_list = args.integer_list("tokens", 1, 1 << 20);
  if (!token_list.ok()) return usage_error("bench", token_list.status().message());
  Result<int64_t> iterations = args.integer("iterations", 1, 1000);
  if (!iterations.ok()) return usage_error("bench", iterations.status().message());
  Result<int64_t> graph_calls = args.integer("graph-calls", 0, 1000);
  if (!graph_calls.ok()) return usage_error("bench", graph_calls.status().message());
  // The JSON file is written at the end: a path that cannot be written fails now, not after
  // the whole run (opening for append creates the file and leaves any content until then).
  if (args.given("json") && !std::ofstream(args.text("json"), std::ios::app))
    return usage_error("bench", "option --json: cannot write " + in_quotes(args.text("json")));

  if (args.given("strategy")) {
    Result<EpStrategy> strategy = parse_ep_strategy(args.text("strategy"));
    if (!strategy.ok()) return usage_error("bench", "option --" + strategy.status().message());
    return bench_ep_layer(problem.value(), token_list.value(), strategy.value(), args.text("backend"),
                          static_cast<int>(iterations.value()));
  }
  std::string device = args.text("device");
  if (!args.given("device")) device = cuda_available() ? "cuda" : "cpu";
  if (device == "cuda") {
#ifdef EPMOE_WITH_CUDA
    return bench_cuda(problem.value(), token_list.value(), static_cast<int>(iterations.value()),
                      static_cast<int>(graph_calls.value()), args.given("json") ? args.text("json") : "");
#else
    return usage_error("bench", "--device cuda: this build has no CUDA backend (configure with -DEPMOE_CUDA=ON)");
#endif
  }
  if (device != "cpu") return usage_error("bench", "option --device: expected cpu or cuda, got " + in_quotes(device));

  const Ceilings ceilings = measure_cpu_ceilings(problem->threads);
  const double memory_bytes = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  std::printf("bench %s, rank 0's share, CPU\n", describe(problem.value()).c_str());
  std::printf("ceilings: copy %.1f GB/s, f32 multiply-add %.1f GFLOP/s\n", ceilings.bytes_per_second / 1e9,
              ceilings.flops_per_second / 1e9);
  std::printf("%8s %8s %8s %11s %9s %9s %11s %7s\n", "T", "pairs", "experts", "time ms", "GB/s", "GFLOP/s",
              "floor ms", "ratio");
  nlohmann::json results = nlohmann::json::array();
  for (int64_t tokens : token_list.value()) {
    const double needed = worst_case_weight_bytes(problem.value(), tokens);
    if (needed > 0.6 * memory_bytes) {
      std::printf("%8lld skipped: up to %.1f GiB of weights, this machine has %.1f GiB (try --ep)\n",
                  static_cast<long long>(tokens), needed / (1 << 30), memory_bytes / (1 << 30));
      continue;
    }
    RandomCaseOptions options = problem->options;
    options.tokens = tokens;
    Result<MoeCase> moe_case = make_random_case(options);
    if (!moe_case.ok()) return run_error("bench", moe_case.status().to_string());
    const Tensor& x = moe_case->inputs.x;
    Buffer out(x.dtype, {x.size(0), x.size(1)});
    Status status;
    const double seconds = median_seconds(moe_case.value(), out.view(), static_cast<int>(iterations.value()),
                                          problem->threads, status);
    if (!status.ok()) return run_error("bench", status.to_string());
    const ExpertMap owned = ExpertMap::build(options.placement, options.spec.routing.num_experts, options.num_ranks,
                                             options.rank).value();
    const Workload w = count_workload(options, routed_ids(moe_case.value()), owned, moe_case->weights.shared_w13.has_value());
    const double floor_seconds = std::max(w.bytes / ceilings.bytes_per_second, w.flops / ceilings.flops_per_second);
    std::printf("%8lld %8lld %8lld %11.3f %9.2f %9.2f %11.3f %7.2f\n", static_cast<long long>(tokens),
                static_cast<long long>(w.local_pairs), static_cast<long long>(w.experts_touched), seconds * 1e3,
                w.bytes / seconds / 1e9, w.flops / seconds / 1e9, floor_seconds * 1e3, seconds / floor_seconds);
    std::fflush(stdout);
    results.push_back({{"tokens", tokens}, {"local_pairs", w.local_pairs}, {"experts_touched", w.experts_touched},
                       {"seconds", seconds}, {"bytes", w.bytes}, {"flops", w.flops},
                       {"floor_seconds", floor_seconds}, {"ratio", seconds / floor_seconds}});
  }
  if (args.given("json")) {
    const nlohmann::json document = {
        {"device", "cpu"},
        {"problem", describe(problem.value())},
        {"ceilings", {{"bytes_per_second", ceilings.bytes_per_second}, {"flops_per_second", ceilings.flops_per_second}}},
        {"results", results}};
    std::ofstream file(args.text("json"));
    file << document.dump(2) << "\n";
    if (!file) return run_error("bench", "cannot write " + args.text("json"));
  }
  return 0;
}

}  // namespace epmoe::cli
