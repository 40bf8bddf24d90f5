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
#include "problem.h"

namespace epmoe::cli {

namespace {

struct Measurement {
  int64_t tokens = 0, local_pairs = 0, experts = 0;
  double seconds = 0, bytes = 0, flops = 0, floor_seconds = 0;
};

// Pairs that reach a local expert (shared experts count as one more pair per token).
int64_t local_pairs(const MoeCase& moe_case) {
  const Tensor& x = moe_case.inputs.x;
  const int k = moe_case.spec.routing.top_k;
  // The case's map lists exactly the local experts with tokens; count through it.
  Buffer topk_ids(DType::kI32, {x.size(0), k}), topk_weights(DType::kF32, {x.size(0), k});
  if (!route_cpu(moe_case.spec.routing, *moe_case.inputs.router_logits, moe_case.inputs.correction_bias,
                 topk_ids.view(), topk_weights.view())
           .ok())
    return 0;
  int64_t pairs = 0;
  for (int64_t i = 0; i < topk_ids.numel(); ++i)
    pairs += moe_case.inputs.expert_map->data_as<int32_t>()[topk_ids.data_as<int32_t>()[i]] >= 0;
  return pairs;
}

double median_seconds(const MoeCase& moe_case, const Tensor& out, int iterations, int threads, Status& status) {
  std::vector<double> times;
  for (int i = 0; i <= iterations; ++i) {  // the first run warms up and is not counted
    const auto start = std::chrono::steady_clock::now();
    status = moe_forward_cpu(moe_case.spec, moe_case.weights, moe_case.inputs, out, {threads});
    if (!status.ok()) return 0;
    if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Weight bytes the rank's share could need at most, to refuse sizes that do not fit.
double worst_case_weight_bytes(const Problem& problem, int64_t tokens) {
  const RandomCaseOptions& o = problem.options;
  const int64_t E_rank = (o.spec.routing.num_experts + o.num_ranks - 1) / o.num_ranks;
  const int64_t experts = std::min(E_rank, tokens * o.spec.routing.top_k);
  const double element = is_fp8(o.spec.quant.scheme) ? 1.0 : 2.0;
  return element * 3.0 * o.hidden * (experts * o.intermediate + o.shared_intermediate);
}

}  // namespace

int run_bench(const std::vector<std::string>& arguments) {
  Args args("epmoe bench --model NAME --tokens LIST [--ep R] [options]",
            "Times the MoE operator on the CPU for one rank's share of a preset's layer (routing\n"
            "over all E, only the rank's experts computed) and prints the median time beside the\n"
            "roofline floor max(bytes / bandwidth, flops / rate) and the ratio time / floor.\n"
            "Bytes count each local expert's weights once if any pair touches it, plus x, the\n"
            "logits and y; flops are 2 * pairs * 3 * H * I. Both ceilings are measured at start.");
  declare_problem_options(args, "1,16,64");
  args.option("iterations", "N", "timed runs per size (median reported)", "5");
  args.option("json", "FILE", "also write every figure to FILE");
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
    if (!moe_case.ok()) return usage_error("bench", moe_case.status().to_string());
    const Tensor& x = moe_case->inputs.x;
    Buffer out(x.dtype, {x.size(0), x.size(1)});
    Status status;
    Measurement m;
    m.tokens = tokens;
    m.seconds = median_seconds(moe_case.value(), out.view(), static_cast<int>(iterations.value()), problem->threads,
                               status);
    if (!status.ok()) return usage_error("bench", status.to_string());
    m.local_pairs = local_pairs(moe_case.value());
    m.experts = moe_case->weights.w13.size(0);
    const int64_t H = options.hidden;
    m.bytes = static_cast<double>(weight_bytes(moe_case.value()) + 2 * x.nbytes() +
                                  moe_case->inputs.router_logits->nbytes());
    m.flops = 2.0 * 3.0 * H *
              (static_cast<double>(m.local_pairs) * options.intermediate +
               (moe_case->weights.shared_w13 ? static_cast<double>(tokens) * options.shared_intermediate : 0.0));
    m.floor_seconds = std::max(m.bytes / ceilings.bytes_per_second, m.flops / ceilings.flops_per_second);
    std::printf("%8lld %8lld %8lld %11.3f %9.2f %9.2f %11.3f %7.2f\n", static_cast<long long>(tokens),
                static_cast<long long>(m.local_pairs), static_cast<long long>(m.experts), m.seconds * 1e3,
                m.bytes / m.seconds / 1e9, m.flops / m.seconds / 1e9, m.floor_seconds * 1e3,
                m.seconds / m.floor_seconds);
    std::fflush(stdout);
    results.push_back({{"tokens", tokens}, {"local_pairs", m.local_pairs}, {"experts_touched", m.experts},
                       {"seconds", m.seconds}, {"bytes", m.bytes}, {"flops", m.flops},
                       {"floor_seconds", m.floor_seconds}, {"ratio", m.seconds / m.floor_seconds}});
  }
  if (args.given("json")) {
    const nlohmann::json document = {
        {"device", "cpu"},
        {"problem", describe(problem.value())},
        {"ceilings", {{"bytes_per_second", ceilings.bytes_per_second}, {"flops_per_second", ceilings.flops_per_second}}},
        {"results", results}};
    std::ofstream file(args.text("json"));
    file << document.dump(2) << "\n";
    if (!file) return usage_error("bench", "cannot write " + args.text("json"));
  }
  return 0;
}

}  // namespace epmoe::cli
