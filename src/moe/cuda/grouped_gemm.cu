// Grouped GEMM over the experts' row tiles, bf16 or e4m3 tensor cores (f32 accumulate),
// with the gather of A rows and the gated activation fused: the decode (16-row) and medium
// (64-row) tiles, where every thread both loads and multiplies; 128-row tiles are
// grouped_gemm_specialized.cu's. The tile format and wgmma helpers: gemm_tiles.cuh.
//
// Work: blockIdx.x = a row tile of PairLayout (one group = one expert, up to tile_rows
// consecutive slots), blockIdx.y = a column tile (GEMM1 on the decode tile puts the shared
// group's tiles first, GemmGroups::early_shared_tiles). Tiles past tile_count exit at once, so
// the grid is sized from an upper bound and the launch needs no host synchronisation.
// Layout: A rows (activations, K-major) are gathered per slot through a_row_of_slot; B is
// the expert's weight [N, K], K-major, so both operands are "K-contiguous" and a C tile is
// sum_k A[m, k] B[n, k] (a TN GEMM). Tiles of A (rows x 128 bytes of K) and B (cols x 128
// bytes) stream through a STAGES-deep cp.async ring in shared memory, 16-byte chunks
// XOR-swizzled by row (the 128-byte swizzle wgmma reads, and free of bank conflicts for
// ldmatrix). Everything up to the tensor-core instruction moves bytes, so bf16 (64 K per
// stage) and e4m3 (128 K per stage) share it; only the instruction differs.
// fp8: a stage's products go to a second accumulator, added to the first every stage (a
// stage is one 128-wide K block of fp8_block), times the stage's A and B scales for
// fp8_block, or unscaled with the scales applied once in the epilogue for per-channel and
// per-tensor scales. The price: a completed wgmma group per stage (no overlap of two
// groups).
// Gated (GEMM1): the B tile interleaves gate and up rows in blocks of 8 (8 gate rows of
// columns c..c+7, then the 8 up rows of the same columns), so each thread's accumulators
// hold gate and up of the same output element, and act(gate) * up is written directly as
// the bf16 intermediate: no extra pass over it; for fp8_block (and a static per-tensor
// scale) GEMM1's epilogue also writes its e4m3 codes and scales for GEMM2 (quantize_output).
// Tensor cores: wgmma (sm_90a) for the 64 x 128 tile; for the 16-row
// decode tile, where the weights stream once and bandwidth is the bound, mma.sync (bf16) or
// wgmma with the operands swapped (e4m3: weights as m64, tokens as n16). mma.sync and wgmma
// keep their accumulators in the same fragment order, so one epilogue serves both; the
// swapped tile holds its accumulators transposed and has its own.
#include <algorithm>
#include <cmath>

#include "decode_layout.cuh"
#include "gemm_tiles.cuh"
#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

enum class Instruction { kMmaSync, kWgmma, kWgmmaSwapped };

// A tile shape and the tensor-core instruction that computes it. Chosen by
// choose_tile_rows(); only the three configs below are instantiated.
//   mma.sync: WarpsM x WarpsN warps, each a (Rows / WarpsM) x (Cols / WarpsN) tile of m16n8k16.
//   wgmma:    Rows / 64 warpgroups, each m64 x Cols (one m64nColsk16 per 16 of K); warp w of the
//             CTA holds rows 16w..16w+15, so the epilogue indexes both alike.
//   wgmma with the operands swapped (e4m3 decode): one warpgroup computes the tile transposed,
//             m64 over the Cols = 64 weight rows and n16 over the Rows = 16 token rows, so the
//             weights stream through wgmma (e4m3 has no native mma.sync on sm_90); warp w
//             holds weight rows 16w..16w+15.
template <Instruction Kind, int Rows, int Cols, int Stages, int WarpsM, int WarpsN, int TilesPerWait = 1,
          bool ScalesInRing = false>
struct Config {
  static constexpr Instruction kInstruction = Kind;
  static constexpr int kRows = Rows, kCols = Cols, kStages = Stages, kWarpsN = WarpsN;
  // wgmma: the K tiles whose sums one wait completes (fp8_block needs a K tile's sums for its
  // scales; a wait per K tile held the swapped decode tile's loop, ~14 GB/s a CTA at T=1). The
  // kernel takes one a wait, its group left in flight, where the sums stay in acc (all but fp8_block).
  static constexpr int kTilesPerWait = TilesPerWait;
  static constexpr int kThreads = WarpsM * WarpsN * 32;
  static constexpr int kWarpRows = Rows / WarpsM, kWarpCols = Cols / WarpsN;
  static constexpr int kMmaM = kWarpRows / 16, kMmaN = kWarpCols / 8;
  static constexpr int kStageBytes = (Rows + Cols) * kRowBytes;
  // ScalesInRing (e4m3 on wgmma): fp8_block's scales of a stage's K tile travel with it, after
  // the ring: one of each weight row, then one of each token row.
  static constexpr int kStageScales = ScalesInRing ? Cols + Rows : 0;
  // + 1 KiB to align the ring to the 1024-byte period of the 128-byte swizzle (wgmma needs it).
  static constexpr size_t kSharedBytes =
      size_t{Stages} * kStageBytes + size_t{Stages} * kStageScales * sizeof(float) + 1024;
  static_assert(kWarpRows % 16 == 0 && kWarpCols % 16 == 0, "warp tile must hold whole mma tiles and gate/up pairs");
  static_assert(Kind != Instruction::kWgmma || (WarpsN == 1 && kWarpRows == 16 && Cols == 128),
                "wgmma configs: one warp per 16 rows, m64n128 per warpgroup");
  static_assert(Kind != Instruction::kWgmmaSwapped || (Rows == 16 && Cols == 64 && WarpsM == 1 && WarpsN == 4),
                "swapped wgmma: one warpgroup, m64 over 64 weight rows, n16 over 16 tokens (kMmaN = Rows / 8)");
  static_assert(TilesPerWait == 1 || (Kind == Instruction::kWgmmaSwapped && TilesPerWait < Stages),
                "K tiles a wait: the swapped tile's small sums, and a ring that holds them and a stage in flight");
  static_assert(!ScalesInRing || Kind != Instruction::kMmaSync, "scales in the ring: the e4m3 (wgmma) tiles");
};

// Decode: narrow column tiles (twice the CTAs of 128) and a deep ring, so even one or two
// experts keep every SM streaming. bf16 on mma.sync with 8 stages of 8 KiB of weights (two
// CTAs an SM; 6 stages lost up to 13% on mixtral-8x7b). e4m3 on swapped wgmma, same tiles:
// its K loop waits on the wgmma of two K tiles at a time before applying their scales, and
// more resident CTAs hide that wait where a deeper ring does not. 6 stages (three CTAs an SM)
// while the SMs hold a launch's CTAs at once, else 5 (four an SM). Measured against 8 (ep=8,
// one H200, docs/KERNELS.md): 6 stages deepseek-v3 fp8_block T=2-16 -7 to -10%. Two tiles a
// wait with 5 shallow stages, against one tile a wait with 4 (ep=8, one H100, twenty-first
// session): deepseek-v3 T=1 -6.4%, qwen3-235b-a22b T=64 -7.1%, mixtral-8x7b T=64 -5.6%.
// The 6 stages carry their K tile's fp8_block scales (a thread's own 4-byte loads, a round
// ahead, paced the loop where a launch's CTAs are few). ep=8, one H100, twenty-third session:
// T=1 deepseek-v3 -5.9%, qwen3-30b-a3b -8.7%; T=2 deepseek-v3 / qwen3-235b-a22b / qwen3-30b-a3b
// -2.9 / -4.0 / -7.2%; qwen3-30b-a3b T=16 / 64 -6.7 / -5.7%; mixtral-8x7b T=64 +2.3% (its split
// GEMM2). On the shallow ring (more CTAs) the same came to -2.7 to +2.0% (deepseek-v3 T=16-256
// +0.5 to +1.9%), on the medium tile +1.6% (deepseek-v3 T=1024): both keep their scales in
// registers.
// Where a launch's likely CTAs fit one an SM (a decode step over one or two experts), bf16
// takes a 16-stage ring instead: a CTA's K loop then streams what its ring has in flight
// (about 2 us of memory latency at T=1). T=1, ep=8: deepseek-v3 -9.1%, the other presets
// -0.4 to -2.3%; e4m3 on 16 stages lost 11% on deepseek-v3 (docs/KERNELS.md, ninth session).
// choose_decode_stages picks the depth.
using DecodeConfig = Config<Instruction::kMmaSync, kDecodeTileRows, 64, 8, 1, 4>;
using DecodeFp8Config = Config<Instruction::kWgmmaSwapped, kDecodeTileRows, 64, 6, 1, 4, 2, /*ScalesInRing=*/true>;
using DecodeFp8ShallowConfig = Config<Instruction::kWgmmaSwapped, kDecodeTileRows, 64, 5, 1, 4, 2>;
using DecodeDeepConfig = Config<Instruction::kMmaSync, kDecodeTileRows, 64, 16, 1, 4>;
// CTAs of a config an SM holds: its 228 KiB of shared memory, 1 KiB of each CTA's reserved.
template <typename Cfg>
constexpr int64_t ctas_per_multiprocessor() {
  return 228 * 1024 / (Cfg::kSharedBytes + 1024);
}
static_assert(ctas_per_multiprocessor<DecodeFp8Config>() == 3 &&
              ctas_per_multiprocessor<DecodeFp8ShallowConfig>() == 4 &&
              ctas_per_multiprocessor<DecodeDeepConfig>() == 1);
// The self-routing GEMM1's static DecodePairs leaves these counts as they are (its launch
// and routes_in_gemm1 read ctas_per_multiprocessor).
template <typename Cfg>
constexpr int64_t ctas_per_multiprocessor_self_routing() {
  return 228 * 1024 / (Cfg::kSharedBytes + sizeof(DecodePairs) + 1024);
}
static_assert(ctas_per_multiprocessor_self_routing<DecodeConfig>() == ctas_per_multiprocessor<DecodeConfig>() &&
              ctas_per_multiprocessor_self_routing<DecodeDeepConfig>() == ctas_per_multiprocessor<DecodeDeepConfig>() &&
              ctas_per_multiprocessor_self_routing<DecodeFp8Config>() == ctas_per_multiprocessor<DecodeFp8Config>() &&
              ctas_per_multiprocessor_self_routing<DecodeFp8ShallowConfig>() ==
                  ctas_per_multiprocessor<DecodeFp8ShallowConfig>());
// choose_decode_stages's depth names the config: the four differ.
static_assert(DecodeDeepConfig::kStages != DecodeConfig::kStages &&
              DecodeDeepConfig::kStages != DecodeFp8Config::kStages &&
              DecodeDeepConfig::kStages != DecodeFp8ShallowConfig::kStages &&
              DecodeConfig::kStages != DecodeFp8Config::kStages &&
              DecodeConfig::kStages != DecodeFp8ShallowConfig::kStages &&
              DecodeFp8Config::kStages != DecodeFp8ShallowConfig::kStages);
using MediumConfig = Config<Instruction::kWgmma, 64, 128, 4, 4, 1>;
// The most rows an expert expects for which the medium tile is chosen (choose_tile_rows).
inline constexpr int64_t kMediumMostRows = 32;

__device__ void ldmatrix_x4(uint32_t (&out)[4], const uint8_t* address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
               : "r"(shared_address(address)));
}

__device__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Routed row tile `routed` of a self-routing CTA's list (build_decode_pairs).
__device__ RowTile self_routed_tile(const GemmGroups& groups, const DecodePairs& pairs, int routed) {
  return {pairs.tile_group[routed], pairs.tile_first[routed], pairs.tile_end[routed], false, groups.n, groups.k};
}

// kSelfRoutes: GEMM1 on the decode tile routes for itself (GemmGroups::self_routing).
template <typename Cfg, bool kGated, Scales kScales, bool kSelfRoutes = false>
__global__ void __launch_bounds__(Cfg::kThreads, kSelfRoutes ? ctas_per_multiprocessor<Cfg>() : 1)
    grouped_gemm_kernel(GemmGroups groups, PairLayout layout, Activation activation) {
  constexpr size_t kRouteScratchBytes =
      Cfg::kThreads / 32 * routing::route_scratch_floats(kMaxSelfRoutedExperts) * sizeof(float);
  static_assert(!kSelfRoutes || (kGated && Cfg::kRows == kDecodeTileRows && Cfg::kThreads >= kMaxSelfRoutedPairs &&
                                 Cfg::kStages * Cfg::kStageBytes >= kRouteScratchBytes),
                "self-routing: GEMM1 on the decode tile, a thread per pair, the routing's scratch in the ring");
  constexpr bool kFp8 = kScales != Scales::kNone;
  using Op = Operand<kFp8>;
  extern __shared__ __align__(128) uint8_t shared_raw[];
  uint8_t* shared_tiles = aligned_tiles(shared_raw);
  // The decode tile's hand-over by row tile (GemmGroups::row_tile_columns; e4m3 only,
  // hands_over_by_row_tile): GEMM2 does not wait for GEMM1's grid but for each row tile's
  // columns, so a row tile's GEMM2 runs while other experts' GEMM1 still streams. GEMM2
  // reads the sort's layout without a wait of its own: GEMM1 lets it launch only from past
  // the wait for the sort.
  const bool hands_over = groups.row_tile_columns != nullptr;
  if (!kGated || !hands_over) allow_successor();
  // On the decode tile the shared group's tiles (the first early_shared_tiles of the list)
  // come first in the grid, every column of one, then of the next. GEMM1's start at once:
  // they read x (or its codes) and the weights, complete before the route started, and
  // write slots (and arrival counters) nothing else touches before GEMM2, so they stream the
  // shared expert's weights while the route and the sort run. GEMM2's (with the hand-over)
  // take the SMs before the routed tiles', which wait longer. The other CTAs keep the grid's
  // order (row tiles fastest) and wait for the sort. Measured (ep=8, docs/KERNELS.md, twelfth
  // session): deepseek-v3 T=1 bf16 -16.8%, fp8_block -17.6%, llama4-scout bf16 -8.4%; on the
  // medium tile +3 to +7% at T=256-1024.
  // Self-routing (SelfRouting), the CTAs after the early ones are routed lanes: lane w takes
  // routed row tiles w, w + lanes, ... of one column tile, column tiles fastest, so that lane
  // 0's CTAs (with a row tile whenever any expert of the rank has rows) start first and the
  // CTAs of lanes without a row tile, which still route before they know it, come last.
  int tile = blockIdx.x, column_tile = blockIdx.y;
  bool early = false;
  const int early_tiles = groups.early_shared_tiles;
  if constexpr (Cfg::kRows == kDecodeTileRows) {
    if (kSelfRoutes || (early_tiles > 0 && (kGated || hands_over))) {
      const int position = blockIdx.x + gridDim.x * blockIdx.y, early_ctas = early_tiles * gridDim.y;
      early = position < early_ctas;
      const int later = position - early_ctas, later_tiles = gridDim.x - early_tiles;
      tile = early ? position % early_tiles : early_tiles + (kSelfRoutes ? later / gridDim.y : later % later_tiles);
      column_tile = early ? position / early_tiles : kSelfRoutes ? later % gridDim.y : later / later_tiles;
    }
  }
  // (Early GEMM1 CTAs let GEMM2 launch at once where later ones exist to hold it back.)
  if (kGated && hands_over && early && static_cast<int>(gridDim.x) > early_tiles) allow_successor();
  if (!early) {
    if (!kSelfRoutes && (kGated || !hands_over)) wait_for_predecessor();
    if (!kSelfRoutes && kGated && hands_over) allow_successor();
    // GEMM2 after a self-routing GEMM1 (e4m3 decode, with the hand-over): the layout once out.
    if constexpr (kFp8 && !kGated && Cfg::kRows == kDecodeTileRows) {
      if (groups.layout_published) {
        if (threadIdx.x == 0) wait_for_columns(groups.layout_published, 1);
        __syncthreads();
      }
    }
    if (!kSelfRoutes && tile >= *layout.tile_count) return;
  }
  // Self-routing: a routed lane's CTA makes the pair layout itself (its routing scratch in the
  // ring, which it fills only once it knows its tiles), then takes its tiles one by one (the
  // loop below runs once otherwise). Every CTA then waits for the launch before (e4m3: x's
  // quantisation, which also zeroes the counters; bf16: none, GEMM1 comes first). The first
  // lane's first CTA writes the layout out for GEMM2 and the combine: before its tiles where
  // GEMM2 takes rows by row tile (it reads the layout once out), else after them.
  const bool self_routed = kSelfRoutes && !early;
  const int routed_lane = tile - early_tiles, routed_lanes = static_cast<int>(gridDim.x) - early_tiles;
  int routed = routed_lane;
  const int32_t* a_row_of_slot = groups.a_row_of_slot;
  auto publish = [&] {
    if constexpr (kSelfRoutes) {
      if (self_routed && routed_lane == 0 && column_tile == 0)
        publish_decode_layout(groups.self_routing, decode_pairs(), layout, groups.local_experts, early_tiles,
                              Cfg::kRows);
    }
  };
  if constexpr (kSelfRoutes) {
    if (self_routed)
      build_decode_pairs(groups.self_routing, Cfg::kRows, reinterpret_cast<float*>(shared_tiles), decode_pairs());
    wait_for_predecessor();
    if (self_routed) {
      if (hands_over) {
        // Past the wait, so that GEMM2, which reads the counters and the flag at once,
        // launches after x's quantisation has zeroed them.
        allow_successor();
        publish();
      }
      if (routed >= decode_pairs().routed_tiles) {
        if (!hands_over) publish();
        return;
      }
      a_row_of_slot = decode_pairs().slot_token;
    }
  }
  do {
    const RowTile this_tile = early         ? early_shared_tile(groups, tile, Cfg::kRows)
                              : kSelfRoutes ? self_routed_tile(groups, decode_pairs(), routed)
                                            : row_tile(groups, layout, tile);
    const auto& [group, first_slot, group_end, shared, N, K] = this_tile;
    const auto* A = static_cast<const uint8_t*>(shared ? groups.a_shared : groups.a_routed);
    const auto* B = static_cast<const uint8_t*>(shared ? groups.b_shared : groups.b_routed) +
                    (shared ? 0 : static_cast<int64_t>(group) * N * K * Op::kBytes);
    // Output columns of this tile: gated tiles produce Cols / 2 intermediate columns.
    const int64_t out_cols = kGated ? N / 2 : N;
    const int64_t first_col = static_cast<int64_t>(column_tile) * (kGated ? Cfg::kCols / 2 : Cfg::kCols);
    if (first_col >= out_cols) return;
    // The weight row behind column `col` of the tile (gated: gate and up rows interleaved by 8),
    // or -1 past the matrix.
    auto weight_row = [&](int col) -> int64_t {
      if constexpr (kGated) {
        const int64_t out = first_col + (col / 16) * 8 + col % 8;
        return out < out_cols ? (col % 16 < 8 ? 0 : out_cols) + out : -1;
      } else {
        return first_col + col < N ? first_col + col : -1;
      }
    };
    // The A row behind tile row `row`, or -1 past the tile or the group.
    auto a_row = [&](int row) -> int64_t {
      if (row >= Cfg::kRows) return -1;
      return kSelfRoutes ? a_row_of(groups, this_tile, row, a_row_of_slot) : a_row_of(groups, this_tile, row);
    };

    // The global rows this thread copies into each stage, fixed over the K loop.
    constexpr int kAChunks = Cfg::kRows * kChunksPerRow / Cfg::kThreads;
    constexpr int kBChunks = Cfg::kCols * kChunksPerRow / Cfg::kThreads;
    static_assert(kAChunks * Cfg::kThreads == Cfg::kRows * kChunksPerRow || Cfg::kRows * kChunksPerRow < Cfg::kThreads,
                  "A tile chunks must spread evenly over the threads");
    const uint8_t* a_source[kAChunks > 0 ? kAChunks : 1];
    const uint8_t* b_source[kBChunks];
    const int chunk = threadIdx.x % kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kAChunks > 0 ? kAChunks : 1); ++i) {
      const int64_t row = a_row((threadIdx.x + i * Cfg::kThreads) / kChunksPerRow);
      a_source[i] = row >= 0 ? A + row * groups.a_stride * Op::kBytes + chunk * 16 : nullptr;
    }
#pragma unroll
    for (int i = 0; i < kBChunks; ++i) {
      const int64_t row = weight_row((threadIdx.x + i * Cfg::kThreads) / kChunksPerRow);
      b_source[i] = row >= 0 ? B + row * K * Op::kBytes + chunk * 16 : nullptr;
    }

    const ScaleGrid& a_scales = shared ? groups.a_shared_scale : groups.a_routed_scale;
    const ScaleGrid& b_scales = shared ? groups.b_shared_scale : groups.b_routed_scale;
    // fp8_block with the scales in the ring (Cfg::kStageScales): each stage's scale line l <
    // kCols is weight row l's B scale, line kCols + r token row r's A scale, copied with the
    // stage by the threads in turn; else each thread loads its own into registers a round ahead.
    constexpr bool kScalesInRing = Cfg::kStageScales > 0 && kScales == Scales::kPerKTile;
    constexpr int kScaleLines = (Cfg::kStageScales + Cfg::kThreads - 1) / Cfg::kThreads;  // a thread's
    float* const ring_scales = reinterpret_cast<float*>(shared_tiles + Cfg::kStages * Cfg::kStageBytes);
    int32_t ring_scale_at[kScaleLines > 0 ? kScaleLines : 1] = {};  // of line threadIdx.x + i kThreads
    if constexpr (kScalesInRing) {
#pragma unroll
      for (int i = 0; i < kScaleLines; ++i) {
        const int line = static_cast<int>(threadIdx.x) + i * Cfg::kThreads;
        if (line < Cfg::kCols)
          ring_scale_at[i] = scale_index(b_scales, max(weight_row(line), int64_t{0}), shared ? 0 : group);
        else if (line < Cfg::kStageScales)
          ring_scale_at[i] = scale_index(a_scales, max(a_row(line - Cfg::kCols), int64_t{0}), group);
      }
    }
    // (copy_a, copy_b: GEMM2's prologue with the hand-over loads B before A; as separate
    // lambdas the bf16 decode K loop lost 1-7% at T=1-16.)
    auto load_stage = [&](int stage, int64_t k0, bool copy_a = true, bool copy_b = true) {
      uint8_t* a_tile = shared_tiles + stage * Cfg::kStageBytes;
      uint8_t* b_tile = a_tile + Cfg::kRows * kRowBytes;
      const bool k_valid = k0 + chunk * (16 / Op::kBytes) < K;
      const int64_t k_offset = k0 * Op::kBytes;
#pragma unroll
      for (int i = 0; i < (kAChunks > 0 ? kAChunks : 1); ++i) {
        const int row = (threadIdx.x + i * Cfg::kThreads) / kChunksPerRow;
        if (!copy_a || row >= Cfg::kRows) continue;
        const bool valid = a_source[i] && k_valid;
        copy_async(a_tile + swizzled(row, chunk), valid ? a_source[i] + k_offset : A, valid);
      }
#pragma unroll
      for (int i = 0; i < kBChunks; ++i) {
        if (!copy_b) continue;
        const int row = (threadIdx.x + i * Cfg::kThreads) / kChunksPerRow;
        const bool valid = b_source[i] && k_valid;
        copy_async(b_tile + swizzled(row, chunk), valid ? b_source[i] + k_offset : B, valid);
      }
      if constexpr (kScalesInRing) {
        const auto k_tile = static_cast<int32_t>(k0 / Op::kDepth);
#pragma unroll
        for (int i = 0; i < kScaleLines; ++i) {
          const int line = static_cast<int>(threadIdx.x) + i * Cfg::kThreads;
          const bool b_line = line < Cfg::kCols;
          if (line >= Cfg::kStageScales || !(b_line ? copy_b : copy_a)) continue;
          const ScaleGrid& grid = b_line ? b_scales : a_scales;
          copy_scale_async(ring_scales + stage * Cfg::kStageScales + line,
                           grid.scales + ring_scale_at[i] + k_tile * static_cast<int32_t>(grid.k_stride));
        }
      }
    };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_row = (warp / Cfg::kWarpsN) * Cfg::kWarpRows;
    const int warp_col = (warp % Cfg::kWarpsN) * Cfg::kWarpCols;
    float acc[Cfg::kMmaM][Cfg::kMmaN][4] = {};

    // fp8 (value = code * scale): where the scales change along K (fp8_block: a K tile is 128
    // elements, one block), each stage's products land in stage_acc and are added to acc times
    // the stage's scales; else the tensor cores add every K tile into acc, as for bf16 (CUTLASS's
    // FP8FastAccum), and acc is scaled once before the epilogue. (Against two K tiles
    // a wait, each promoted: ep=8, one H100, thirty-ninth session, two calls: T=1 -4 to -8% on
    // deepseek-v3 and qwen3-235b-a22b, 0 to -2% on qwen3-30b-a3b; T=16-64 within 1%. One
    // call's qwen3-235b-a22b fp8_tensor variant ran at a lower clock: +1 to +2% at T=1-64.)
    constexpr bool kPerKTile = kScales == Scales::kPerKTile;
    // K tiles a wgmma wait: fp8_block's rounds (Config::kTilesPerWait); where the sums stay in
    // acc, one, and the wait leaves a K tile's group in flight while the next is issued.
    constexpr int kRound = kPerKTile ? Cfg::kTilesPerWait : 1;
    float stage_acc[kRound][kPerKTile ? Cfg::kMmaM : 1][kPerKTile ? Cfg::kMmaN : 1][4];
    // Scale indices, fixed over the K loop: of this thread's fragment rows (A) and columns (B),
    // into the scale grids (rows and columns past the matrix read the first, never used), or
    // with the scales in the ring into a stage's scale lines. (The grid's index is written out
    // here and for the ring's lines: shared through a lambda, it rescheduled the medium tile's
    // SASS, which has no ring.)
    // fp8_block: a tile's weight rows fall in one 128-row block per side (its gate rows, its
    // up rows: tiles are aligned to their width, which divides 128), so two B scales serve
    // all columns (ni even / odd); otherwise one per column (ni, j) at 2 ni + j. Swapped: the
    // thread's tokens are 8 j + 2 (lane % 4) + e (A scales [j][e]) and its weight rows
    // 16 warp + lane / 4 + 8 h (B scales [h]: gate and up rows, or two rows).
    constexpr bool kSwapped = Cfg::kInstruction == Instruction::kWgmmaSwapped;
    constexpr int kAScaleRows = kFp8 ? (kSwapped ? Cfg::kRows / 8 : Cfg::kMmaM) : 1;
    constexpr int kBScales = kSwapped || kPerKTile ? 2 : kFp8 ? 2 * Cfg::kMmaN : 1;
    using RowScales = float[kAScaleRows][2];
    using ColumnScales = float[kBScales];
    int32_t a_scale_at[kAScaleRows][2], b_scale_at[kBScales];
    auto b_scale_of = [](int ni, int j) { return kPerKTile ? ni % 2 : 2 * ni + j; };
    if constexpr (kFp8) {
#pragma unroll
      for (int mi = 0; mi < kAScaleRows; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = kSwapped ? mi * 8 + (lane % 4) * 2 + half : warp_row + mi * 16 + lane / 4 + half * 8;
          a_scale_at[mi][half] =
              kScalesInRing ? Cfg::kCols + row : scale_index(a_scales, max(a_row(row), int64_t{0}), group);
        }
#pragma unroll
      for (int c = 0; c < kBScales; ++c) {
        const int column = kSwapped ? warp * 16 + lane / 4 + c * 8
                                    : warp_col + (kPerKTile ? c : c / 2) * 8 + (lane % 4) * 2 + (kPerKTile ? 0 : c % 2);
        b_scale_at[c] =
            kScalesInRing ? column : scale_index(b_scales, max(weight_row(column), int64_t{0}), shared ? 0 : group);
      }
    }
    auto load_scales = [&](int k_tile, RowScales& a_out, ColumnScales& b_out) {
      if constexpr (kFp8) {
#pragma unroll
        for (int mi = 0; mi < kAScaleRows; ++mi)
#pragma unroll
          for (int half = 0; half < 2; ++half)
            a_out[mi][half] = a_scales.scales[a_scale_at[mi][half] + k_tile * static_cast<int32_t>(a_scales.k_stride)];
#pragma unroll
        for (int c = 0; c < kBScales; ++c)
          b_out[c] = b_scales.scales[b_scale_at[c] + k_tile * static_cast<int32_t>(b_scales.k_stride)];
      }
    };
    // acc = acc_in + sums * scales (acc_in and sums may be acc itself). Swapped: element
    // [0][j][2 h + e] is token 8 j + 2 (lane % 4) + e of weight row 16 warp + lane / 4 + 8 h.
    auto add_scaled = [&](float (&acc_in)[Cfg::kMmaM][Cfg::kMmaN][4], const float (&sums)[Cfg::kMmaM][Cfg::kMmaN][4],
                          const RowScales& a_scale, const ColumnScales& b_scale) {
      if constexpr (kSwapped) {
#pragma unroll
        for (int j = 0; j < Cfg::kMmaN; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q)
            acc[0][j][q] = acc_in[0][j][q] + sums[0][j][q] * (a_scale[j][q % 2] * b_scale[q / 2]);
      } else {
#pragma unroll
        for (int mi = 0; mi < Cfg::kMmaM; ++mi)
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int ni = 0; ni < Cfg::kMmaN; ++ni)
#pragma unroll
              for (int j = 0; j < 2; ++j)
                acc[mi][ni][half * 2 + j] =
                    acc_in[mi][ni][half * 2 + j] +
                    sums[mi][ni][half * 2 + j] * (a_scale[mi][half] * b_scale[b_scale_of(ni, j)]);
      }
    };
    // fp8_block: the next round's K tiles' scales are loaded while this round's products are
    // formed (a round: the kRound K tiles of one wgmma wait).
    RowScales a_now[kRound], a_next[kRound];
    ColumnScales b_now[kRound], b_next[kRound];
    // `first_k_tile` this round's first K tile, `tiles_after` the K tiles after the round.
    auto next_scales = [&](int first_k_tile, int tiles_after) {
      if constexpr (kPerKTile && !kScalesInRing) {
#pragma unroll
        for (int r = 0; r < kRound; ++r) {
#pragma unroll
          for (int mi = 0; mi < kAScaleRows; ++mi)
            a_now[r][mi][0] = a_next[r][mi][0], a_now[r][mi][1] = a_next[r][mi][1];
#pragma unroll
          for (int c = 0; c < kBScales; ++c) b_now[r][c] = b_next[r][c];
          if (r < tiles_after) load_scales(first_k_tile + kRound + r, a_next[r], b_next[r]);
        }
      }
    };
    // Round r's K tile's sums into acc (its scales from its stage, `stage`, if they travel with it).
    auto promote_stage = [&](int r, [[maybe_unused]] int stage) {
      if constexpr (kScalesInRing) {
        const float* scales = ring_scales + stage * Cfg::kStageScales;
#pragma unroll
        for (int mi = 0; mi < kAScaleRows; ++mi)
#pragma unroll
          for (int half = 0; half < 2; ++half) a_now[r][mi][half] = scales[a_scale_at[mi][half]];
#pragma unroll
        for (int c = 0; c < kBScales; ++c) b_now[r][c] = scales[b_scale_at[c]];
      }
      if constexpr (kPerKTile) add_scaled(acc, stage_acc[r], a_now[r], b_now[r]);
    };
    // Where the tensor cores accumulate round r's K tile (the one m16 row block of a wgmma
    // warp): its own sums (fp8_block), or straight into acc.
    auto round_sums = [&](int r) -> float(&)[Cfg::kMmaN][4] {
      if constexpr (kPerKTile) {
        return stage_acc[r][0];
      } else {
        return acc[0];
      }
    };

    // Split K (blockIdx.z of gridDim.z): this CTA sums K tiles [first_k_tile, + k_tiles).
    const auto [first_k_tile, k_tiles] =
        split_k_tiles(K, Op::kDepth, static_cast<int>(blockIdx.z), static_cast<int>(gridDim.z));
    // GEMM2 with the hand-over: the ring's first weight stages stream in while the row tile's
    // intermediate is still being written (they join the first stage's copy group).
    const bool waits_for_columns = !kGated && hands_over;
    if (waits_for_columns) {
      for (int s = 0; s < min(Cfg::kStages - 1, k_tiles); ++s)
        load_stage(s, static_cast<int64_t>(first_k_tile + s) * Op::kDepth, /*copy_a=*/false);
      if (threadIdx.x == 0) wait_for_columns(&groups.row_tile_columns[tile], K);
      __syncthreads();
    }
    for (int s = 0; s < Cfg::kStages - 1; ++s) {
      if (s < k_tiles) {
        load_stage(s, static_cast<int64_t>(first_k_tile + s) * Op::kDepth, true, /*copy_b=*/!waits_for_columns);
      }
      asm volatile("cp.async.commit_group;\n");
    }
    if constexpr (kPerKTile && !kScalesInRing) {
#pragma unroll
      for (int r = 0; r < kRound; ++r)
        if (r < k_tiles) load_scales(first_k_tile + r, a_next[r], b_next[r]);
    }
    if constexpr (Cfg::kInstruction == Instruction::kMmaSync) {
      // Warp w takes k16 step w of every stage over all the tile's columns: kTileMmaN
      // independent mma a stage, where a warp over its own 16 columns would chain its two
      // sums through all kStepsPerStage steps (-1.5 to -3.3% at T=1, docs/KERNELS.md,
      // thirteenth session). The warps' sums are added once after the loop (in a fixed order).
      static_assert(!kFp8, "e4m3 decode tiles use the swapped wgmma: bf16 sums go straight into acc");
      static_assert(Cfg::kMmaM == 1 && Cfg::kWarpsN == kStepsPerStage, "one warp per k16 step of a stage");
      constexpr int kTileMmaN = Cfg::kCols / 8;
      float partial[kTileMmaN][4] = {};
      for (int kt = 0; kt < k_tiles; ++kt) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(Cfg::kStages - 2));
        __syncthreads();
        const int next = kt + Cfg::kStages - 1;
        if (next < k_tiles) load_stage(next % Cfg::kStages, static_cast<int64_t>(first_k_tile + next) * Op::kDepth);
        asm volatile("cp.async.commit_group;\n");

        const uint8_t* a_tile = shared_tiles + (kt % Cfg::kStages) * Cfg::kStageBytes;
        const uint8_t* b_tile = a_tile + Cfg::kRows * kRowBytes;
        uint32_t a_frag[4];
        ldmatrix_x4(a_frag, a_tile + swizzled(lane % 16, warp * 2 + lane / 16));
#pragma unroll
        for (int np = 0; np < kTileMmaN / 2; ++np) {
          uint32_t b_frag[4];
          ldmatrix_x4(b_frag, b_tile + swizzled(np * 16 + lane % 8 + (lane / 16) * 8, warp * 2 + (lane / 8) % 2));
          mma_bf16(partial[2 * np], a_frag, b_frag[0], b_frag[1]);
          mma_bf16(partial[2 * np + 1], a_frag, b_frag[2], b_frag[3]);
        }
      }
      asm volatile("cp.async.wait_group 0;\n");
      __syncthreads();  // the ring is free: it carries the warps' sums, [warp][n8 tile][lane][4]
      auto* exchange = reinterpret_cast<float4*>(shared_tiles);
#pragma unroll
      for (int ni = 0; ni < kTileMmaN; ++ni)
        exchange[(warp * kTileMmaN + ni) * 32 + lane] =
            make_float4(partial[ni][0], partial[ni][1], partial[ni][2], partial[ni][3]);
      __syncthreads();
#pragma unroll
      for (int ni = 0; ni < Cfg::kMmaN; ++ni) {  // this warp's columns for the epilogue
#pragma unroll
        for (int from = 0; from < Cfg::kWarpsN; ++from) {
          const float4 sum = exchange[(from * kTileMmaN + warp_col / 8 + ni) * 32 + lane];
          acc[0][ni][0] += sum.x, acc[0][ni][1] += sum.y, acc[0][ni][2] += sum.z, acc[0][ni][3] += sum.w;
        }
      }
    } else {
      // Warpgroup g multiplies rows 64g..64g+63 of the A tile by the whole B tile. Sums in acc
      // (bf16, e4m3 with scales in the epilogue): one wgmma group stays in flight while the
      // next stage lands; fp8_block: the stage's sums are needed for the promotion, so each
      // group completes first, a round of kRound K tiles (each into sums of its own) at a
      // time. A stage is refilled only after every warpgroup's wgmma on it has completed
      // (wait_group, then the barrier).
      const int warpgroup = warp / 4;
      for (int kt = 0; kt < k_tiles; kt += kRound) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(Cfg::kStages - 1 - kRound));
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async data -> tensor cores
        __syncthreads();
        next_scales(first_k_tile + kt, k_tiles - kt - kRound);
        wgmma_fence();
        // (A round past the last K tile multiplies a stage it does not promote: every wgmma of
        // the loop stays unconditional.)
#pragma unroll
        for (int r = 0; r < kRound; ++r) {
          const uint8_t* a_tile = shared_tiles + ((kt + r) % Cfg::kStages) * Cfg::kStageBytes;
          const uint8_t* b_tile = a_tile + Cfg::kRows * kRowBytes;
          // Swapped: the weights are wgmma's A (m64), the tokens its B (n16).
          const uint64_t a_descriptor = wgmma_descriptor(kSwapped ? b_tile : a_tile + warpgroup * 64 * kRowBytes);
          const uint64_t b_descriptor = wgmma_descriptor(kSwapped ? a_tile : b_tile);
          // +32 bytes along K inside the swizzle atom; fp8_block starts a fresh sum
#pragma unroll
          for (int kk = 0; kk < kStepsPerStage; ++kk)
            wgmma_step<kSwapped ? Cfg::kRows : Cfg::kCols, kFp8>(round_sums(r), a_descriptor + 2 * kk,
                                                                 b_descriptor + 2 * kk, !kPerKTile || kk > 0);
        }
        wgmma_commit();
        if constexpr (kPerKTile) {
          wgmma_wait<0>();
#pragma unroll
          for (int r = 0; r < kRound; ++r)
            if (kt + r < k_tiles) promote_stage(r, (kt + r) % Cfg::kStages);
        } else {
          wgmma_wait<1>();
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < kRound; ++r) {
          const int next = kt + r + Cfg::kStages - 1;
          if (next < k_tiles) load_stage(next % Cfg::kStages, static_cast<int64_t>(first_k_tile + next) * Op::kDepth);
          asm volatile("cp.async.commit_group;\n");
        }
      }
      wgmma_wait<0>();
      asm volatile("cp.async.wait_group 0;\n");
    }
    if constexpr (kScales == Scales::kEpilogue) {  // acc = acc * scales, which do not change along K
      float zero[Cfg::kMmaM][Cfg::kMmaN][4] = {};
      load_scales(0, a_now[0], b_now[0]);
      add_scaled(zero, acc, a_now[0], b_now[0]);
    }

    if constexpr (kSwapped) {  // thread: tokens 8 j + 2 (lane % 4) + e, weight rows 16 warp + lane / 4 + 8 h
#pragma unroll
      for (int j = 0; j < Cfg::kMmaN; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int32_t slot = first_slot + j * 8 + (lane % 4) * 2 + e;
          if (slot >= group_end) continue;
          uint16_t* c_row = groups.c + static_cast<int64_t>(slot) * groups.c_stride;
          if constexpr (kGated) {  // weight rows h = 0 / 1 are gate / up of one output column
            const int64_t col = first_col + warp * 8 + lane / 4;
            if (col < out_cols)
              c_row[col] =
                  __bfloat16_as_ushort(__float2bfloat16_rn(activate(activation, acc[0][j][e]) * acc[0][j][2 + e]));
          } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int64_t col = first_col + warp * 16 + lane / 4 + h * 8;
              if (col >= out_cols) continue;
              if (groups.c_partial)
                groups.c_partial[blockIdx.z * groups.partial_stride + slot * groups.c_stride + col] =
                    acc[0][j][2 * h + e];
              else
                c_row[col] = __bfloat16_as_ushort(__float2bfloat16_rn(acc[0][j][2 * h + e]));
            }
          }
        }
    }
    // Epilogue: thread holds rows lane/4 and lane/4 + 8 of each m16 tile, two columns each.
#pragma unroll
    for (int mi = 0; mi < (kSwapped ? 0 : Cfg::kMmaM); ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row + mi * 16 + lane / 4 + half * 8;
        const int32_t slot = first_slot + row;
        if (row >= Cfg::kRows || slot >= group_end) continue;
        uint16_t* c_row = groups.c + static_cast<int64_t>(slot) * groups.c_stride;
#pragma unroll
        for (int ni = 0; ni < Cfg::kMmaN; ni += kGated ? 2 : 1) {
          const float* v = &acc[mi][ni][half * 2];
          if constexpr (kGated) {
            const float* up = &acc[mi][ni + 1][half * 2];
            const int64_t col = first_col + (warp_col + ni * 8) / 2 + (lane % 4) * 2;
            if (col < out_cols)
              store_pair(c_row + col, activate(activation, v[0]) * up[0], activate(activation, v[1]) * up[1]);
          } else {
            const int64_t col = first_col + warp_col + ni * 8 + (lane % 4) * 2;
            if (col >= out_cols) continue;
            if (groups.c_partial) {  // split K: f32 partial sums, added up by the combine
              float* partial = groups.c_partial + blockIdx.z * groups.partial_stride + slot * groups.c_stride + col;
              *reinterpret_cast<float2*>(partial) = make_float2(v[0], v[1]);
            } else {
              store_pair(c_row + col, v[0], v[1]);
            }
          }
        }
      }
    }
    if constexpr (kGated) {
      // The columns of the row tile this CTA completes for GEMM2: those it wrote, or with the
      // fused quantisation those it quantised.
      int completed = static_cast<int>(min(int64_t{Cfg::kCols / 2}, out_cols - first_col));
      if constexpr (kFp8) {
        static_assert(128 % (Cfg::kCols / 2) == 0 && Cfg::kCols / 2 <= 128,
                      "a group of 128 columns (GPU fp8_block) spans whole column tiles, and a tile fits in registers");
        if (groups.quantize.codes)
          completed = quantize_output(groups.quantize, layout.arrivals, groups.c, groups.c_stride, tile, first_slot,
                                      min(Cfg::kRows, group_end - first_slot), first_col, Cfg::kCols / 2, out_cols,
                                      threadIdx.x, Cfg::kThreads);
      }
      if (hands_over) {
        if (early) wait_for_predecessor();  // for the kernel before GEMM1 that zeroes the counters
        __syncthreads();
        if (threadIdx.x == 0 && completed > 0) hand_over_columns(&groups.row_tile_columns[tile], completed);
      }
    }
    if constexpr (kSelfRoutes) {
      __syncthreads();  // every thread is done with the ring before the next tile fills it
      routed += routed_lanes;
      tile = early_tiles + routed;
    }
  } while (self_routed && routed < decode_pairs().routed_tiles);
  if (!hands_over) publish();
}

template <typename Cfg, bool kGated, Scales kScales, bool kSelfRoutes = false>
cudaError_t launch_config(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles,
                          Activation activation, cudaStream_t stream) {
  auto* kernel = grouped_gemm_kernel<Cfg, kGated, kScales, kSelfRoutes>;
  static const cudaError_t attribute_error = [&] {
    const cudaError_t error =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Cfg::kSharedBytes));
    return error != cudaSuccess ? error : prefer_max_shared_memory(kernel);
  }();
  if (attribute_error != cudaSuccess) return attribute_error;
  const int64_t column_tiles = column_tile_count(column_extent(groups, kGated), Cfg::kCols, kGated);
  int64_t row_ctas = max_tiles;
  if constexpr (kSelfRoutes) {
    // Routed lanes (a CTA each per column tile) for the resident CTAs the early ones leave, at
    // least one, at most the routed row tiles there may be.
    const int64_t early = groups.early_shared_tiles;
    const int64_t resident = ctas_per_multiprocessor<Cfg>() * multiprocessor_count();
    row_ctas = early + std::clamp<int64_t>((resident - early * column_tiles) / column_tiles, 1, max_tiles - early);
  }
  const dim3 grid(static_cast<unsigned>(row_ctas), static_cast<unsigned>(column_tiles),
                  static_cast<unsigned>(groups.k_splits));
  // Routing for itself, bf16 GEMM1 is the call's first launch: it starts once its predecessor
  // has finished, as the route would have (e4m3: x's quantisation comes first).
  const bool first = kSelfRoutes && kScales == Scales::kNone;
  return launch_kernel(first ? Start::kAfterPredecessor : Start::kEarly, kernel, grid, dim3(Cfg::kThreads),
                       Cfg::kSharedBytes, stream, groups, layout, activation);
}

}  // namespace

int multiprocessor_count() {
  static const int count = [] {
    int device = 0, value = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return 132;  // only a tuning input: a failure here shows up at the first launch anyway
    return value;
  }();
  return count;
}

int choose_k_splits(int tile_rows, int64_t expected_row_tiles, int64_t n, int64_t k) {
  // A GEMM2 CTA's columns and how many of its CTAs an SM holds (shared memory: the decode and
  // medium rings take under half of it, the specialised ring nearly all). The specialised
  // tile counts as bf16's 256 columns; e4m3's 128 then make at most two waves.
  const int cols = tile_rows == DecodeConfig::kRows ? DecodeConfig::kCols
                   : tile_rows == MediumConfig::kRows ? MediumConfig::kCols : 256;
  const int per_sm = tile_rows == kSpecializedTileRows ? 1 : 2;
  static_assert(ctas_per_multiprocessor<MediumConfig>() >= 2 && ctas_per_multiprocessor<DecodeConfig>() >= 2);
  const int64_t ctas = std::max<int64_t>(1, expected_row_tiles) * ((n + cols - 1) / cols);
  const int64_t wave = int64_t{per_sm} * multiprocessor_count();
  const int64_t most = std::max<int64_t>(1, k / (4 * Operand<false>::kDepth));  // at least 4 bf16 K tiles per split
  return static_cast<int>(std::clamp<int64_t>(wave / ctas, 1, std::min<int64_t>(most, kMaxKSplits)));
}

int choose_decode_stages(bool fp8, int64_t likely_ctas) {
  if (!fp8) return likely_ctas <= multiprocessor_count() ? DecodeDeepConfig::kStages : DecodeConfig::kStages;
  return likely_ctas <= ctas_per_multiprocessor<DecodeFp8Config>() * multiprocessor_count()
             ? DecodeFp8Config::kStages
             : DecodeFp8ShallowConfig::kStages;
}

double expected_tiles_per_expert(int64_t tokens, double pick, int tile_rows) {
  if (tokens <= 0 || pick <= 0) return 0;
  if (pick >= 1) return static_cast<double>((tokens + tile_rows - 1) / tile_rows);
  // The sum over n within 12 standard deviations of the mean; the rest weighs under 1e-30.
  const double mean = static_cast<double>(tokens) * pick, deviation = std::sqrt(mean * (1 - pick));
  const int64_t low = std::max<int64_t>(1, static_cast<int64_t>(mean - 12 * deviation) - 1);
  const int64_t high = std::min<int64_t>(tokens, static_cast<int64_t>(mean + 12 * deviation) + 2);
  const double log_all = std::lgamma(static_cast<double>(tokens) + 1);
  double expected = 0;
  for (int64_t n = low; n <= high; ++n) {
    const double log_probability = log_all - std::lgamma(static_cast<double>(n) + 1) -
                                   std::lgamma(static_cast<double>(tokens - n) + 1) + n * std::log(pick) +
                                   (tokens - n) * std::log1p(-pick);
    expected += std::exp(log_probability) * static_cast<double>((n + tile_rows - 1) / tile_rows);
  }
  return expected;
}

bool routes_in_gemm1(const TilePlan& plan, int64_t tokens, int64_t top_k, int64_t routed_experts, int64_t out_cols,
                     QuantScheme scheme, bool router_weight_on_input) {
  const bool fp8 = is_fp8(scheme);
  if (router_weight_on_input || plan.tile_rows != kDecodeTileRows || plan.shared_tiles > 0 ||
      tokens * top_k > kMaxSelfRoutedPairs || routed_experts > kMaxSelfRoutedExperts)
    return false;
  // Measured against the route and the sort (ep=8, one H100, docs/KERNELS.md, nineteenth
  // session): e4m3 -3 to -18% at T = 1-4; bf16 -3 to -8% at T = 1-2 but +1.3 to +2.3% at
  // T = 4. Per channel and per tensor (H200, thirty-third session): -12 to -17% at T = 1,
  // deepseek-v3 -8% at T = 4, the qwen3 presets within -3.4 / +0.8% there. Up to 16 tokens
  // (a warp routing four in turn) lost 8-68% at T = 4-16, even with one token a warp at T = 4:
  // the larger routing code slowed the GEMM it sits in.
  if (tokens > (fp8 ? kMaxSelfRoutedTokens : kMaxSelfRoutedTokensBf16)) return false;
  // bf16 beside a shared expert's early CTAs: the route and the sort ahead of GEMM1 measured
  // faster on the H200 (deepseek-v3 T = 1 / 2 -3.8 / -2.8%; twenty-first session), where the
  // presets without one lost 6.0-8.5% at T = 1 (qwen3-30b-a3b, qwen3-235b-a22b). (On an H100
  // deepseek-v3 had gained 6.6%: the rule follows the H200, the card the targets are for.)
  if (!fp8 && plan.shared_main_tiles > 0) return false;
  // Every routed CTA routes before it knows its tiles: where the early CTAs and one routed lane
  // are more than the SMs hold at once, later waves pay the routing again (mixtral-8x7b bf16,
  // 448 column tiles against 264 resident CTAs: +0.8 / +1.6% at T = 1 / 2).
  const int64_t column_tiles = column_tile_count(out_cols, DecodeConfig::kCols, /*gated=*/true);
  int64_t per_multiprocessor = 0;
  switch (choose_decode_stages(fp8, plan.likely_tiles * column_tiles)) {
    case DecodeDeepConfig::kStages: per_multiprocessor = ctas_per_multiprocessor<DecodeDeepConfig>(); break;
    case DecodeConfig::kStages: per_multiprocessor = ctas_per_multiprocessor<DecodeConfig>(); break;
    case DecodeFp8Config::kStages: per_multiprocessor = ctas_per_multiprocessor<DecodeFp8Config>(); break;
    default: per_multiprocessor = ctas_per_multiprocessor<DecodeFp8ShallowConfig>(); break;
  }
  return (plan.shared_main_tiles + 1) * column_tiles <= per_multiprocessor * multiprocessor_count();
}

int choose_tile_rows(int64_t rows_per_group) {
  if (rows_per_group <= DecodeConfig::kRows) return DecodeConfig::kRows;
  // The warp-specialised 128-row tile overlaps its loads with the tensor cores where the
  // medium tile waits on each K tile, which outweighs its unused rows from 33 rows an
  // expert on (ep=8, one H200: 64 rows an expert, deepseek-v3 T=2048 -23% bf16 / -21%
  // fp8_block, qwen3-30b-a3b T=1024 -10% / -7%, mixtral-8x7b T=256 -9%), not at 32
  // (qwen3-30b-a3b T=512 +9% / +21%).
  if (rows_per_group <= kMediumMostRows) return MediumConfig::kRows;
  return kSpecializedTileRows;
}

TilePlan plan_tiles(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t local_experts,
                    int64_t shared_intermediate, int64_t hidden, int64_t intermediate) {
  TilePlan plan;
  const int64_t pairs = tokens * top_k;
  const bool shared = shared_intermediate > 0;
  // Routing spreads the T k pairs over all E experts: a local expert expects T k / E rows
  // (any number up to T k may come; the capacity below allows for all of them).
  plan.tile_rows = choose_tile_rows((pairs + num_experts - 1) / std::max<int64_t>(num_experts, 1));
  // The shared experts take all T rows: a taller tile of their own pays for a launch of
  // their own (which waits for the routed one) only when that launch fills the GPU twice
  // over by itself (GEMM1 CTAs, about 128 columns each); else they share the routed tiles.
  const int shared_rows = shared ? choose_tile_rows(tokens) : plan.tile_rows;
  const int64_t shared_ctas = (tokens + shared_rows - 1) / shared_rows * ((shared_intermediate + 127) / 128);
  const bool shared_in_main = shared && (shared_rows == plan.tile_rows || shared_ctas < 2 * multiprocessor_count());
  // Sharing the list, the shared group's rows (often half of them) want a taller tile than
  // a few routed rows an expert do: up to the medium tile (deepseek-v3 ep=8 fp8_block, T=256:
  // 588 us on 16-row tiles, 463 on 64-row ones; bf16 equal).
  if (shared_in_main) plan.tile_rows = std::max(plan.tile_rows, std::min(shared_rows, MediumConfig::kRows));
  plan.shared_main_tiles = shared_in_main ? (tokens + plan.tile_rows - 1) / plan.tile_rows : 0;
  plan.max_tiles = max_row_tiles(pairs, local_experts, plan.tile_rows) + plan.shared_main_tiles;
  if (shared && !shared_in_main) {
    plan.shared_tile_rows = shared_rows;
    plan.shared_tiles = (tokens + shared_rows - 1) / shared_rows;
  }
  const int64_t main_groups = local_experts + (shared_in_main ? 1 : 0);
  // Row tiles the main list expects: one per group that gets rows (at most the pairs), or the
  // local experts' share of the pairs (and the shared rows) in tiles of this height.
  const int64_t main_rows = pairs * local_experts / std::max<int64_t>(num_experts, 1) + (shared_in_main ? tokens : 0);
  // (The split keeps this ep=1 view: splitting by likely_tiles below measured -2.9 to +5.5%,
  // docs/KERNELS.md, eighth session.)
  const int64_t expected_row_tiles = std::max(std::min(pairs + (shared_in_main ? tokens : 0), main_groups),
                                              (main_rows + plan.tile_rows - 1) / plan.tile_rows);
  plan.k_splits = choose_k_splits(plan.tile_rows, expected_row_tiles, hidden, intermediate);
  // A token picks each expert with probability k / E (k distinct experts); the shared group,
  // when in the list, is shared_main_tiles.
  const double pick = static_cast<double>(top_k) / static_cast<double>(std::max<int64_t>(num_experts, 1));
  const double routed_tiles =
      static_cast<double>(local_experts) * expected_tiles_per_expert(tokens, pick, plan.tile_rows);
  plan.likely_tiles = std::max<int64_t>(1, std::llround(routed_tiles) + plan.shared_main_tiles);
  return plan;
}

cudaError_t launch_grouped_gemm(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles,
                                int64_t likely_tiles, bool gated, Activation activation, int tile_rows,
                                cudaStream_t stream) {
  if (max_tiles == 0) return cudaSuccess;
  const bool scales_along_k = groups.a_routed_scale.k_stride != 0 || groups.b_routed_scale.k_stride != 0;
  auto with_scales = [&]<typename Cfg, Scales kScales>() {
    if constexpr (Cfg::kRows == kDecodeTileRows) {
      if (groups.self_routing.enabled) {
        if (!gated) return cudaErrorInvalidValue;  // GEMM1 alone routes (routes_in_gemm1)
        return launch_config<Cfg, true, kScales, true>(groups, layout, max_tiles, activation, stream);
      }
    }
    if (groups.self_routing.enabled) return cudaErrorInvalidValue;  // on the decode tile only
    return gated ? launch_config<Cfg, true, kScales>(groups, layout, max_tiles, activation, stream)
                 : launch_config<Cfg, false, kScales>(groups, layout, max_tiles, activation, stream);
  };
  // bf16 configs, or e4m3 configs (the decode tile has an e4m3 config of its own).
  auto dispatch = [&]<typename Cfg, typename Fp8Cfg>() {
    if (!groups.fp8) return with_scales.template operator()<Cfg, Scales::kNone>();
    return scales_along_k ? with_scales.template operator()<Fp8Cfg, Scales::kPerKTile>()
                          : with_scales.template operator()<Fp8Cfg, Scales::kEpilogue>();
  };
  switch (tile_rows) {
    case DecodeConfig::kRows: {
      const int64_t likely_ctas =
          likely_tiles * column_tile_count(column_extent(groups, gated), DecodeConfig::kCols, gated) * groups.k_splits;
      switch (choose_decode_stages(groups.fp8, likely_ctas)) {  // bf16: deep or plain; e4m3: plain or shallow
        case DecodeDeepConfig::kStages: return dispatch.template operator()<DecodeDeepConfig, DecodeFp8Config>();
        case DecodeFp8ShallowConfig::kStages:
          return dispatch.template operator()<DecodeConfig, DecodeFp8ShallowConfig>();
        default: return dispatch.template operator()<DecodeConfig, DecodeFp8Config>();
      }
    }
    case MediumConfig::kRows: return dispatch.template operator()<MediumConfig, MediumConfig>();
    case kSpecializedTileRows:
      return launch_specialized_gemm(groups, layout, max_tiles, likely_tiles, gated, activation, stream);
    default: return cudaErrorInvalidValue;  // only the tile heights choose_tile_rows returns exist
  }
}

}  // namespace epmoe::cuda
