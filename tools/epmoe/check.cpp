// epmoe check: the operator against the naive double-precision loop (random data of a
// preset, every EP rank summed) or against the output stored in a case file.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>

#include "commands.h"
#include "ep_runner.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/naive_moe.h"
#include "problem.h"

namespace epmoe::cli {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs the operator on `moe_case` into a buffer poisoned with NaN, so an element the
// operator leaves unwritten shows up as NaN in the error.
Result<std::vector<double>> run_operator(const MoeCase& moe_case, int threads) {
  const Tensor& x = moe_case.inputs.x;
  Buffer out(x.dtype, {x.size(0), x.size(1)});
  EPMOE_RETURN_IF_ERROR(fill_with_nan(out.view()));
  EPMOE_RETURN_IF_ERROR(moe_forward_cpu(moe_case.spec, moe_case.weights, moe_case.inputs, out.view(), {threads}));
  return to_doubles(out.view());
}

int report(double error, double tolerance) {
  const bool pass = error <= tolerance;  // false for NaN
  std::printf("rel_error=%.3e tolerance=%.1e %s\n", error, tolerance, pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

int check_file(const std::string& path, int threads) {
  Result<MoeCase> moe_case = load_moe_case(path);
  if (!moe_case.ok()) return run_error("check", moe_case.status().to_string());
  if (!moe_case->expected) return run_error("check", path + ": no expected output 'y' in the file");
  const MoeSpec& spec = moe_case->spec;
  std::printf("check %s: T=%lld H=%lld, %s, %s\n", path.c_str(), static_cast<long long>(moe_case->inputs.x.size(0)),
              static_cast<long long>(moe_case->inputs.x.size(1)), std::string(routing_kind_name(spec.routing.kind)).c_str(),
              std::string(quant_scheme_name(spec.quant.scheme)).c_str());
  Result<std::vector<double>> out = run_operator(moe_case.value(), threads);
  if (!out.ok()) return run_error("check", out.status().to_string());
  return report(relative_error(out.value(), to_doubles(*moe_case->expected)), tolerance_for(spec.quant.scheme));
}

int check_model(const Problem& problem, int64_t tokens) {
  RandomCaseOptions options = problem.options;
  options.tokens = tokens;
  std::printf("check %s, T=%lld\n", describe(problem).c_str(), static_cast<long long>(tokens));
  std::vector<double> out_sum, reference_sum, exact_sum;
  for (int rank = 0; rank < options.num_ranks; ++rank) {
    options.rank = rank;
    const auto start = std::chrono::steady_clock::now();
    Result<MoeCase> moe_case = make_random_case(options);
    if (!moe_case.ok()) return run_error("check", moe_case.status().to_string());
    const double draw_seconds = seconds_since(start);
    const auto operator_start = std::chrono::steady_clock::now();
    Result<std::vector<double>> out = run_operator(moe_case.value(), problem.threads);
    if (!out.ok()) return run_error("check", out.status().to_string());
    const double operator_seconds = seconds_since(operator_start);
    const auto reference_start = std::chrono::steady_clock::now();
    Result<std::vector<double>> reference =
        naive_moe(moe_case->spec, moe_case->weights, moe_case->inputs, {.quantize_activations = true, .num_threads = problem.threads});
    if (!reference.ok()) return run_error("check", reference.status().to_string());
    Result<std::vector<double>> exact = reference;
    if (is_fp8(options.spec.quant.scheme))
      exact = naive_moe(moe_case->spec, moe_case->weights, moe_case->inputs, {.num_threads = problem.threads});
    if (!exact.ok()) return run_error("check", exact.status().to_string());
    std::printf("  rank %d/%d: %lld experts with tokens, %.2f GiB of weights; data %.2f s, operator %.2f s, "
                "reference %.2f s\n",
                rank, options.num_ranks, static_cast<long long>(moe_case->weights.w13.size(0)),
                static_cast<double>(weight_bytes(moe_case.value())) / (1 << 30), draw_seconds, operator_seconds,
                seconds_since(reference_start));
    out_sum.resize(out->size(), 0.0);
    reference_sum.resize(out->size(), 0.0);
    exact_sum.resize(out->size(), 0.0);
    for (size_t i = 0; i < out->size(); ++i) {
      out_sum[i] += out.value()[i];
      reference_sum[i] += reference.value()[i];
      exact_sum[i] += exact.value()[i];
    }
  }
  if (is_fp8(options.spec.quant.scheme))
    std::printf("  error against exact activations (the cost of fp8 activations, not gated): %.3e\n",
                relative_error(out_sum, exact_sum));
  return report(relative_error(out_sum, reference_sum), tolerance_for(options.spec.quant.scheme));
}

std::string kib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f KiB", static_cast<double>(bytes) / 1024);
  return text;
}

// The layer split over the ranks by EpMoe; each rank's output against the naive loop over
// the whole layer's rows it holds.
int check_ep_layer(const Problem& problem, int64_t tokens, EpStrategy strategy, const std::string& backend) {
  std::printf("check %s, T=%lld, strategy %s, backend %s\n", describe(problem).c_str(), static_cast<long long>(tokens),
              std::string(ep_strategy_name(strategy)).c_str(), backend.c_str());
  Result<EpSetup> setup = prepare_ep(problem, tokens, strategy, backend);
  if (!setup.ok()) return run_error("check", setup.status().to_string());
  const MoeCase& whole = setup->whole;
  Result<std::vector<double>> reference =
      naive_moe(whole.spec, whole.weights, whole.inputs, {.quantize_activations = true, .num_threads = problem.threads});
  if (!reference.ok()) return run_error("check", reference.status().to_string());
  if (Status status = run_ep(setup.value(), 1, 0); !status.ok()) return run_error("check", status.to_string());
  std::vector<double> got, want;
  const int64_t H = whole.inputs.x.size(1);
  for (size_t r = 0; r < setup->ranks.size(); ++r) {
    const EpRank& rank = setup->ranks[r];
    int64_t fewest = INT64_MAX, most = 0;
    for (int64_t pairs : rank.stats.pairs_per_local_expert) {
      fewest = std::min(fewest, pairs);
      most = std::max(most, pairs);
    }
    std::string rows_sent;
    for (int64_t rows : rank.stats.rows_sent) {
      rows_sent += ' ';
      rows_sent += std::to_string(rows);
    }
    std::printf("  rank %zu: %lld tokens, sent %s (rows to each rank:%s), received %s, pairs per local expert %lld..%lld\n",
                r, static_cast<long long>(rank.rows), kib(rank.stats.bytes_sent).c_str(), rows_sent.c_str(),
                kib(rank.stats.bytes_received).c_str(), static_cast<long long>(fewest == INT64_MAX ? 0 : fewest),
                static_cast<long long>(most));
    got.insert(got.end(), rank.out.begin(), rank.out.end());
    want.insert(want.end(), reference->begin() + rank.first_row * H, reference->begin() + (rank.first_row + rank.rows) * H);
  }
  return report(relative_error(got, want), tolerance_for(whole.spec.quant.scheme));
}

}  // namespace

int run_error(const std::string& command, const std::string& message) {
  std::fprintf(stderr, "epmoe %s: %s\n", command.c_str(), message.c_str());
  return 2;
}

int usage_error(const std::string& command, const std::string& message) {
  const int code = run_error(command, message);
  std::fprintf(stderr, "(see 'epmoe %s --help')\n", command.c_str());
  return code;
}

int run_check(const std::vector<std::string>& arguments) {
  Args args("epmoe check --model NAME [--tokens N] [--ep R] [options]\n       epmoe check --data FILE",
            "Runs the MoE operator on random data of a model preset and compares it with an\n"
            "independent per-token loop in double precision on dequantised weights; for fp8 that\n"
            "loop rounds the activations to e4m3 where the scheme does (and also reports the\n"
            "error against exact activations).\n"
            "With --ep R every rank's share is computed and the shares are summed.\n"
            "With --data, runs the case stored in a safetensors file (docs/ORACLE_FORMAT.md)\n"
            "and compares with the output stored there. The last line reads\n"
            "'rel_error=<x> tolerance=<y> PASS' (exit 0) or '... FAIL' (exit 1).");
  declare_problem_options(args, "8");
  args.option("data", "FILE", "a case in the oracle format instead of --model");
  args.option("strategy", "S", "run the layer split over --ep ranks by EpMoe: replicate_all_reduce, "
              "all_gather_reduce_scatter or all_to_all (default: each rank's share in turn, summed)");
  args.option("backend", "B", "with --strategy: threads (ranks in this process) or nccl (one GPU a rank)", "threads");
  if (Status status = args.parse(arguments); !status.ok()) return usage_error("check", status.message());
  if (args.help_requested()) {
    std::fputs(args.help().c_str(), stdout);
    return 0;
  }
  if (args.given("data")) {
    if (args.given("model")) return usage_error("check", "--data and --model exclude each other");
    Result<int64_t> threads = args.integer("threads", 0, 1024);
    if (!threads.ok()) return usage_error("check", threads.status().message());
    return check_file(args.text("data"), static_cast<int>(threads.value()));
  }
  Result<Problem> problem = read_problem(args);
  if (!problem.ok()) return usage_error("check", problem.status().message());
  Result<int64_t> tokens = args.integer("tokens", 1, 1 << 20);
  if (!tokens.ok()) return usage_error("check", tokens.status().message());
  if (args.given("strategy")) {
    Result<EpStrategy> strategy = parse_ep_strategy(args.text("strategy"));
    if (!strategy.ok()) return usage_error("check", "option --" + strategy.status().message());
    return check_ep_layer(problem.value(), tokens.value(), strategy.value(), args.text("backend"));
  }
  if (args.given("backend")) return usage_error("check", "--backend goes with --strategy");
  return check_model(problem.value(), tokens.value());
}

}  // namespace epmoe::cli
