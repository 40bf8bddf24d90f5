#include "problem.h"

namespace epmoe::cli {

void declare_problem_options(Args& args, const std::string& default_tokens) {
  args.option("model", "NAME", "model preset: " + preset_names());
  args.option("tokens", "N", "tokens T", default_tokens);
  args.option("ep", "R", "expert-parallel ranks; rank r computes only its experts", "1");
  args.option("placement", "P", "expert placement over ranks: linear or round_robin", "linear");
  args.option("quant", "SCHEME", "bf16, fp8_tensor, fp8_channel or fp8_block", "the checkpoint's scheme");
  args.option("dtype", "T", "activation dtype: bf16 or f32", "bf16");
  args.option("seed", "N", "seed of the random data", "1");
  args.option("threads", "N", "CPU threads, 0 = all", "0");
}

Result<Problem> read_problem(const Args& args) {
  Problem problem;
  if (!args.given("model"))
    return bad_argument("option --model", "a preset name (" + preset_names() + ")", "nothing");
  problem.preset = find_preset(args.text("model"));
  if (!problem.preset)
    return bad_argument("option --model", "one of " + preset_names(), in_quotes(args.text("model")));
  const ModelPreset& preset = *problem.preset;
  RandomCaseOptions& options = problem.options;
  options.spec = preset.spec;
  options.hidden = preset.hidden;
  options.intermediate = preset.intermediate;
  options.shared_intermediate = preset.shared_intermediate;
  options.correction_bias = preset.correction_bias;
  options.touched_experts_only = true;
  if (args.given("quant")) {
    Result<QuantScheme> scheme = parse_quant_scheme(args.text("quant"));
    if (!scheme.ok()) return bad_argument("option --quant", "bf16, fp8_tensor, fp8_channel or fp8_block", in_quotes(args.text("quant")));
    options.spec.quant.scheme = scheme.value();
  }
  const std::string dtype = args.text("dtype");
  if (dtype != "bf16" && dtype != "f32") return bad_argument("option --dtype", "bf16 or f32", in_quotes(dtype));
  options.activation_dtype = dtype == "bf16" ? DType::kBF16 : DType::kF32;
  Result<int64_t> ranks = args.integer("ep", 1, preset.spec.routing.num_experts);
  if (!ranks.ok()) return ranks.status();
  options.num_ranks = static_cast<int>(ranks.value());
  Result<Placement> placement = parse_placement(args.text("placement"));
  if (!placement.ok() || placement.value() == Placement::kExplicit)
    return bad_argument("option --placement", "linear or round_robin", in_quotes(args.text("placement")));
  options.placement = placement.value();
  Result<int64_t> seed = args.integer("seed", 0, INT64_MAX);
  if (!seed.ok()) return seed.status();
  options.seed = static_cast<uint64_t>(seed.value());
  Result<int64_t> threads = args.integer("threads", 0, 1024);
  if (!threads.ok()) return threads.status();
  problem.threads = static_cast<int>(threads.value());
  return problem;
}

std::string describe(const Problem& problem) {
  const ModelPreset& p = *problem.preset;
  const MoeSpec& spec = problem.options.spec;
  std::string text = std::string(p.name) + ": E=" + std::to_string(spec.routing.num_experts) +
                     " k=" + std::to_string(spec.routing.top_k) + " H=" + std::to_string(p.hidden) +
                     " I=" + std::to_string(p.intermediate);
  if (p.shared_intermediate) text += " shared I=" + std::to_string(p.shared_intermediate);
  text += ", " + std::string(routing_kind_name(spec.routing.kind)) + ", " +
          std::string(quant_scheme_name(spec.quant.scheme)) + ", x " +
          std::string(dtype_name(problem.options.activation_dtype));
  if (problem.options.num_ranks > 1)
    text += ", ep " + std::to_string(problem.options.num_ranks) + " (" +
            std::string(placement_name(problem.options.placement)) + ")";
  return text;
}

double tolerance_for(QuantScheme scheme) { return is_fp8(scheme) ? 3e-2 : 1e-2; }

Workload count_workload(const RandomCaseOptions& options, std::span<const int32_t> topk_ids, const ExpertMap& owned,
                        bool with_shared) {
  Workload w;
  std::vector<bool> touched(owned.num_experts(), false);
  for (int32_t id : topk_ids) {
    if (owned.local_index(id) < 0) continue;
    ++w.local_pairs;
    touched[id] = true;
  }
  for (bool t : touched) w.experts_touched += t;
  const double H = static_cast<double>(options.hidden), T = static_cast<double>(options.tokens);
  const double element = is_fp8(options.spec.quant.scheme) ? 1.0 : 2.0;
  const double activation = options.activation_dtype == DType::kF32 ? 4.0 : 2.0;
  const double shared_columns = with_shared ? static_cast<double>(options.shared_intermediate) : 0.0;
  const double expert_weights = 3.0 * H * static_cast<double>(options.intermediate) * element;
  w.bytes = static_cast<double>(w.experts_touched) * expert_weights + 3.0 * H * shared_columns * element +
            2.0 * T * H * activation + T * options.spec.routing.num_experts * 4.0;
  w.flops = 2.0 * 3.0 * H * (static_cast<double>(w.local_pairs) * static_cast<double>(options.intermediate) + T * shared_columns);
  return w;
}

}  // namespace epmoe::cli
