// The kernel launchers of the CUDA MoE pipeline, one family per file in this folder.
// Internal to moe/cuda; moe_forward.cu strings them together.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "epmoe/moe_spec.h"
#include "launch.cuh"

namespace epmoe::cuda {

// Every launcher returns the launch's error (cudaGetLastError) so callers can check it.

// Limits of the routing kernel (one warp per token, scores in shared memory).
inline constexpr int kMaxRoutedExperts = 1024;
inline constexpr int kMaxTopK = 32;
inline constexpr int kMaxGroups = 32;

// route.cu: router logits [T, E] (f32 or bf16) -> topk_ids [T, k], topk_weights [T, k].
cudaError_t launch_route(const RoutingSpec& spec, const void* logits, bool logits_bf16, const float* correction_bias,
                         int64_t tokens, int32_t* topk_ids, float* topk_weights, cudaStream_t stream,
                         Start start = Start::kEarly);

// sort_pairs.cu. Groups are the local experts, then (optionally) the shared experts as one
// more group holding every token. Slots are grouped by group (their order inside a group
// is not fixed, and nothing depends on it).
struct PairLayout {
  int32_t* group_counts;   // [groups]
  int32_t* group_offsets;  // [groups + 1] first slot of each group
  int32_t* slot_of_pair;   // [T * k] slot, or -1 for pairs of non-local experts
  int32_t* slot_token;     // [slots] token of each slot
  int32_t* tile_group;     // [max_tiles + shared_tiles] group of each row tile of the GEMMs
  int32_t* tile_row;       // [max_tiles + shared_tiles] first slot of each row tile
  int32_t* tile_count;     // [2] tiles of the main list, and of the shared group's own list
  // Arrival counters of GEMM1's fused quantisation (EpilogueQuantize), then those of the
  // hand-over by row tile (GemmGroups::row_tile_columns), zeroed by sort_pairs.
  int32_t* arrivals = nullptr;
  int64_t arrival_count = 0;
  // [sort_blocks(T k), groups] each sort block's pairs per group, where it takes several.
  int32_t* block_counts = nullptr;
};
// A pair's group: the local index of expert `id` through the expert map (null: every expert
// local), or -1 where the id is out of range or the expert not on this rank.
__host__ __device__ inline int local_group(int32_t id, const int32_t* expert_map, int num_experts) {
  if (id < 0 || id >= num_experts) return -1;
  return expert_map ? expert_map[id] : id;
}
// Pairs one block of sort_pairs takes in a single launch; more take several blocks of
// kPairsPerSortBlock each (and block_counts, and a second launch).
inline constexpr int64_t kPairsInOneSortBlock = 8192;
inline constexpr int64_t kPairsPerSortBlock = 2048;
int64_t sort_blocks(int64_t pairs);
// Upper bound on row tiles of height `tile_rows` over `slots` slots in `groups` groups.
int64_t max_row_tiles(int64_t slots, int64_t groups, int tile_rows);
// How the GEMMs cut the groups into row tiles (grouped_gemm.cu's heuristic, plan_tiles).
// The routed experts' tile height follows the rows an expert is expected to get (T k / E);
// the shared experts get all T rows, so they may take a taller tile (when T is large enough
// for them to fill the GPU alone): then their tiles form a list of their own (tile_group /
// tile_row from max_tiles on, count in tile_count[1]) that the GEMMs launch apart, without
// split K.
struct TilePlan {
  int tile_rows = 16;         // the main list: routed groups (and the shared one, unless apart)
  int64_t max_tiles = 1;      // capacity of the main list
  int shared_tile_rows = 0;   // > 0: the shared group's own list, of this height
  int64_t shared_tiles = 0;   // its tiles (exactly ceil(T / shared_tile_rows))
  // Not apart: the shared group's tiles, ceil(T / tile_rows), which lead the main list.
  int64_t shared_main_tiles = 0;
  int k_splits = 1;           // GEMM2's split K on the main list
  // Row tiles the main list likely holds on this rank, under uniform routing: for choices by
  // how a launch's CTAs fill the GPU (never for sizes: any routing must fit max_tiles).
  int64_t likely_tiles = 1;
};
// Row tiles of height `tile_rows` an expert makes on average when each of `tokens` tokens
// picks it with probability `pick` (k / E under uniform routing): E[ceil(n / tile_rows)] for
// n ~ Binomial(tokens, pick).
double expected_tiles_per_expert(int64_t tokens, double pick, int tile_rows);
TilePlan plan_tiles(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t local_experts,
                    int64_t shared_intermediate, int64_t hidden, int64_t intermediate);
// The view of `layout` that holds only the shared group's own tile list.
PairLayout shared_tile_list(const PairLayout& layout, const TilePlan& plan, int64_t arrival_scopes);
cudaError_t launch_sort_pairs(const int32_t* topk_ids, const int32_t* expert_map, int64_t tokens, int top_k,
                       int num_experts, int local_experts, bool shared_group, const TilePlan& plan,
                       const PairLayout& layout, cudaStream_t stream, Start start = Start::kEarly);

// grouped_gemm.cu. One grouped GEMM over the tiles of PairLayout: for each row tile of
// group g and each column tile, C[slot, n] = sum_k A[row(slot), k] * B_g[n, k], bf16 or e4m3
// in, f32 accumulate, bf16 out. B_g is K-major ([N, K]).
// fp8 scales (value = code * scale) on a grid: the scale of row n (an A row after the
// gather, or a weight row) of group g in K tile k (128 elements) is
// scales[(n / block_n) * row_stride + k * k_stride + g * group_stride]. block_n is 1 unless
// rows share a scale in blocks (fp8_block weights); one scale for all rows is row_stride 0.
struct ScaleGrid {
  const float* scales = nullptr;
  int64_t block_n = 1, row_stride = 0, k_stride = 0, group_stride = 0;
};
// How fp8 activations are scaled: per row and group of columns (fp8_block), per row
// (dynamic per token), or per tensor.
enum class Fp8Granularity { kPerGroup, kPerRow, kPerTensor };
// Gated fp8 GEMM1: its epilogue also quantises the bf16 output for GEMM2, into the codes and
// scales launch_quantize_fp8 would write, for scales per group of 128 columns (fp8_block) or
// a static per-tensor scale. A group spans several column tiles: each CTA counts its arrival
// once its outputs are written, and the last to arrive quantises the group (reading it back
// from L2; the counters are PairLayout's arrivals, [tiles, scopes_per_tile]); under a
// static scale each CTA quantises its own tile. Scales per row (dynamic
// per token) or per expert (dynamic per tensor) span every column tile of a row, which
// would leave one CTA a long serial tail: they keep the separate pass.
struct EpilogueQuantize {
  uint8_t* codes = nullptr;  // [slots, c_stride]; null: no quantisation
  float* scales = nullptr;   // kPerGroup: [slots, ceil(c_stride / group)]
  Fp8Granularity granularity = Fp8Granularity::kPerGroup;  // kPerGroup or kPerTensor
  int64_t group = 128;                  // kPerGroup: columns per scale
  const float* static_scale = nullptr;  // kPerTensor
  int64_t scopes_per_tile = 0;          // kPerGroup: counters per row tile in PairLayout's arrivals
  // Whether GEMM1 still writes its bf16 output c beside the codes where it quantises from
  // registers (the specialised tile; the others re-read c to quantise it). GEMM2 reads only
  // the codes: the operator leaves it off (fp8_block layer, ep=8: -1 to -3% in most cases
  // measured, T=1024-16384); tests that compare the codes with the quantiser's over c keep it.
  bool bf16_copy = true;
};
// The most tokens, and pairs (a thread of the decode CTA each), a self-routing GEMM1 takes,
// and the most experts it routes from logits: 8 a lane, whose registers stay within what five
// e4m3 decode CTAs an SM leave (32 a lane spilled there). Tokens: one a warp, and bf16 at most
// 2 (routes_in_gemm1 says why).
inline constexpr int kMaxSelfRoutedTokens = 4;
inline constexpr int kMaxSelfRoutedTokensBf16 = 2;
inline constexpr int kMaxSelfRoutedPairs = 128;
inline constexpr int kMaxSelfRoutedExperts = 256;
// The decode GEMM1's own routing (routes_in_gemm1): each of its CTAs of a routed row tile
// routes the call's few tokens itself (route_token.cuh; or reads precomputed ids), maps and
// sorts the pairs in shared memory (decode_layout.cuh) and so finds its row tiles, where
// otherwise it would wait for the route and the sort, two launches ahead of it. One CTA
// then writes what those two would have (the choices for the combine, PairLayout) for GEMM2
// and the combine: they wait for GEMM1 as they do for the sort, except GEMM2 taking rows by
// row tile (e4m3), which waits for `published` instead.
struct SelfRouting {
  bool enabled = false;
  RoutingSpec spec;
  const void* logits = nullptr;  // [T, E] f32 or bf16; null: the precomputed topk_ids
  bool logits_bf16 = false;
  const float* correction_bias = nullptr;
  const int32_t* topk_ids = nullptr;  // [T, k], where logits are null
  int32_t* topk_ids_out = nullptr;    // [T, k], from the logits: the combine's input
  float* topk_weights_out = nullptr;
  const int32_t* expert_map = nullptr;  // [E] or null
  int num_experts = 0, top_k = 0, tokens = 0;
  // With the hand-over by row tile: set to 1 once the layout is out (zeroed by the launch
  // before GEMM1, x's quantisation, with PairLayout::arrivals); else null.
  int32_t* published = nullptr;
};
struct GemmGroups {
  const void* a_routed;      // A of the local experts' groups [*, K]
  const void* a_shared;      // A of the shared group [*, K_shared]
  const int32_t* a_row_of_slot;  // A row of each slot (gather), or null: row = slot
  int64_t a_stride;          // elements between rows of A
  const void* b_routed;      // [local experts, N, K]
  const void* b_shared;      // [N_shared, K_shared]
  int64_t n, k;              // of the local experts' B
  int64_t n_shared, k_shared;
  int local_experts;         // groups below this are local experts, the next one is shared
  int32_t shared_first_slot = 0, shared_rows = 0;  // the shared group's slots (sort_pairs: T k, T)
  // The first early_shared_tiles row tiles of the main list are the shared group's
  // (sort_pairs puts them there), whose CTAs need nothing the route or the sort writes:
  // grouped_gemm.cu's decode tile starts them first, GEMM1's without waiting for the sort,
  // GEMM2's (only with the hand-over by row tile) without reading the layout.
  int early_shared_tiles = 0;
  uint16_t* c;               // [slots, c_stride]
  int64_t c_stride;
  // Split K (not gated): k_splits CTAs share each tile's K and write f32 partial sums to
  // c_partial [k_splits, slots, c_stride] (partial_stride apart) instead of c.
  int k_splits = 1;
  float* c_partial = nullptr;
  int64_t partial_stride = 0;
  // e4m3 A and B (K a multiple of 16) with their scales; false: bf16.
  bool fp8 = false;
  ScaleGrid a_routed_scale, a_shared_scale, b_routed_scale, b_shared_scale;
  EpilogueQuantize quantize;  // gated fp8 only
  // The hand-over from GEMM1 to GEMM2 by row tile (hands_over_by_row_tile), on the specialised
  // and the decode tile: GEMM1 adds the output columns each of its items completed to
  // row_tile_columns[row tile] once they are written (and quantised); GEMM2 does not wait for
  // GEMM1 to finish, but before it loads an item's A waits for its row tile's count to reach
  // K (the whole intermediate of those rows). Its items then run on the SMs that GEMM1's last
  // round leaves idle (decode: the shared expert's GEMM2 beside the routed experts' GEMM1).
  // Zeroed with PairLayout::arrivals (their end). Null: GEMM2 waits for all of GEMM1.
  int32_t* row_tile_columns = nullptr;
  SelfRouting self_routing;  // gated, on the decode tile only
  // GEMM2 with the hand-over after a self-routing GEMM1 (SelfRouting::published): its CTAs
  // read the layout once this is set.
  const int32_t* layout_published = nullptr;
};
// gated: B rows are [gate; up] (N = 2 I) and C[slot, i] = act(gate_i) * up_i, i < I.
// max_tiles sizes the grid; likely_tiles (TilePlan's) only picks between configs of one height.
cudaError_t launch_grouped_gemm(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles,
                                int64_t likely_tiles, bool gated, Activation activation, int tile_rows,
                                cudaStream_t stream);
// grouped_gemm_specialized.cu: the same GEMM on the warp-specialised 128-row tile (TMA for
// B), which launch_grouped_gemm takes for tile_rows = 128; split K for GEMM2 (not gated).
cudaError_t launch_specialized_gemm(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles,
                                    int64_t likely_tiles, bool gated, Activation activation, cudaStream_t stream);
// The specialised tile's width (B rows) for a launch of likely_tiles row tiles over
// out_cols output columns (gated: of the intermediate) and K = k, each split k_splits ways:
// 256, or (bf16) 192 or 128 where the narrower items fill the SMs in enough fewer waves to
// pay for their lower rate. e4m3: 256 or 128, by the length of an item's K loop too (every
// scheme: fp8_block, and per channel and per tensor since the thirty-third session).
int specialized_tile_cols(bool fp8, bool gated, int64_t likely_tiles, int64_t out_cols, int64_t k, int k_splits);
// The decode tile's ring depth (stages) for a launch of likely_ctas CTAs: bf16 16 where they
// fit one an SM, else 8; e4m3 6 (carrying their K tile's scales) where they fit three an SM,
// else 5.
int choose_decode_stages(bool fp8, int64_t likely_ctas);
// The tile height launch_grouped_gemm works best with for groups of this many rows.
int choose_tile_rows(int64_t rows_per_group);
// The decode tile's height: the one tile whose GEMM1 starts the shared group's tiles early.
inline constexpr int kDecodeTileRows = 16;
// The warp-specialised tile's height (grouped_gemm_specialized.cu).
inline constexpr int kSpecializedTileRows = 128;
// Whether the plan lets GEMM2 take GEMM1's rows by row tile (GemmGroups::row_tile_columns):
// both GEMMs over one tile list, on the specialised tile, or (fp8) on the decode tile. The
// call hands over where GEMM1's epilogue also writes all of GEMM2's input (bf16, or fp8
// quantised in that epilogue; not where a quantisation pass over the intermediate comes
// between the two GEMMs). On the decode tile, measured at ep=8 (docs/KERNELS.md, eighteenth
// session): e4m3 T=1-64 -3 to -9% on qwen3-235b-a22b, qwen3-30b-a3b and mixtral-8x7b; bf16
// +2 to +9% at T=1 (its 16-stage GEMM1 CTAs fill an SM, so GEMM2's find no room beside them).
inline bool hands_over_by_row_tile(const TilePlan& plan, bool fp8) {
  return (plan.tile_rows == kSpecializedTileRows || (fp8 && plan.tile_rows == kDecodeTileRows)) &&
         plan.shared_tiles == 0;
}
// Whether GEMM1 routes for itself (SelfRouting), grouped_gemm.cu: on the decode tile, up to
// kMaxSelfRoutedTokens tokens (bf16 kMaxSelfRoutedTokensBf16, and no shared expert), kMaxSelfRoutedPairs pairs and,
// routing from logits, kMaxSelfRoutedExperts experts (routed_experts; 0: precomputed ids);
// any scheme (e4m3: x quantised first, which also zeroes the counters); the shared group (if
// any) in the main list (its tiles then start early, GemmGroups::early_shared_tiles); no
// router weight on the input (its scaling pass needs the weights before GEMM1); and the early
// CTAs with one routed lane, over GEMM1's out_cols output columns, held by the SMs at once.
bool routes_in_gemm1(const TilePlan& plan, int64_t tokens, int64_t top_k, int64_t routed_experts, int64_t out_cols,
                     QuantScheme scheme, bool router_weight_on_input);
// How many ways GEMM2 splits K: where its CTAs (expected_row_tiles x the column tiles of
// n) fill less than one wave of the CTAs the SMs hold at once (few experts, few tiles, at
// any tile height), as many as keep it within that wave; each split keeps at least four
// bf16 K tiles.
inline constexpr int kMaxKSplits = 8;
int choose_k_splits(int tile_rows, int64_t expected_row_tiles, int64_t n, int64_t k);

// combine.cu: y[t] = sum_j w_tj * out[slot(t, j)] (+ out[shared slot of t]), f32, one
// rounding to bf16. `unit_weights`: the router weight went on the input instead. A pair's
// out row is bf16 pair_out, or, after a split-K GEMM2, the sum of its k_splits f32 partial
// rows (in split order, then rounded to bf16 as pair_out would have been).
struct PairOutputs {
  const uint16_t* rows;   // [slots, H]
  const float* partials;  // [k_splits, slots, H] when k_splits > 1
  int k_splits = 1;
  int64_t partial_stride = 0;
  bool shared_rows_whole = false;  // the shared group's rows are bf16 rows even when k_splits > 1
};
// The most tokens a combine block takes.
inline constexpr int kMaxCombineTokensPerBlock = 8;
struct CombineArgs {
  PairOutputs pair_out;
  const int32_t* slot_of_pair;  // [T, k]
  const float* topk_weights;    // [T, k]
  const int32_t* group_offsets;  // [groups + 1]
  int shared_group = -1;  // the shared experts' group, -1: none
  bool unit_weights = false;
  int64_t tokens = 0;
  int top_k = 1;
  int64_t hidden = 0;
  uint16_t* y = nullptr;  // [T, H]
  int tokens_per_block = 1;  // 1 .. kMaxCombineTokensPerBlock; the result does not depend on it
};
// The tokens a combine block takes for this many tokens of H columns.
int combine_tokens_per_block(int64_t tokens, int64_t hidden);
cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream);
// x_scaled[t] = bf16(x[t] * w[t]) for the router weight on the input (k = 1).
cudaError_t launch_scale_rows(const uint16_t* x, const float* topk_weights, int64_t tokens, int64_t hidden,
                       uint16_t* x_scaled, cudaStream_t stream);

// quantize.cu: bf16 values [rows, stride] -> e4m3 codes [rows, stride] and f32 scales, as
// the CPU quantiser computes them:
//   kPerGroup: scales [rows, ceil(stride / group)], one per row and group of `group` columns;
//   kPerRow:   scales [rows], one per row (per token);
//   kPerTensor: scales [1], or [row_groups.count] (one per group of rows) with row_groups;
//     from `static_scale` when given, else from the amax, which needs `amax_bits` (one
//     uint32 of device scratch per scale).
// Rows grouped by expert (PairLayout's group_offsets): rows past the last group are unused;
// rows of `shared_group` hold shared_cols values, the others cols.
struct RowGroups {
  const int32_t* offsets = nullptr;  // [count + 1] on the device; null: every row used, cols wide
  int count = 0;
  int shared_group = -1;
  int64_t shared_cols = 0;
  const int32_t* counts = nullptr;  // [count]: group g's rows are [offsets[g], + counts[g]), the rest unused
};
struct Fp8Quantize {
  const uint16_t* values;
  uint8_t* codes;
  float* scales;
  int64_t rows, cols, stride;
  Fp8Granularity granularity;
  int64_t group = 0;  // kPerGroup
  const float* static_scale = nullptr;
  uint32_t* amax_bits = nullptr;
  RowGroups row_groups;
  // Counters this launch zeroes (GEMM1's arrivals, where x's quantisation is the call's first
  // kernel: moe_forward.cu, the early shared tiles on fp8_block and GEMM1's own routing).
  int32_t* zero = nullptr;
  int64_t zero_count = 0;
  // Where set (x for the routed experts, per group or per row, without row_groups): row t is
  // quantised only if one of slot_of_pair[t top_k, + top_k) is a slot; the rows of tokens no
  // local pair reads keep whatever their codes and scales held.
  const int32_t* slot_of_pair = nullptr;
  int top_k = 0;
};
// `start` applies to the first of its launches.
cudaError_t launch_quantize_fp8(const Fp8Quantize& quantize, cudaStream_t stream, Start start = Start::kEarly);

}  // namespace epmoe::cuda
