// The CUDA MoE operator: validation, the workspace layout, and the pipeline of DESIGN.md
// (route, map and sort, GEMM1 + activation, GEMM2, combine) as one stream of launches with
// no host synchronisation and no allocation. fp8 schemes quantise GEMM1's input before it;
// GEMM1's epilogue quantises the activated intermediate for GEMM2 (fp8_block, static
// per-tensor scales), else a separate pass does.
#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>

#include "cuda_check.h"
#include "epmoe/moe_cuda.h"
#include "epmoe/quantize.h"
#include "launchers.h"

namespace epmoe {

namespace {

constexpr size_t kAlignment = 256;

// How a scheme quantises activations: per group of block_k, per row, or per tensor.
cuda::Fp8Granularity activation_granularity(QuantScheme scheme) {
  switch (scheme) {
    case QuantScheme::kFp8Block: return cuda::Fp8Granularity::kPerGroup;
    case QuantScheme::kFp8Channel: return cuda::Fp8Granularity::kPerRow;
    default: return cuda::Fp8Granularity::kPerTensor;
  }
}

// Scales of quantised activation rows [rows, stride] (fp8): how many, and their grid.
int64_t activation_scale_count(const QuantSpec& quant, int64_t rows, int64_t stride, int64_t groups) {
  switch (activation_granularity(quant.scheme)) {
    case cuda::Fp8Granularity::kPerGroup: return rows * ((stride + quant.block_k - 1) / quant.block_k);
    case cuda::Fp8Granularity::kPerRow: return rows;
    case cuda::Fp8Granularity::kPerTensor: return groups;
  }
  return 0;
}

// Carves the workspace into the pipeline's buffers; with a null base it only measures.
struct WorkspaceLayout {
  int32_t* topk_ids;      // [T, k]
  float* topk_weights;    // [T, k]
  cuda::PairLayout pairs;
  uint16_t* x_scaled;     // [T, H] x * router weight (Llama-4)
  uint16_t* intermediate;  // [slots, max(I, I_s)]
  uint16_t* pair_out;     // [slots, H]
  float* pair_out_partials;  // [k_splits, slots, H] when GEMM2 splits K
  // fp8: e4m3 codes and scales of GEMM1's input (routed rows; and x for the shared experts
  // when the routed rows are x * router weight) and of GEMM2's input.
  uint8_t* x_codes;              // [T, H]
  float* x_scales;
  uint8_t* shared_x_codes;       // [T, H]
  float* shared_x_scales;
  uint8_t* intermediate_codes;   // [slots, max(I, I_s)]
  float* intermediate_scales;
  uint32_t* amax_bits;           // [groups] dynamic per-tensor amax
  int64_t arrival_scopes = 0;    // GEMM1's fused quantisation: groups of 128 columns per row tile
  int32_t* row_tile_columns;     // GemmGroups::row_tile_columns, after the quantisation's counters, or null
  // SelfRouting::published, after those, where GEMM1 may route for itself with the hand-over
  // (routes_in_gemm1 allowing any number of experts: the routing's inputs decide), or null.
  int32_t* layout_published;
  bool separate_shared_input = false;  // fp8, shared experts and routed rows x * router weight
  cuda::TilePlan tiles;
  int64_t slots = 0;
  size_t bytes = 0;

  WorkspaceLayout(const MoeSpec& spec, const MoeShape& s, void* base) {
    const bool shared = s.shared_intermediate > 0;
    const bool fp8 = is_fp8(spec.quant.scheme);
    const int64_t pairs_count = s.tokens * s.top_k;
    const int64_t groups = s.num_local_experts + (shared ? 1 : 0);
    const int64_t widest = std::max(s.intermediate, s.shared_intermediate);
    slots = pairs_count + (shared ? s.tokens : 0);
    tiles = cuda::plan_tiles(s.tokens, s.top_k, s.num_experts, s.num_local_experts, s.shared_intermediate, s.hidden,
                             s.intermediate);
    const int64_t all_tiles = tiles.max_tiles + tiles.shared_tiles;
    auto* cursor = static_cast<std::byte*>(base);
    auto take = [&](auto*& pointer, int64_t count) {
      using T = std::remove_reference_t<decltype(*pointer)>;
      pointer = reinterpret_cast<T*>(cursor + bytes);
      bytes += (static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    };
    take(topk_ids, pairs_count);
    take(topk_weights, pairs_count);
    take(pairs.group_counts, groups);
    take(pairs.group_offsets, groups + 1);
    take(pairs.slot_of_pair, pairs_count);
    take(pairs.slot_token, slots);
    take(pairs.tile_group, all_tiles);
    take(pairs.tile_row, all_tiles);
    take(pairs.tile_count, 2);
    const int64_t sort_blocks = cuda::sort_blocks(pairs_count);
    take(pairs.block_counts, sort_blocks > 1 ? sort_blocks * groups : 0);
    take(x_scaled, s.tokens * s.hidden);
    take(intermediate, slots * widest);
    take(pair_out, slots * s.hidden);
    take(pair_out_partials, tiles.k_splits > 1 ? tiles.k_splits * slots * s.hidden : 0);
    separate_shared_input = fp8 && shared && spec.apply_router_weight_on_input;
    take(x_codes, fp8 ? s.tokens * s.hidden : 0);
    take(x_scales, fp8 ? activation_scale_count(spec.quant, s.tokens, s.hidden, 1) : 0);
    take(shared_x_codes, separate_shared_input ? s.tokens * s.hidden : 0);
    take(shared_x_scales, separate_shared_input ? activation_scale_count(spec.quant, s.tokens, s.hidden, 1) : 0);
    take(intermediate_codes, fp8 ? slots * widest : 0);
    take(intermediate_scales, fp8 ? activation_scale_count(spec.quant, slots, widest, groups) : 0);
    take(amax_bits, fp8 ? groups : 0);
    arrival_scopes = spec.quant.scheme == QuantScheme::kFp8Block ? (widest + spec.quant.block_k - 1) / spec.quant.block_k : 0;
    const int64_t hand_over_counters = cuda::hands_over_by_row_tile(tiles, fp8) ? all_tiles : 0;
    const bool flags_publishing =
        hand_over_counters > 0 && cuda::routes_in_gemm1(tiles, s.tokens, s.top_k, 0, widest, spec.quant.scheme,
                                                        spec.apply_router_weight_on_input);
    pairs.arrival_count = all_tiles * arrival_scopes + hand_over_counters + (flags_publishing ? 1 : 0);
    take(pairs.arrivals, pairs.arrival_count);
    row_tile_columns = hand_over_counters > 0 ? pairs.arrivals + all_tiles * arrival_scopes : nullptr;
    layout_published = flags_publishing ? pairs.arrivals + all_tiles * arrival_scopes + hand_over_counters : nullptr;
  }
};

// The routing kernel's limits (scores of one token in shared memory, groups in registers).
Status check_routing_limits(const RoutingSpec& routing) {
  if (routing.num_experts > cuda::kMaxRoutedExperts)
    return bad_argument("routing.num_experts", "at most " + std::to_string(cuda::kMaxRoutedExperts) +
                                                   " experts for GPU routing", std::to_string(routing.num_experts));
  if (routing.top_k > cuda::kMaxTopK)
    return bad_argument("routing.top_k", "at most " + std::to_string(cuda::kMaxTopK) + " on the GPU",
                        std::to_string(routing.top_k));
  if (routing.kind == RoutingKind::kGroupedTopk && routing.n_group > cuda::kMaxGroups)
    return bad_argument("routing.n_group", "at most " + std::to_string(cuda::kMaxGroups) + " on the GPU",
                        std::to_string(routing.n_group));
  return {};
}

// What the GPU path adds to validate_moe: its dtype, the kernels' limits and alignment.
Status check_gpu_limits(const MoeSpec& spec, const MoeShape& shape, const MoeInputs& inputs,
                        const MoeWeights& weights, const CudaWorkspace& workspace, size_t needed) {
  if (spec.quant.scheme == QuantScheme::kFp8Block && (spec.quant.block_n != 128 || spec.quant.block_k != 128))
    return bad_argument("quant.block_n, quant.block_k", "128 x 128 blocks on the GPU (a K tile is one block)",
                        std::to_string(spec.quant.block_n) + " x " + std::to_string(spec.quant.block_k));
  if (inputs.router_logits) EPMOE_RETURN_IF_ERROR(check_routing_limits(spec.routing));
  if (shape.top_k > cuda::kMaxTopK)
    return bad_argument("routing.top_k", "at most " + std::to_string(cuda::kMaxTopK) + " on the GPU",
                        std::to_string(shape.top_k));
  const int64_t multiple = is_fp8(spec.quant.scheme) ? 16 : 8;  // elements per 16-byte piece
  for (const auto& [name, size] : {std::pair{"H", shape.hidden}, std::pair{"I", shape.intermediate},
                                   std::pair{"I_s", shape.shared_intermediate}})
    if (size % multiple != 0)
      return bad_argument(name, "a multiple of " + std::to_string(multiple) + " on the GPU for " +
                                    std::string(quant_scheme_name(spec.quant.scheme)) + " (rows move in 16-byte pieces)",
                          std::to_string(size));
  // 16 bytes: rows move in 16-byte pieces, and TMA reads the weights (its tensor maps need it).
  for (const auto& [name, tensor] :
       {std::pair{"x", &inputs.x}, std::pair{"w13", &weights.w13}, std::pair{"w2", &weights.w2},
        std::pair{"shared_w13", weights.shared_w13 ? &*weights.shared_w13 : nullptr},
        std::pair{"shared_w2", weights.shared_w2 ? &*weights.shared_w2 : nullptr}})
    if (tensor && reinterpret_cast<uintptr_t>(tensor->data) % 16 != 0)
      return bad_argument(name, "16-byte aligned device memory", "an address off by " +
                                    std::to_string(reinterpret_cast<uintptr_t>(tensor->data) % 16));
  if (workspace.bytes < needed || (workspace.data == nullptr && needed > 0))
    return bad_argument("workspace", "at least " + std::to_string(needed) + " bytes (moe_workspace_bytes)",
                        std::to_string(workspace.bytes) + " bytes at " + (workspace.data ? "an address" : "null"));
  if (reinterpret_cast<uintptr_t>(workspace.data) % kAlignment != 0)
    return bad_argument("workspace", "256-byte aligned device memory", "a misaligned address");
  return {};
}

// The grid of activation scales as the quantiser writes them for rows of `stride` values
// (a static per-tensor scale when given; per tensor over expert groups: one per group).
cuda::ScaleGrid activation_grid(const QuantSpec& quant, float* scales, int64_t stride, const float* static_scale,
                                bool grouped_rows) {
  cuda::ScaleGrid grid{scales};
  switch (activation_granularity(quant.scheme)) {
    case cuda::Fp8Granularity::kPerGroup:
      grid.row_stride = (stride + quant.block_k - 1) / quant.block_k;
      grid.k_stride = 1;  // a K tile is one group of 128
      break;
    case cuda::Fp8Granularity::kPerRow: grid.row_stride = 1; break;
    case cuda::Fp8Granularity::kPerTensor:
      if (static_scale) grid.scales = static_scale;
      grid.group_stride = grouped_rows && !static_scale ? 1 : 0;
      break;
  }
  return grid;
}

// Quantised activation rows: their codes and the grid of their scales for the GEMM.
struct Fp8Input {
  Status status;
  const uint8_t* codes = nullptr;
  cuda::ScaleGrid grid;
};

// What a quantisation launch does beside its rows' codes: when it starts, the counters it
// zeroes on the way (Fp8Quantize::zero), and the rows it leaves alone (those no local pair
// reads, Fp8Quantize::slot_of_pair).
struct QuantizeExtras {
  cuda::Start start = cuda::Start::kEarly;
  int32_t* zero = nullptr;
  int64_t zero_count = 0;
  const int32_t* slot_of_pair = nullptr;
  int top_k = 0;
};

// values [rows, stride] bf16 (cols used per row, or as row_groups says) -> codes and scales
// per the scheme; a static scale (fp8_tensor) when the checkpoint has one.
Fp8Input quantize_input(const QuantSpec& quant, const uint16_t* values, int64_t rows, int64_t cols, int64_t stride,
                        uint8_t* codes, float* scales, const std::optional<Tensor>& static_scale,
                        const cuda::RowGroups& row_groups, uint32_t* amax_bits, cudaStream_t stream,
                        const QuantizeExtras& extras = {}) {
  cuda::Fp8Quantize q{values, codes, scales, rows, cols, stride, activation_granularity(quant.scheme)};
  q.group = quant.block_k;
  q.static_scale = static_scale ? static_scale->data_as<float>() : nullptr;
  q.amax_bits = amax_bits;
  q.row_groups = row_groups;
  q.zero = extras.zero;
  q.zero_count = extras.zero_count;
  q.slot_of_pair = extras.slot_of_pair;
  q.top_k = extras.top_k;
  const cuda::ScaleGrid grid = activation_grid(quant, scales, stride, q.static_scale, row_groups.offsets != nullptr);
  const cudaError_t error = cuda::launch_quantize_fp8(q, stream, extras.start);
  if (error != cudaSuccess)
    return {Status(StatusCode::kInternal, std::string("launch_quantize_fp8: ") + cudaGetErrorString(error)), codes, grid};
  return {Status{}, codes, grid};
}

// The scale grid of a weight [E, n, k] (per_expert) or [n, k] as the checkpoint stores it.
cuda::ScaleGrid weight_grid(const QuantSpec& quant, const std::optional<Tensor>& scale, int64_t n, int64_t k,
                            bool per_expert) {
  const Fp8Blocks blocks = weight_scale_blocks(quant, n, k);
  const bool one_block_row = blocks.scale_rows() == 1;  // per tensor: block_n 1, row_stride 0 (ScaleGrid)
  cuda::ScaleGrid grid{scale->data_as<float>(), one_block_row ? 1 : blocks.block_rows,
                       one_block_row ? 0 : blocks.scale_cols()};
  grid.k_stride = blocks.block_cols < k ? 1 : 0;  // fp8_block: one scale column per K tile of 128
  grid.group_stride = per_expert ? blocks.scale_rows() * blocks.scale_cols() : 0;
  return grid;
}

// One grouped GEMM over the plan's tile lists: the main list, then the shared experts' own
// list when they have one (their own tile height, no split K).
cudaError_t launch_tile_lists(cuda::GemmGroups gemm, const WorkspaceLayout& layout, bool gated, Activation activation,
                              cudaStream_t stream) {
  const cuda::TilePlan& plan = layout.tiles;
  const cudaError_t error =
      cuda::launch_grouped_gemm(gemm, layout.pairs, plan.max_tiles, plan.likely_tiles, gated, activation,
                                plan.tile_rows, stream);
  if (error != cudaSuccess || plan.shared_tiles == 0) return error;
  gemm.k_splits = 1;
  gemm.c_partial = nullptr;
  return cuda::launch_grouped_gemm(gemm, cuda::shared_tile_list(layout.pairs, plan, layout.arrival_scopes),
                                   plan.shared_tiles, plan.shared_tiles, gated, activation, plan.shared_tile_rows,
                                   stream);
}

}  // namespace

size_t moe_workspace_bytes(const MoeSpec& spec, const MoeShape& shape) {
  return WorkspaceLayout(spec, shape, nullptr).bytes;
}

Status route_cuda(const RoutingSpec& routing, const Tensor& router_logits, const std::optional<Tensor>& correction_bias,
                  const Tensor& topk_ids, const Tensor& topk_weights, CUstream_st* stream) {
  EPMOE_RETURN_IF_ERROR(validate_route(routing, router_logits, correction_bias, topk_ids, topk_weights, Device::kCuda));
  EPMOE_RETURN_IF_ERROR(check_routing_limits(routing));
  if (router_logits.size(0) == 0) return {};
  CUDA_CHECK(cuda::launch_route(routing, router_logits.data, router_logits.dtype == DType::kBF16,
                                correction_bias ? correction_bias->data_as<float>() : nullptr, router_logits.size(0),
                                topk_ids.data_as<int32_t>(), topk_weights.data_as<float>(), stream));
  return {};
}

Status moe_forward_cuda(const MoeSpec& spec, const MoeWeights& weights, const MoeInputs& inputs, const Tensor& out,
                        const CudaWorkspace& workspace, CUstream_st* stream) {
  Result<MoeShape> validated = validate_moe(spec, weights, inputs, &out, Device::kCuda);
  if (!validated.ok()) return validated.status();
  const MoeShape& s = validated.value();
  const WorkspaceLayout layout(spec, s, workspace.data);
  EPMOE_RETURN_IF_ERROR(check_gpu_limits(spec, s, inputs, weights, workspace, layout.bytes));
  if (s.tokens == 0) return {};

  const bool shared = s.shared_intermediate > 0;
  const bool fp8 = is_fp8(spec.quant.scheme);
  const uint16_t* x = inputs.x.data_as<uint16_t>();
  // GEMM1 starts the shared group's tiles before the sort where they share the main list
  // (GemmGroups::early_shared_tiles). On fp8_block they read x's codes, so x is quantised
  // first (the route, which waits for it before it lets the sort start, sits between it and
  // GEMM1), and that launch zeroes GEMM1's arrival counters in the sort's place, before any
  // early CTA arrives. Only the decode tile (16 rows) starts tiles early; elsewhere the x
  // quantisation first cost 2.3% (deepseek-v3 fp8_block T=64, docs/KERNELS.md).
  // A decode step of a few tokens: GEMM1 routes, maps and sorts them itself (SelfRouting), in
  // place of the route and the sort, its shared tiles (if any) early; on e4m3 after x's
  // quantisation, which then zeroes the counters, and all its CTAs wait for it.
  const int64_t widest = std::max(s.intermediate, s.shared_intermediate);
  const bool self_routes =
      cuda::routes_in_gemm1(layout.tiles, s.tokens, s.top_k, inputs.router_logits ? s.num_experts : 0, widest,
                            spec.quant.scheme, spec.apply_router_weight_on_input);
  const bool shared_early =
      shared && layout.tiles.shared_main_tiles > 0 && layout.tiles.tile_rows == cuda::kDecodeTileRows &&
      (!fp8 || self_routes || (spec.quant.scheme == QuantScheme::kFp8Block && inputs.router_logits.has_value()));
  const bool quantize_x_first = fp8 && (shared_early || self_routes);
  // x itself quantised: into the shared experts' buffers where the routed rows take x times
  // the router weight, else into the one set both take.
  auto quantize_x = [&](const QuantizeExtras& extras = {}) {
    return quantize_input(spec.quant, x, s.tokens, s.hidden, s.hidden,
                          layout.separate_shared_input ? layout.shared_x_codes : layout.x_codes,
                          layout.separate_shared_input ? layout.shared_x_scales : layout.x_scales, weights.input_scale,
                          {}, layout.amax_bits, stream, extras);
  };
  Fp8Input x_first{};
  if (quantize_x_first) {
    x_first = quantize_x({.start = cuda::Start::kAfterPredecessor,
                          .zero = layout.pairs.arrivals,
                          .zero_count = layout.pairs.arrival_count});
    EPMOE_RETURN_IF_ERROR(x_first.status);
  }
  cuda::PairLayout sort_layout = layout.pairs;
  if (quantize_x_first) sort_layout.arrival_count = 0;  // zeroed above
  const int32_t* topk_ids = layout.topk_ids;
  const float* topk_weights = layout.topk_weights;
  const int32_t* expert_map = inputs.expert_map ? inputs.expert_map->data_as<int32_t>() : nullptr;
  if (!inputs.router_logits) {
    topk_ids = inputs.topk_ids->data_as<int32_t>();
    topk_weights = inputs.topk_weights->data_as<float>();
  }
  if (inputs.router_logits && !self_routes) {
    CUDA_CHECK(cuda::launch_route(spec.routing, inputs.router_logits->data,
                                  inputs.router_logits->dtype == DType::kBF16,
                                  inputs.correction_bias ? inputs.correction_bias->data_as<float>() : nullptr,
                                  s.tokens, layout.topk_ids, layout.topk_weights, stream,
                                  quantize_x_first ? cuda::Start::kEarly : cuda::Start::kAfterPredecessor));
  }
  if (!self_routes)
    CUDA_CHECK(cuda::launch_sort_pairs(topk_ids, expert_map, s.tokens, static_cast<int>(s.top_k),
                                       static_cast<int>(s.num_experts), static_cast<int>(s.num_local_experts), shared,
                                       layout.tiles, sort_layout, stream,
                                       inputs.router_logits ? cuda::Start::kEarly : cuda::Start::kAfterPredecessor));
  const uint16_t* routed_input = x;
  if (spec.apply_router_weight_on_input) {
    CUDA_CHECK(cuda::launch_scale_rows(x, topk_weights, s.tokens, s.hidden, layout.x_scaled, stream));
    routed_input = layout.x_scaled;
  }

  // GEMM1 quantises its own output for GEMM2 where a scale covers at most 128 columns of a
  // row (fp8_block, or a static scale); per-token and dynamic per-tensor scales, which span
  // whole rows, keep the separate pass (EpilogueQuantize says why).
  const float* intermediate_static_scale =
      weights.intermediate_scale ? weights.intermediate_scale->data_as<float>() : nullptr;
  const bool fuse_quantize = spec.quant.scheme == QuantScheme::kFp8Block ||
                             (spec.quant.scheme == QuantScheme::kFp8Tensor && intermediate_static_scale != nullptr);
  // (GEMM2's rows of a row tile are complete once GEMM1's items of it are, unless a separate
  // quantisation pass comes between.)
  int32_t* const row_tile_columns = !fp8 || fuse_quantize ? layout.row_tile_columns : nullptr;
  const int groups = static_cast<int>(s.num_local_experts) + (shared ? 1 : 0);
  cuda::GemmGroups gemm1{};
  gemm1.a_routed = routed_input;
  gemm1.a_shared = x;
  gemm1.a_row_of_slot = layout.pairs.slot_token;
  gemm1.a_stride = s.hidden;
  gemm1.b_routed = weights.w13.data;
  gemm1.b_shared = shared ? weights.shared_w13->data : nullptr;
  gemm1.n = 2 * s.intermediate;
  gemm1.k = s.hidden;
  gemm1.n_shared = 2 * s.shared_intermediate;
  gemm1.k_shared = s.hidden;
  gemm1.local_experts = static_cast<int>(s.num_local_experts);
  gemm1.shared_first_slot = static_cast<int32_t>(s.tokens * s.top_k);
  gemm1.shared_rows = static_cast<int32_t>(s.tokens);
  if (shared_early) gemm1.early_shared_tiles = static_cast<int>(layout.tiles.shared_main_tiles);
  if (self_routes) {
    cuda::SelfRouting& routing = gemm1.self_routing;
    routing.enabled = true;
    if (inputs.router_logits) {
      routing.spec = spec.routing;
      routing.logits = inputs.router_logits->data;
      routing.logits_bf16 = inputs.router_logits->dtype == DType::kBF16;
      routing.correction_bias = inputs.correction_bias ? inputs.correction_bias->data_as<float>() : nullptr;
      routing.topk_ids_out = layout.topk_ids;
      routing.topk_weights_out = layout.topk_weights;
    } else {
      routing.topk_ids = topk_ids;
    }
    routing.expert_map = expert_map;
    routing.num_experts = static_cast<int>(s.num_experts);
    routing.top_k = static_cast<int>(s.top_k);
    routing.tokens = static_cast<int>(s.tokens);
    routing.published = row_tile_columns ? layout.layout_published : nullptr;  // with the hand-over only
  }
  gemm1.c = layout.intermediate;
  gemm1.c_stride = widest;
  if (fp8) {
    // x's codes serve the routed rows too unless those are x times the router weight. Codes
    // only the routed experts read are made only for the tokens with a local pair (the sort
    // has placed them): at ep=8 a third of the tokens have none (qwen3: top-8 of 128 experts,
    // 16 local), three quarters on mixtral-8x7b (top-2 of 8, one local). Not for a
    // per-tensor amax, which every row sets.
    const bool routed_rows_only = !self_routes && (!shared || layout.separate_shared_input) &&
                                  activation_granularity(spec.quant.scheme) != cuda::Fp8Granularity::kPerTensor;
    const Fp8Input routed =
        quantize_x_first && !layout.separate_shared_input
            ? x_first
            : quantize_input(spec.quant, routed_input, s.tokens, s.hidden, s.hidden, layout.x_codes, layout.x_scales,
                             weights.input_scale, {}, layout.amax_bits, stream,
                             {.slot_of_pair = routed_rows_only ? layout.pairs.slot_of_pair : nullptr,
                              .top_k = static_cast<int>(s.top_k)});
    EPMOE_RETURN_IF_ERROR(routed.status);
    Fp8Input shared_input = routed;
    if (layout.separate_shared_input) {  // the shared experts take x itself
      shared_input = quantize_x_first ? x_first : quantize_x();
      EPMOE_RETURN_IF_ERROR(shared_input.status);
    }
    gemm1.fp8 = true;
    gemm1.a_routed = layout.x_codes;
    gemm1.a_shared = shared_input.codes;
    gemm1.a_routed_scale = routed.grid;
    gemm1.a_shared_scale = shared_input.grid;
    gemm1.b_routed_scale = weight_grid(spec.quant, weights.w13_scale, gemm1.n, gemm1.k, true);
    if (shared) gemm1.b_shared_scale = weight_grid(spec.quant, weights.shared_w13_scale, gemm1.n_shared, gemm1.k, false);
    if (fuse_quantize) {
      cuda::EpilogueQuantize& q = gemm1.quantize;
      q.codes = layout.intermediate_codes;
      q.scales = layout.intermediate_scales;
      q.granularity = activation_granularity(spec.quant.scheme);
      q.group = spec.quant.block_k;
      q.static_scale = intermediate_static_scale;
      q.scopes_per_tile = layout.arrival_scopes;
      q.bf16_copy = false;  // GEMM2 reads the codes
    }
  }
  gemm1.row_tile_columns = row_tile_columns;
  CUDA_CHECK(launch_tile_lists(gemm1, layout, /*gated=*/true, spec.activation, stream));

  cuda::GemmGroups gemm2{};
  gemm2.a_routed = layout.intermediate;
  gemm2.a_shared = layout.intermediate;
  gemm2.a_stride = widest;
  gemm2.b_routed = weights.w2.data;
  gemm2.b_shared = shared ? weights.shared_w2->data : nullptr;
  gemm2.n = s.hidden;
  gemm2.k = s.intermediate;
  gemm2.n_shared = shared ? s.hidden : 0;
  gemm2.k_shared = s.shared_intermediate;
  gemm2.local_experts = static_cast<int>(s.num_local_experts);
  gemm2.shared_first_slot = gemm1.shared_first_slot;
  gemm2.shared_rows = gemm1.shared_rows;
  gemm2.c = layout.pair_out;
  gemm2.c_stride = s.hidden;
  gemm2.row_tile_columns = row_tile_columns;
  gemm2.layout_published = gemm1.self_routing.published;
  // With the hand-over, the decode tile's GEMM2 takes the shared group's tiles first too.
  if (row_tile_columns && layout.tiles.tile_rows == cuda::kDecodeTileRows)
    gemm2.early_shared_tiles = static_cast<int>(layout.tiles.shared_main_tiles);
  if (layout.tiles.k_splits > 1) {
    gemm2.k_splits = layout.tiles.k_splits;
    gemm2.c_partial = layout.pair_out_partials;
    gemm2.partial_stride = layout.slots * s.hidden;
  }
  if (fp8) {
    // The activated intermediate, rows grouped by expert (per tensor: one scale per expert),
    // quantised by GEMM1's epilogue, or here when its scale is a dynamic per-tensor amax.
    if (fuse_quantize) {
      gemm2.a_routed_scale =
          activation_grid(spec.quant, layout.intermediate_scales, widest, intermediate_static_scale, true);
    } else {
      const cuda::RowGroups row_groups{layout.pairs.group_offsets, groups, shared ? groups - 1 : -1,
                                       s.shared_intermediate, layout.pairs.group_counts};
      const Fp8Input intermediate =
          quantize_input(spec.quant, layout.intermediate, layout.slots, s.intermediate, widest,
                         layout.intermediate_codes, layout.intermediate_scales, weights.intermediate_scale, row_groups,
                         layout.amax_bits, stream);
      EPMOE_RETURN_IF_ERROR(intermediate.status);
      gemm2.a_routed_scale = intermediate.grid;
    }
    gemm2.fp8 = true;
    gemm2.a_routed = gemm2.a_shared = layout.intermediate_codes;
    gemm2.a_shared_scale = gemm2.a_routed_scale;
    gemm2.b_routed_scale = weight_grid(spec.quant, weights.w2_scale, gemm2.n, gemm2.k, true);
    if (shared)
      gemm2.b_shared_scale = weight_grid(spec.quant, weights.shared_w2_scale, gemm2.n_shared, gemm2.k_shared, false);
  }
  CUDA_CHECK(launch_tile_lists(gemm2, layout, /*gated=*/false, spec.activation, stream));

  const cuda::PairOutputs pair_out{layout.pair_out, layout.pair_out_partials, layout.tiles.k_splits,
                                   layout.slots * s.hidden, layout.tiles.shared_tiles > 0};
  cuda::CombineArgs combine{pair_out, layout.pairs.slot_of_pair, topk_weights, layout.pairs.group_offsets};
  combine.shared_group = shared ? static_cast<int>(s.num_local_experts) : -1;
  combine.unit_weights = spec.apply_router_weight_on_input;
  combine.tokens = s.tokens;
  combine.top_k = static_cast<int>(s.top_k);
  combine.hidden = s.hidden;
  combine.y = out.data_as<uint16_t>();
  combine.tokens_per_block = cuda::combine_tokens_per_block(s.tokens, s.hidden);
  CUDA_CHECK(cuda::launch_combine(combine, stream));
  return {};
}

}  // namespace epmoe
