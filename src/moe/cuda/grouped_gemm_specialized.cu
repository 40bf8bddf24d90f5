// The grouped GEMM's 128-row tile, for the sizes where the tensor cores are the bound
// (hundreds of rows per expert and more): warp-specialised, after DeepGEMM's layout.
//
// Work: items (row tile of PairLayout, column tile), column tiles fastest: the items running
// at once share a few row tiles, so each A row tile is read from HBM about once (rows
// fastest re-read all of A once per column tile: 3.7 GB for GEMM1 of deepseek-v3 at 16k
// tokens). Persistent CTAs, as many as the GPU holds, walk the items the sort made; the
// ring and its barriers run on from item to item, so the producer fills the next item's
// stages while the consumers write this one's outputs (one CTA per possible item, most of
// them exiting at once, cost 2-7% of the fp8 layer at 16k tokens, and every item paid its
// ring's fill and its epilogue in series). The operands are grouped_gemm.cu's:
// A rows [*, K] gathered per slot (K-major), B_g = [N, K] K-major, f32 accumulation, the
// gated activation and GEMM1's fp8 quantisation fused into the epilogue.
// Threads: three warpgroups. The producer (warpgroup 0, few registers) fills a ring of
// stages: B by TMA (one 3-D tensor map over [experts, N, K], a tile as two boxes of Cols/2
// rows; gated: its gate rows and its up rows, so columns [0, Cols/2) of the B tile are gate
// and the rest up; bf16 row tiles run in clusters of two that share B, each CTA loading one
// box into both, pairs_row_tiles), A by cp.async (the rows are a gather of x, which TMA
// cannot do on sm_90), and, for fp8_block, the stage's A and B scales. Each stage has a
// "full" mbarrier (the B bytes as a transaction count, one cp.async arrival per producer
// thread) and an "empty" one (one arrival per consumer warp). The two consumers (warpgroups
// 1 and 2, rows 0-63 and 64-127, most registers) only wait and multiply: bf16, and e4m3 with
// scales that do not change along K (per channel, per tensor: applied in the epilogue), keep
// one wgmma group in flight and the sums in the tensor cores; fp8_block waits for each
// stage's sums and adds them to the accumulator times the stage's scales, and while one
// consumer does that the other's wgmma keeps the tensor cores busy.
// Tiles: 128 x 256, or 128 x 192 (bf16) or 128 x 128 for launches whose 256-wide items would
// leave many SMs idle in their last wave or (e4m3) run short K loops (specialized_tile_cols).
// bf16 m64n256k16, m64n192k16 or m64n128k16 per consumer; e4m3 m64n256k32 or m64n128k32,
// for fp8_block into a second accumulator for the per-stage sums, the wide tile's two B
// halves in turn (sums for 256 columns beside the accumulator would not fit the registers);
// 192 to 200 KiB of stages.
// GEMM1's fp8 quantisation stays in registers: a group of 128 output columns is the wide e4m3
// tile's, or the columns of two neighbouring narrow column tiles (64 each), which run as a
// cluster of two CTAs and send each other their rows' amax (st.async into the partner's shared
// memory); each then writes its own codes. No second pass over the output: the pass through L2 that
// quantize_output makes (the last CTA of a group re-reads it) took 16% of this kernel's
// samples (ncu, fp8_block GEMM1 at 16k tokens), the SM idle for the tensor cores meanwhile.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <limits>
#include <type_traits>
#include <utility>

#include "gemm_tiles.cuh"
#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

template <bool Fp8, int Cols>
struct SpecializedTile {
  static constexpr bool kFp8 = Fp8;
  static constexpr int kRows = 128;
  static constexpr int kCols = Cols;  // B rows per tile; gated: half gate, half up
  static constexpr int kProducerThreads = 128, kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // setmaxnreg: the producer gives registers to the consumers (their sum is what the
  // launch bounds allot: 384 threads x 168). The producer's 64 hold the item loop's state
  // beside a stage's addresses (at 56 fp8_block GEMM1 spilled 28 bytes an item).
  static constexpr int kProducerRegisters = 64, kConsumerRegisters = 216;
  static constexpr int kATileBytes = kRows * kRowBytes;
  static constexpr int kBTileBytes = kCols * kRowBytes;
  static constexpr int kStageBytes = kATileBytes + kBTileBytes;
  static constexpr int kStages = 200 * 1024 / kStageBytes;  // 128 wide: 6 stages, 192: 5, 256: 4
  static constexpr int kMmaN = kCols / 8;  // n8 blocks of a consumer's m64 x kCols accumulator
  static constexpr int kAChunks = kRows * kChunksPerRow / kProducerThreads;  // per producer thread and stage
  static_assert(kRows == kProducerThreads, "a producer thread stages one row's fp8 scale");
  // Each consumer warp's staging buffer for its bf16 outputs, 16 rows x 64 columns (below the
  // kernel).
  static constexpr int kStagingWarpBytes = 16 * 64 * 2;
};
using Fp8Tile = SpecializedTile<true, 256>;
using Fp8NarrowTile = SpecializedTile<true, 128>;
using Bf16Tile = SpecializedTile<false, 256>;
using Bf16MidTile = SpecializedTile<false, 192>;
using Bf16NarrowTile = SpecializedTile<false, 128>;

// What the partner CTA of a pair of column tiles sends, per work item: its rows' amax over
// its columns. Two buffers, by the parity of the items exchanged so far: the partner may send
// the next item's while this CTA still reads these.
struct PairExchange {
  uint64_t landed;        // all 128 values of the item arrived (transaction bytes)
  uint32_t amax[2][128];  // per tile row, as magnitude_bits
};

// Output columns of a column tile (gated: half its B rows are gate, half up).
template <typename Tile, bool kGated>
inline constexpr int kSpecializedOutCols = kGated ? Tile::kCols / 2 : Tile::kCols;

// fp8_block scales live in slots of shared memory, as many as it leaves: the ring's stage
// `it` (counted over all of a CTA's items) has slot it % slots. Where an item's K tiles fit
// in the slots the stages still in the ring do not use, all its scales are copied before
// its first stage lands, so no stage waits for the latency of its 130 scattered 4-byte
// copies (10% of the e4m3 tile's time at 16k tokens); else each stage's with the stage.
inline constexpr size_t kSharedBudget = 227 * 1024 - 1024 - 512;  // - ring alignment, - static shared
// The kernels that write bf16 c stage it (write_tile_staged below): every bf16 kernel, the e4m3
// GEMM2s, and the e4m3 GEMM1s with epilogue scales (per channel, per tensor), which write bf16
// for a separate quantisation pass. fp8_block's GEMM1 writes codes: the narrow tile stages
// them too (its 64 output columns, 1 KB a warp; 48 scale slots are left, up front for K up
// to 42 tiles: every preset's GEMM1 but deepseek-v3's, 56, which takes the narrow tile only
// where the wide one's last round would be short), the wide tile's scale slots keep the whole
// shared memory left (deepseek-v3's 56 K tiles need 60 of its 63 to be copied up front).
template <typename Tile, bool kGated, Scales kScales>
inline constexpr int kWarpStagingBytes = !(kGated && kScales == Scales::kPerKTile) ? Tile::kStagingWarpBytes
                                         : Tile::kCols == 128 ? 16 * kSpecializedOutCols<Tile, kGated>
                                                              : 0;
template <typename Tile, bool kGated, Scales kScales>
inline constexpr int kStagingBytes = Tile::kConsumerThreads / 32 * kWarpStagingBytes<Tile, kGated, kScales>;
template <typename Tile, bool kGated, Scales kScales>
__host__ __device__ constexpr int scale_slots() {
  constexpr int kStaging = kStagingBytes<Tile, kGated, kScales>;
  if (!Tile::kFp8) return 1;
  const size_t left = kSharedBudget - size_t{Tile::kStages} * Tile::kStageBytes - 2 * Tile::kStages * sizeof(uint64_t) -
                      sizeof(PairExchange) - (kStaging > 0 ? kStaging + 16 : 0);
  return static_cast<int>(left / ((Tile::kRows + 2) * sizeof(float)));  // a slot: A's rows, B's two halves
}

// After the ring of stages: the mbarriers, the pair exchange and the fp8_block scale slots.
template <int kStages, int kScaleSlots>
struct StageControl {
  uint64_t full[kStages];   // B landed (transaction bytes) and every producer thread's cp.asyncs
  uint64_t empty[kStages];  // every consumer warp is done reading the stage
  PairExchange exchange;
  float a_scales[kScaleSlots][128];  // of the tile's rows, for a K tile
  float b_scales[kScaleSlots][2];    // of the tile's gate rows and up rows (one 128-block each)
};

// The staging buffers follow the control block, 16-byte aligned for stmatrix.
template <typename Tile, bool kGated, Scales kScales>
__host__ __device__ constexpr size_t staging_offset() {
  const size_t control_end = size_t{Tile::kStages} * Tile::kStageBytes +
                             sizeof(StageControl<Tile::kStages, scale_slots<Tile, kGated, kScales>()>);
  return kStagingBytes<Tile, kGated, kScales> == 0 ? control_end : (control_end + 15) / 16 * 16;
}
template <typename Tile, bool kGated, Scales kScales>
constexpr size_t specialized_shared_bytes() {
  return 1024 + staging_offset<Tile, kGated, kScales>() + kStagingBytes<Tile, kGated, kScales>;
}
// Both GEMMs' kernels of a tile fit, fp8_block's with a scale slot for each stage at least.
template <typename Tile, Scales kScales>
constexpr bool fits() {
  return specialized_shared_bytes<Tile, true, kScales>() <= kSharedBudget + 1024 &&
         specialized_shared_bytes<Tile, false, kScales>() <= kSharedBudget + 1024 &&
         (kScales != Scales::kPerKTile ||
          (scale_slots<Tile, true, kScales>() >= Tile::kStages && scale_slots<Tile, false, kScales>() >= Tile::kStages));
}
static_assert(fits<Fp8Tile, Scales::kPerKTile>() && fits<Fp8NarrowTile, Scales::kPerKTile>() &&
              fits<Fp8Tile, Scales::kEpilogue>() && fits<Fp8NarrowTile, Scales::kEpilogue>() &&
              fits<Bf16Tile, Scales::kNone>() && fits<Bf16MidTile, Scales::kNone>() &&
              fits<Bf16NarrowTile, Scales::kNone>());
// One CTA an SM, whatever the width (specialized_tile_cols counts waves of one CTA an SM).
static_assert(2 * specialized_shared_bytes<Bf16NarrowTile, false, Scales::kNone>() > kSharedBudget);

__device__ inline void barrier_init(uint64_t* barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(count));
}
__device__ inline void barrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}
__device__ inline void barrier_expect_bytes(uint64_t* barrier, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}
// Arrives on the barrier once this thread's cp.asyncs so far have landed; counts as one of
// the arrivals the barrier was initialised with.
__device__ inline void barrier_arrive_after_copies(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}
// Waits for the completion of the barrier's phase of this parity.
__device__ inline void barrier_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred complete;\nmbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        "selp.u32 %0, 1, 0, complete;\n}\n"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
  } while (!done);
}

// TMA: the box at (k, row, expert) of a 3-D tensor map into shared memory, completing
// `bytes` on the barrier.
__device__ inline void load_box(uint8_t* destination, const CUtensorMap& map, int k, int row, int expert,
                                uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          shared_address(destination)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(k), "r"(row), "r"(expert), "r"(shared_address(barrier))
      : "memory");
}

// The cluster barrier (pairs of column tiles): arrive once, wait later.
__device__ inline void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ inline void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }
// Every thread of both CTAs: at the start, so that each one's barriers are set up before the
// partner reaches them; at the end of a row pair, so that neither exits while the other may
// still arrive on its barriers.
__device__ inline void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// The address of `local`'s copy in the partner CTA (the other CTA of a cluster of two).
__device__ inline uint32_t partner_address(const void* local) {
  uint32_t partner, remote;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(partner));
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(shared_address(local)), "r"(partner ^ 1));
  return remote;
}

// Writes `value` to the partner CTA's copy of `slot`, completing 4 bytes on its copy of
// `barrier`.
__device__ inline void send_to_partner(uint32_t* slot, uint64_t* barrier, uint32_t value) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];\n" ::"r"(
                   partner_address(slot)),
               "r"(value), "r"(partner_address(barrier))
               : "memory");
}

// Arrives on the partner CTA's copy of `barrier`. Release at CTA scope, as a local arrival:
// it only orders this warp's reads of the stage (waited for already); at cluster scope each
// arrival was a MEMBAR.ALL.GPU, a stall of every consumer warp each K tile (+12 to +58%).
__device__ inline void barrier_arrive_partner(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(partner_address(barrier)) : "memory");
}

// TMA multicast: the box at (k, row, expert) into `destination` of both CTAs of the cluster,
// completing `bytes` on each one's copy of `barrier`.
__device__ inline void load_box_to_pair(uint8_t* destination, const CUtensorMap& map, int k, int row, int expert,
                                        uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(shared_address(destination)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(k), "r"(row), "r"(expert), "r"(shared_address(barrier)),
      "h"(static_cast<uint16_t>(0b11))
      : "memory");
}

// Whether GEMM1 quantises its e4m3 output per group of columns (fp8_block), and whether a
// group is two column tiles, which the grid then pairs into clusters of two (the narrow
// tile's 64 outputs; the wide tile's 128 are a group).
template <typename Tile, bool kGated>
__host__ __device__ bool quantizes_per_group(const GemmGroups& groups) {
  return Tile::kFp8 && kGated && groups.quantize.codes && groups.quantize.granularity == Fp8Granularity::kPerGroup;
}
template <typename Tile, bool kGated>
__host__ __device__ bool pairs_column_tiles(const GemmGroups& groups) {
  return quantizes_per_group<Tile, kGated>(groups) && kSpecializedOutCols<Tile, kGated> < groups.quantize.group;
}
// Whether the grid pairs row tiles into clusters of two (bf16): two row tiles of one expert
// need the same B tiles, so each CTA loads half of a B tile into both (TMA multicast) and B's
// reads from L2 halve, where the K loop of the 128 x 256 tile asks L2 for 48 KB a stage. The
// two walk their items in lockstep (a stage is refilled once both have read it), so every
// row tile of the list needs the same K loop. bf16 only: measured at ep=8, T=2048-16384, it
// took mixtral-8x7b 8-11% faster and deepseek-v3 2-6%, the qwen3 presets (short K) -3 to +1%;
// e4m3 lost 2-4% in most cases (its consumers wait on each stage's sums, and the lockstep
// adds the partner's waits to theirs).
template <typename Tile, bool kGated>
__host__ __device__ bool pairs_row_tiles(const GemmGroups& groups) {
  return !Tile::kFp8 && (groups.n_shared == 0 || (groups.n_shared == groups.n && groups.k_shared == groups.k));
}
// The work items of `tiles` row tiles over `columns` column tiles: one per (row tile, column
// tile), and with row pairs an odd column count's last cluster on an odd count's last tile
// has a CTA of no rows (the kernel's place_of). Never fewer for more tiles: the launch sizes
// the grid by max_tiles.
template <typename Count>
__host__ __device__ Count specialized_items(Count tiles, Count columns, bool row_pairs) {
  return row_pairs && tiles % 2 == 1 ? (tiles - 1) * columns + (columns + 1) / 2 * 2 : tiles * columns;
}
// Column tiles per row tile in the grid: over the wider group's output columns, an even
// count when they are paired.
template <typename Tile, bool kGated>
__host__ __device__ int64_t specialized_column_tiles(const GemmGroups& groups) {
  const int64_t tiles = column_tile_count(column_extent(groups, kGated), Tile::kCols, kGated);
  return pairs_column_tiles<Tile, kGated>(groups) ? (tiles + 1) / 2 * 2 : tiles;
}

// GEMM1's fused quantisation (EpilogueQuantize) from the registers: `outputs[j][2 h + e]`
// for j < kBlocks are this thread's bf16 outputs as written (tile row rows[h], column
// first_col + 8 j + 2 (lane % 4) + e), in the accumulator's registers the epilogue left
// them in. Per group of 128 columns a row's scale is that of its amax over this tile's
// columns and, where the partner of the pair has columns of the group (`exchange` not null),
// over the partner's, which it sends: the item's exchange is the barrier's phase of
// `parity`, armed by the thread with `arms` before it sends. Per tensor, the static scale.
// Codes and scales come out bit for bit as quantize_held's.
// The codes go out from the fragments, 2 bytes a lane on 8 rows a store, or, with `staging`
// (the warp's kBlocks x 128 bytes; kStaged), through it: each lane puts its pairs of codes
// into the warp's 16 rows there, and the warp then stores whole 16-byte pieces, four times
// fewer stores, each of whole 32-byte sectors (as write_tile_staged does for bf16). The
// pieces are swizzled by the row, so that neither side has bank conflicts: rows lie two to a
// 128-byte bank line at 64 bytes, and rows 2 apart would share banks unswizzled.
template <int kBlocks, bool kStaged, int kAccBlocks>
__device__ void quantize_outputs(const EpilogueQuantize& q, const float (&outputs)[kAccBlocks][4], const int (&rows)[2],
                                 int32_t first_slot, int32_t group_end, int64_t first_col, int64_t out_cols,
                                 int64_t stride, int lane, PairExchange* exchange, uint32_t parity, bool arms,
                                 uint8_t* staging) {
  static_assert(kBlocks <= kAccBlocks);
  const bool per_group = q.granularity == Fp8Granularity::kPerGroup;
  uint32_t amax[2] = {0, 0};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int j = 0; j < kBlocks; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (first_col + j * 8 + (lane % 4) * 2 + e < out_cols) amax[h] = max(amax[h], magnitude_bits(outputs[j][2 * h + e]));
    // The row's other columns in this tile are in the lanes of the same lane / 4.
    amax[h] = max(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 1));
    amax[h] = max(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], 2));
  }
  if (exchange) {
    if (arms) barrier_expect_bytes(&exchange->landed, sizeof(exchange->amax[0]));
    if (lane % 4 == 0)
      for (int h = 0; h < 2; ++h) send_to_partner(&exchange->amax[parity][rows[h]], &exchange->landed, amax[h]);
    barrier_wait(&exchange->landed, parity);
    for (int h = 0; h < 2; ++h) amax[h] = max(amax[h], exchange->amax[parity][rows[h]]);
  }
  // Staged: rows of kRowBytes in the buffer, piece p of row r at (p ^ r / 2 % kPieces) x 16;
  // only where every piece is whole and aligned in the codes (fp8 sizes are multiples of 16,
  // and the workspace is 256-byte aligned: every call of the operator).
  constexpr int kRowBytes = kBlocks * 8, kPieces = kRowBytes / 16;
  static_assert(!kStaged || (kRowBytes == 64 && kBlocks % 2 == 0), "staged: 64 codes a row, rows two a bank line");
  const bool staged =
      kStaged && stride % 16 == 0 && out_cols % 16 == 0 && reinterpret_cast<uintptr_t>(q.codes) % 16 == 0;
  auto staged_piece = [&](int row, int piece) { return staging + row * kRowBytes + (piece ^ row / 2 % kPieces) * 16; };
  if (staged) __syncwarp();  // the warp's reads of the last item's pieces are done
  // The codes, by the row's scale (the type picked once: per group the amax's, else static).
  auto write_scale = [&](int32_t slot, float scale) {
    if (per_group && lane % 4 == 0 && first_col % q.group == 0)
      q.scales[slot * ((stride + q.group - 1) / q.group) + first_col / q.group] = scale;
  };
  auto write = [&](int h, const auto& scale) {
    const int32_t slot = first_slot + rows[h];
    if constexpr (kStaged) {
      if (staged) {
        const int row = 8 * h + lane / 4;  // of the warp's 16
#pragma unroll
        for (int j = 0; j < kBlocks; ++j)
          *reinterpret_cast<uint16_t*>(staged_piece(row, j / 2) + j % 2 * 8 + lane % 4 * 2) =
              encode_e4m3x2(outputs[j][2 * h], outputs[j][2 * h + 1], scale);
        if (slot < group_end) write_scale(slot, scale.scale);
        return;
      }
    }
    // From the fragments, a cvt a code: encode_e4m3x2 here made the wide GEMM1 with epilogue
    // scales spill 68 / 220 bytes where it spills 44 / 124.
    if (slot >= group_end) return;
    uint8_t* codes = q.codes + static_cast<int64_t>(slot) * stride;
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) {
      const int64_t col = first_col + j * 8 + (lane % 4) * 2;
      if (col >= out_cols) continue;
      *reinterpret_cast<uint16_t*>(codes + col) =
          static_cast<uint16_t>(encode_e4m3(outputs[j][2 * h], scale) | encode_e4m3(outputs[j][2 * h + 1], scale) << 8);
    }
    write_scale(slot, scale.scale);
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (per_group)
      write(h, AmaxScale(amax[h]));
    else
      write(h, StaticScale{*q.static_scale});
  }
  if (!kStaged || !staged) return;
  __syncwarp();
  const int32_t warp_first_slot = first_slot + rows[0] - lane / 4;
#pragma unroll
  for (int i = 0; i < 16 * kPieces / 32; ++i) {
    const int index = i * 32 + lane, row = index / kPieces, piece = index % kPieces;
    const int32_t slot = warp_first_slot + row;
    const int64_t col = first_col + piece * 16;
    const uint4 codes = *reinterpret_cast<const uint4*>(staged_piece(row, piece));
    if (slot < group_end && col < out_cols)
      *reinterpret_cast<uint4*>(q.codes + static_cast<int64_t>(slot) * stride + col) = codes;
  }
}

// Four 8 x 8 bf16 matrices from a warp's mma fragments into shared memory: lanes 8 i to
// 8 i + 7 give the row addresses of matrix i, whose fragment is each lane's piece i.
__device__ inline void stmatrix_x4(uint8_t* address, const uint32_t (&pieces)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_address(address)),
               "r"(pieces[0]), "r"(pieces[1]), "r"(pieces[2]), "r"(pieces[3])
               : "memory");
}

// The consumers' and the producer's own barriers (0 is __syncthreads).
__device__ inline void consumers_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(256) : "memory"); }
__device__ inline void producers_sync() { asm volatile("bar.sync 2, %0;\n" ::"n"(128) : "memory"); }

template <typename Tile, bool kGated, Scales kScales>
__global__ void __launch_bounds__(Tile::kThreads, 1)
    specialized_gemm_kernel(const __grid_constant__ CUtensorMap b_routed_map,
                            const __grid_constant__ CUtensorMap b_shared_map, GemmGroups groups, PairLayout layout,
                            Activation activation) {
  constexpr bool kFp8 = Tile::kFp8;
  using Op = Operand<kFp8>;
  constexpr int kStages = Tile::kStages;
  constexpr bool kPerKTile = kScales == Scales::kPerKTile;
  extern __shared__ __align__(128) uint8_t shared_raw[];
  uint8_t* ring = aligned_tiles(shared_raw);
  constexpr int kScaleSlots = scale_slots<Tile, kGated, kScales>();
  auto& control = *reinterpret_cast<StageControl<kStages, kScaleSlots>*>(ring + kStages * Tile::kStageBytes);
  [[maybe_unused]] uint8_t* const staging_base = ring + staging_offset<Tile, kGated, kScales>();
  int32_t* const row_tile_columns = groups.row_tile_columns;
  if (row_tile_columns == nullptr) {
    allow_successor();
    wait_for_predecessor();
  } else if (kGated) {
    // GEMM2 starts once every CTA here is past the wait: the sort, which wrote the layout
    // GEMM2 reads too, has finished; GEMM2 then waits for rows, not for this grid.
    wait_for_predecessor();
    allow_successor();
  } else {
    allow_successor();
  }
  constexpr int64_t cols_per_tile = kSpecializedOutCols<Tile, kGated>;
  const int64_t column_tiles = specialized_column_tiles<Tile, kGated>(groups);
  const bool column_pairs = pairs_column_tiles<Tile, kGated>(groups);
  const bool row_pairs = pairs_row_tiles<Tile, kGated>(groups);
  // The work items (row tile, column tile), columns fastest, for the row tiles the sort
  // made. This CTA takes every gridDim.x-th. A cluster of two takes every (gridDim.x / 2)-th
  // pair of items, its CTAs one each: two neighbouring column tiles (column_pairs), or row
  // tiles 2 r and 2 r + 1 at one column tile (row_pairs: items 2 c and 2 c + 1 are the pair
  // c of the list of (row tile pair, column tile); an odd count's last row tile, which has
  // no partner to share B with, is taken two neighbouring column tiles a cluster, each CTA
  // loading its own B: paired with a tile of no rows, one SM of the two idled on half its
  // items).
  // (int: the launch keeps max_tiles x column_tiles within it. In shared memory, read in each
  // loop's test: held in a register, the wide e4m3 consumer spilled it.)
  __shared__ int items, tiles_made;
  const int first_item = static_cast<int>(blockIdx.x), item_stride = static_cast<int>(gridDim.x);
  const int rank = static_cast<int>(blockIdx.x % 2);  // in the cluster, where there is one
  // Split K (GEMM2 where its CTAs would not fill the GPU): split blockIdx.y of gridDim.y sums
  // the K tiles [first_k_tile, + k_tiles) of every item; GEMM1 never splits.
  // An item's place: its row tile, its first output column, and the columns there are.
  // The B tile's two halves (kCols / 2 rows each; gated: the gate rows, the up rows) each lie
  // in one 128-row block of fp8_block weight scales: b_rows are their first weight rows.
  // b_to_pair: the row pair's tiles share B (one expert's), so each CTA loads one half for both.
  struct Place {
    RowTile tile;
    int tile_index;  // in the list; -1: a CTA of no rows (an odd column count's last cluster)
    int64_t out_cols, column_tile, first_col, b_rows[2];
    int first_k_tile, k_tiles;
    bool b_to_pair;
  };
  // e4m3 where a round of the grid covers fewer than two row tiles in list order (mixtral-8x7b:
  // 112 column tiles of GEMM1 for 132 CTAs), so that each row tile would stream the expert's
  // weights from DRAM again: the units (with column pairs, a cluster's pair of items, of
  // neighbouring column tiles) run group by group as in the list, but within a group column
  // unit by column unit, the group's row tiles fastest, so that they read each B tile at about
  // the same time and L2 serves all but the first. Elsewhere list order, which completes row
  // tiles one after another for GEMM2's hand-over (the group order everywhere made
  // qwen3-30b-a3b fp8_block 2-4% slower).
  const int unit_columns = static_cast<int>(column_pairs ? column_tiles / 2 : column_tiles);
  const bool group_order = kFp8 && 2 * unit_columns > item_stride / (column_pairs ? 2 : 1);
  auto place_of = [&](int item) {
    const int columns = static_cast<int>(column_tiles);
    const int pair_row = item / 2 / columns;
    const bool lone = row_pairs && 2 * pair_row + 1 == tiles_made;  // the odd count's last tile
    int tile = row_pairs ? pair_row * 2 + item % 2 : item / columns;
    int column_tile = (row_pairs ? item / 2 : item) % columns;
    bool no_rows = false;
    if (group_order) {  // (e4m3: no row pairs)
      const int unit = column_pairs ? item / 2 : item;
      const int lead = unit / unit_columns;  // a tile of the unit's group, in list order
      const int unit_group = layout.tile_group[lead];
      const int group_first_tile = lead - (layout.tile_row[lead] - layout.group_offsets[unit_group]) / Tile::kRows;
      const int group_tiles = (layout.group_counts[unit_group] + Tile::kRows - 1) / Tile::kRows;
      const int in_group = unit - group_first_tile * unit_columns;
      tile = group_first_tile + in_group % group_tiles;
      column_tile = column_pairs ? 2 * (in_group / group_tiles) + item % 2 : in_group / group_tiles;
    } else if (lone) {
      tile = 2 * pair_row;
      column_tile = 2 * (item / 2 - pair_row * columns) + item % 2;
      // An odd column count's last cluster has one column tile for two CTAs: the second runs
      // the K loop beside the first (the pair's stages are refilled in lockstep) and writes nothing.
      no_rows = column_tile == columns;
      if (no_rows) column_tile = columns - 1;
    }
    Place p{row_tile(groups, layout, tile)};
    if (no_rows) p.tile.group_end = p.tile.first_slot;
    p.tile_index = no_rows ? -1 : tile;
    p.b_to_pair = row_pairs && !lone && layout.tile_group[tile ^ 1] == p.tile.group;
    p.out_cols = kGated ? p.tile.n / 2 : p.tile.n;
    p.column_tile = column_tile;
    p.first_col = p.column_tile * cols_per_tile;
    p.b_rows[0] = p.first_col;
    p.b_rows[1] = kGated ? p.out_cols + p.first_col : p.first_col + Tile::kCols / 2;
    const KTileRange range =
        kGated ? KTileRange{0, static_cast<int>((p.tile.k + Op::kDepth - 1) / Op::kDepth)}
               : split_k_tiles(p.tile.k, Op::kDepth, static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y));
    p.first_k_tile = range.first;
    p.k_tiles = range.count;
    return p;
  };
  // fp8_block: the scales of the ring's stage `it` (counted over all items) are in slot it %
  // kScaleSlots. An item's scales are all copied before its first stage lands where the
  // slots hold them without overwriting those of the stages still in the ring, else each
  // stage's with the stage.
  auto scales_up_front = [](int k_tiles) { return k_tiles <= kScaleSlots - kStages; };

  if (threadIdx.x == 0) {
    tiles_made = *layout.tile_count;
    items = specialized_items(tiles_made, static_cast<int>(column_tiles), row_pairs);
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&control.full[s], Tile::kProducerThreads + 1);  // + the arrival that sets the B bytes
      // every consumer warp, and with row pairs the partner's (its producer writes here too)
      barrier_init(&control.empty[s], Tile::kConsumerThreads / 32 * (row_pairs ? 2 : 1));
    }
    barrier_init(&control.exchange.landed, 1);  // armed per item by the first consumer thread
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to TMA and the partner
  }
  __syncthreads();
  if (column_pairs || row_pairs) cluster_sync();

  if (threadIdx.x < Tile::kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Tile::kProducerRegisters));
    const int thread = threadIdx.x, chunk = thread % kChunksPerRow;
    uint32_t it = 0;  // stages filled so far
    for (int item = first_item; item < items; item += item_stride) {
      const Place p = place_of(item);
      if (p.first_col >= p.out_cols) continue;  // (the consumers skip it too)
      const RowTile& this_tile = p.tile;
      if (!kGated && row_tile_columns != nullptr) {  // GEMM1's columns of these rows (K of this GEMM)
        if (thread == 0 && p.tile_index >= 0) wait_for_columns(&row_tile_columns[p.tile_index], this_tile.k);
        producers_sync();
      }
      const auto* A = static_cast<const uint8_t*>(this_tile.shared ? groups.a_shared : groups.a_routed);
      // This thread's A chunks: column chunk `chunk` of rows thread / 8 + 16 i, from the split's
      // first K tile on (so that the loop below steps the pointers by a constant: the address
      // recomputed from the split's K tile per stage made bf16 GEMM2 5% slower).
      const int64_t first_k = int64_t{p.first_k_tile} * Op::kDepth;
      const uint8_t* a_source[Tile::kAChunks];
#pragma unroll
      for (int i = 0; i < Tile::kAChunks; ++i) {
        const int64_t row = a_row_of(groups, this_tile, thread / kChunksPerRow + i * (Tile::kProducerThreads / kChunksPerRow));
        a_source[i] = row >= 0 ? A + (row * groups.a_stride + first_k) * Op::kBytes + chunk * 16 : nullptr;
      }
      const int64_t(&b_rows)[2] = p.b_rows;
      const int group = this_tile.group;
      // fp8_block: K tile first_k_tile + kt's scale of this thread's row, and of weight half
      // `half`, into scale slot `slot` (that of the K tile's stage).
      const ScaleGrid& a_scales = this_tile.shared ? groups.a_shared_scale : groups.a_routed_scale;
      const ScaleGrid& b_scales = this_tile.shared ? groups.b_shared_scale : groups.b_routed_scale;
      [[maybe_unused]] const float* a_scale_source = nullptr;
      [[maybe_unused]] const float* b_scale_source[2] = {nullptr, nullptr};
      if constexpr (kPerKTile) {
        a_scale_source = a_scales.scales + scale_index(a_scales, max(a_row_of(groups, this_tile, thread), int64_t{0}), group) +
                         p.first_k_tile * a_scales.k_stride;
        for (int half = 0; half < 2; ++half) {
          const int64_t b_row = min(b_rows[half], this_tile.n - 1);  // (a half past the weights writes nothing)
          b_scale_source[half] = b_scales.scales + scale_index(b_scales, b_row, this_tile.shared ? 0 : group) +
                                 p.first_k_tile * b_scales.k_stride;
        }
      }
      auto copy_a_scale = [&](int kt, uint32_t slot) {
        copy_scale_async(&control.a_scales[slot][thread], a_scale_source + kt * a_scales.k_stride);
      };
      // (the source by a select, not an index: a runtime index puts the array in local memory.)
      auto copy_b_scale = [&](int kt, int half, uint32_t slot) {
        copy_scale_async(&control.b_scales[slot][half],
                         (half == 0 ? b_scale_source[0] : b_scale_source[1]) + kt * b_scales.k_stride);
      };
      const bool up_front = scales_up_front(p.k_tiles);
      if (kPerKTile && up_front) {  // K tile kt's stage will be it + kt
        for (int kt = 0; kt < p.k_tiles; ++kt) copy_a_scale(kt, (it + kt) % kScaleSlots);
        for (int i = thread; i < 2 * p.k_tiles; i += Tile::kProducerThreads)
          copy_b_scale(i / 2, i % 2, (it + i / 2) % kScaleSlots);
      }
      const CUtensorMap& b_map = this_tile.shared ? b_shared_map : b_routed_map;
      const int expert = this_tile.shared ? 0 : group;
      for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        if (it >= kStages) barrier_wait(&control.empty[s], (it / kStages - 1) & 1);
        uint8_t* a_tile = ring + s * Tile::kStageBytes;
        uint8_t* b_tile = a_tile + Tile::kATileBytes;
        const int k0 = kt * Op::kDepth;  // from the split's first K tile
        if (thread == 0) {  // B's two halves, or this CTA's half into both CTAs of a pair sharing B
          barrier_expect_bytes(&control.full[s], Tile::kBTileBytes);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            uint8_t* destination = b_tile + half * (Tile::kCols / 2) * kRowBytes;
            const int box_k = static_cast<int>(first_k) + k0, box_row = static_cast<int>(b_rows[half]);
            if (!p.b_to_pair)
              load_box(destination, b_map, box_k, box_row, expert, &control.full[s]);
            else if (half == rank)
              load_box_to_pair(destination, b_map, box_k, box_row, expert, &control.full[s]);
          }
        }
        const bool k_valid = first_k + k0 + chunk * (16 / Op::kBytes) < this_tile.k;
#pragma unroll
        for (int i = 0; i < Tile::kAChunks; ++i) {
          const int row = thread / kChunksPerRow + i * (Tile::kProducerThreads / kChunksPerRow);
          const bool valid = a_source[i] && k_valid;
          copy_async(a_tile + swizzled(row, chunk), valid ? a_source[i] + static_cast<int64_t>(k0) * Op::kBytes : A,
                     valid);
        }
        if (kPerKTile && !up_front) {  // with this stage, it
          copy_a_scale(kt, it % kScaleSlots);
          if (thread < 2) copy_b_scale(kt, thread, it % kScaleSlots);
        }
        barrier_arrive_after_copies(&control.full[s]);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (row_pairs) cluster_sync();
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Tile::kConsumerRegisters));
  const int thread = threadIdx.x - Tile::kProducerThreads;  // among the consumers
  const int consumer = thread / 128, lane = thread % 32;
  // This thread's accumulator rows in the tile (m64 fragment order: rows[h] for q / 2 = h).
  const int first_row = consumer * 64 + (thread / 32) % 4 * 16 + lane / 4;
  const int rows[2] = {first_row, first_row + 8};
  // The ring as the consumers walk it, stepped once a K tile: the stage, the parity of its
  // fills, the fp8_block scale slot (the producer's: stages so far % kScaleSlots), and the
  // stage of the K tile before. (Divisions by kStages and kScaleSlots a K tile and 64-bit
  // descriptor sums sat in the chain of instructions between a K tile's QGMMAs; stepping
  // them took the e4m3 loop from 142 to 134 SASS instructions, on the uniform datapath, and
  // fp8_block at 16k tokens 2.5-4.7% faster.)
  int stage = 0, slot = 0, previous_stage = kStages - 1;
  uint32_t phase = 0;
  auto step = [&] {
    previous_stage = stage;
    if (++stage == kStages) stage = 0, phase ^= 1;
    if (++slot == kScaleSlots) slot = 0;
  };
  // Stage 0's descriptors of this consumer's A rows and of the B tile.
  const uint32_t a_descriptor0 = wgmma_descriptor_low(ring + consumer * 64 * kRowBytes);
  const uint32_t b_descriptor0 = wgmma_descriptor_low(ring + Tile::kATileBytes);
  constexpr uint32_t kStageStep = Tile::kStageBytes >> 4;  // a stage further, in the address field's units
  uint32_t exchanges = 0;  // items whose amax went through the pair exchange
  // A stage read by this warp; with row pairs the partner's producer fills this CTA's copy
  // of the stage too, so it hears of it as well.
  auto release = [&](int released_stage) {
    barrier_arrive(&control.empty[released_stage]);
    if (row_pairs) barrier_arrive_partner(&control.empty[released_stage]);
  };
  for (int item = first_item; item < items; item += item_stride) {
    const Place p = place_of(item);
    if (p.first_col >= p.out_cols) continue;  // (a pair's partner sees that and neither waits for nor sends to this CTA)
    const auto& [group, first_slot, group_end, shared, N, K] = p.tile;
    const int64_t out_cols = p.out_cols, first_col = p.first_col;
    const int64_t(&b_rows)[2] = p.b_rows;
    const bool partner_has_columns = column_pairs && (p.column_tile ^ 1) * cols_per_tile < out_cols;
    float acc[Tile::kMmaN][4];
#pragma unroll
    for (int j = 0; j < Tile::kMmaN; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j][q] = 0.0f;
    // fp8_block: the tensor cores' sums of a K tile, n128 at a time (the wide tile's two B
    // halves in turn: sums for all 256 columns beside the accumulator would not fit the
    // registers), promoted into the accumulator times the K tile's scales. Scales that do not
    // change along K (per channel, per tensor) leave the sums in the tensor cores over the whole
    // K loop, as bf16 does (CUTLASS's FP8FastAccum, which vLLM's fp8 GEMMs use on sm90): the
    // layer -1 to -4% at T=4096-16384 against the promotion (ep=8, one H100, docs/KERNELS.md,
    // thirty-ninth session; the errors 1.2-1.45x larger, docs/OPERATOR.md).
    constexpr int kSumBlocks = kPerKTile ? 128 / 8 : 1, kSumRounds = Tile::kMmaN / kSumBlocks;
    float sums[kSumBlocks][4];
    // A consumer whose 64 rows lie past the group's (a last row tile's few rows, a row pair's
    // partner of no rows) multiplies nothing: it frees each stage once landed, so that the
    // tensor cores serve the other consumer alone. bf16 only: on e4m3 the test alone made
    // the wide tile's GEMM2 spill (24 to 64 bytes).
    const int multiplied = kFp8 || first_slot + consumer * 64 < group_end ? p.k_tiles : 0;
    for (int kt = 0; kt < multiplied; ++kt, step()) {
      barrier_wait(&control.full[stage], phase);
      const uint32_t a_descriptor = a_descriptor0 + stage * kStageStep;
      const uint32_t b_descriptor = b_descriptor0 + stage * kStageStep;
      wgmma_fence();
      if constexpr (kPerKTile) {
        float a_scale[2], b_scale[2];
#pragma unroll
        for (int round = 0; round < kSumRounds; ++round) {
          // B rows 128 round on: +16 KB, in the descriptor's 16-byte units.
          const uint32_t b_round = b_descriptor + round * (128 * kRowBytes >> 4);
          if (round > 0) wgmma_fence();
          wgmma_k_tile<128, true>(sums, a_descriptor, b_round, /*fresh=*/true);
          wgmma_commit();
          if (round == 0) {
            a_scale[0] = control.a_scales[slot][rows[0]], a_scale[1] = control.a_scales[slot][rows[1]];
            b_scale[0] = control.b_scales[slot][0], b_scale[1] = control.b_scales[slot][1];
          }
          wgmma_wait<0>();
          if (round == kSumRounds - 1 && lane == 0) release(stage);
          promote_round(acc, sums, round, a_scale, b_scale);
        }
      } else {
        wgmma_k_tile<Tile::kCols, kFp8>(acc, a_descriptor, b_descriptor, /*fresh=*/false);
        wgmma_commit();
        wgmma_wait<1>();  // the previous stage's group is done: release that stage
        if (kt > 0 && lane == 0) release(previous_stage);
      }
    }
    wgmma_wait<0>();
    if (!kPerKTile && multiplied > 0 && lane == 0) release(previous_stage);  // the item's last
    for (int kt = multiplied; kt < p.k_tiles; ++kt, step()) {
      barrier_wait(&control.full[stage], phase);
      if (lane == 0) release(stage);
    }

    // Epilogue (the producer already fills the ring for the next item): rows rows[h],
    // columns 8 j + 2 (lane % 4) + e of the B tile (gated: j < kMmaN / 2 gate, j + kMmaN / 2
    // the up of the same output column).
    const ScaleGrid& a_scales = shared ? groups.a_shared_scale : groups.a_routed_scale;
    const ScaleGrid& b_scales = shared ? groups.b_shared_scale : groups.b_routed_scale;
    constexpr int kOutBlocks = kGated ? Tile::kMmaN / 2 : Tile::kMmaN;
    // GEMM1 of an fp8 scheme: its bf16 outputs stay for quantize_outputs, in the gate
    // accumulators they were computed from (read once each, just before).
    constexpr bool kQuantizes = kGated && kFp8;
    // c, unless this GEMM quantises and the caller wants only the codes
    const bool stores_bf16 = !kQuantizes || !groups.quantize.codes || groups.quantize.bf16_copy;
    // bf16 c goes out through each warp's staging buffer (bf16 kernels, e4m3 GEMM2 with fp8_block
    // scales), up to 64 columns of its 16 rows at a time: stmatrix puts the fragments into
    // rows of 128 bytes (16-byte pieces swizzled by the row, so neither side has bank
    // conflicts), and each lane then stores 16 bytes, a warp whole 128-byte lines of four
    // rows. Stored from the fragments (write_tile), a warp's STG writes 4 bytes a lane on 8
    // rows; those stores took 7-13% of the bf16 layer at T >= 4096, the tensor cores idle
    // (timing without them, H100: docs/KERNELS.md, twenty-fourth session). A piece lies whole
    // in its row: H and I are multiples of 8 on the GPU and the workspace is 256-byte aligned
    // (check_gpu_limits).
    auto write_tile_staged = [&](uint16_t* out, auto activate_gate) {
      const int warp_row = consumer * 64 + (thread / 32) % 4 * 16;  // the warp's first row in the tile
      uint8_t* const staging = staging_base + thread / 32 * Tile::kStagingWarpBytes;
      auto piece_address = [&](int row, int piece) { return staging + row * 128 + (piece ^ row % 8) * 16; };
      static_assert(kOutBlocks % 2 == 0, "stmatrix takes n8 blocks in pairs");
#pragma unroll
      for (int chunk = 0; chunk < (kOutBlocks + 7) / 8; ++chunk) {
        const int blocks = min(8, kOutBlocks - chunk * 8);  // 16-byte pieces a row (4: the mid tile's last)
#pragma unroll
        for (int block = 0; block < blocks; block += 2) {
          uint32_t pieces[4];  // rows 0-7 and 8-15 of n8 block `block`, then of block + 1
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const int j = chunk * 8 + block + m / 2, h = m % 2;
            float value[2] = {acc[j][2 * h], acc[j][2 * h + 1]};
            if constexpr (kGated)
              for (int e = 0; e < 2; ++e) value[e] = activate_gate(value[e]) * acc[j + kOutBlocks][2 * h + e];
            pieces[m] = pack_bf16x2(value[0], value[1]);
          }
          stmatrix_x4(piece_address(lane % 8 + lane / 8 % 2 * 8, block + lane / 16), pieces);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < blocks / 2; ++i) {  // 16 rows x blocks pieces, 32 a round
          const int row = (i * 32 + lane) / blocks, piece = lane % blocks;
          const uint4 bits = *reinterpret_cast<const uint4*>(piece_address(row, piece));
          const int32_t slot = first_slot + warp_row + row;
          const int64_t col = first_col + chunk * 64 + piece * 8;
          if (slot < group_end && col < out_cols)
            *reinterpret_cast<uint4*>(out + static_cast<int64_t>(slot) * groups.c_stride + col) = bits;
        }
        __syncwarp();  // the buffer read before the next chunk's stmatrix
      }
    };
    // Writes the tile below `out`: bf16 c, or split K's f32 partial sums of this split. Chosen
    // once for the tile, with one row pointer per row, so each store is a predicated STG at a
    // constant offset, not an address computed per store behind a branch. The activation too
    // (gated), so that no element computes both and selects one.
    auto write_tile = [&](auto* out, auto activate_gate) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = rows[h];
        const int32_t slot = first_slot + row;
        if (slot >= group_end) continue;
        auto* const out_row = out + static_cast<int64_t>(slot) * groups.c_stride;
#pragma unroll
        for (int j = 0; j < kOutBlocks; ++j) {
          const int64_t col = first_col + j * 8 + (lane % 4) * 2;
          if (col >= out_cols) continue;
          float value[2] = {acc[j][2 * h], acc[j][2 * h + 1]};
          if constexpr (kGated)
            for (int e = 0; e < 2; ++e) value[e] = activate_gate(value[e]) * acc[j + kOutBlocks][2 * h + e];
          if constexpr (std::is_same_v<decltype(out), float*>)
            *reinterpret_cast<float2*>(out_row + col) = make_float2(value[0], value[1]);
          else if (stores_bf16)
            store_pair(out_row + col, value[0], value[1]);
          if constexpr (kQuantizes)
            for (int e = 0; e < 2; ++e) acc[j][2 * h + e] = __bfloat162float(__float2bfloat16_rn(value[e]));
        }
      }
    };
    // Per-channel and per-tensor scales (constant along K) times the accumulator, in place and
    // once, before either writer reads it: each weight row's scale is loaded once for both of
    // the thread's rows. (Applied per element in the writer, with a 64-bit division per index,
    // the epilogue took e4m3 GEMM2 of qwen3-30b-a3b fp8_channel at 16k tokens to 3.1x
    // fp8_block's time on an H100; docs/KERNELS.md, thirtieth session.) Every scale is loaded
    // before any product: a load beside its use, behind scale_index's branch, waited out L2's
    // latency 32 times a thread in turn (thirty-first session). Where block_n is 1 (per
    // channel, per tensor: weight_grid) a column's scale lies row_stride on from the side's
    // first, so no index takes scale_index's division path. Rows past the group and columns
    // past the output are never written: their scales are not read.
    auto scale_accumulator = [&] {
      float a_scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
        a_scale[h] = first_slot + rows[h] < group_end
                         ? a_scales.scales[scale_index(a_scales, a_row_of(groups, p.tile, rows[h]), group)]
                         : 0.0f;
      const int b_group = shared ? 0 : group;
      constexpr int kSides = kGated ? 2 : 1;  // gated: the gate rows, then the up rows
      // 32 scales in flight at a time: the narrow tile's all at once, the wide tile's in two
      // rounds of half its columns (all 64 beside its accumulator spilled 456 bytes on GEMM1).
      constexpr int kChunkBlocks = kOutBlocks < 16 / kSides ? kOutBlocks : 16 / kSides;
      int32_t first_index[kSides];  // where block_n is 1
#pragma unroll
      for (int side = 0; side < kSides; ++side) first_index[side] = scale_index(b_scales, b_rows[side], b_group);
#pragma unroll
      for (int chunk = 0; chunk < kOutBlocks; chunk += kChunkBlocks) {
        float b_scale[kSides][kChunkBlocks][2];
        auto load_b_scales = [&](auto index_of) {
#pragma unroll
          for (int side = 0; side < kSides; ++side)
#pragma unroll
            for (int j = 0; j < kChunkBlocks; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int column = (chunk + j) * 8 + (lane % 4) * 2 + e;  // in the tile
                b_scale[side][j][e] = first_col + column < out_cols ? b_scales.scales[index_of(side, column)] : 0.0f;
              }
        };
        if (b_scales.block_n == 1)
          load_b_scales([&](int side, int column) { return first_index[side] + column * b_scales.row_stride; });
        else
          load_b_scales([&](int side, int column) { return scale_index(b_scales, b_rows[side] + column, b_group); });
#pragma unroll
        for (int side = 0; side < kSides; ++side)
#pragma unroll
          for (int j = 0; j < kChunkBlocks; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                acc[side * kOutBlocks + chunk + j][2 * h + e] *= a_scale[h] * b_scale[side][j][e];
      }
    };
    if constexpr (kScales == Scales::kEpilogue) scale_accumulator();
    auto write_c = [&](auto activate_gate) {
      // (An e4m3 GEMM1 that quantises in its epilogue keeps the fragments: write_tile leaves
      // the bf16-rounded values in the accumulator for quantize_outputs.)
      if constexpr ((kWarpStagingBytes<Tile, kGated, kScales>) >= Tile::kStagingWarpBytes)
        if (!kQuantizes || !groups.quantize.codes) return write_tile_staged(groups.c, activate_gate);
      write_tile(groups.c, activate_gate);
    };
    if constexpr (kGated) {  // GEMM1 writes whole rows (no split K)
      if (activation == Activation::kSilu)
        write_c(Silu{});
      else
        write_c(Gelu{});
    } else if (groups.c_partial) {
      write_tile(groups.c_partial + blockIdx.y * groups.partial_stride, Silu{});  // (not gated: no activation)
    } else {
      write_c(Silu{});
    }
    if constexpr (kQuantizes) {
      if (groups.quantize.codes) {
        // (fp8_block: the tiles with a staging buffer, the narrow one, stage their codes)
        constexpr bool kStagesCodes = kScales == Scales::kPerKTile && (kWarpStagingBytes<Tile, kGated, kScales>) > 0;
        quantize_outputs<kOutBlocks, kStagesCodes>(
            groups.quantize, acc, rows, first_slot, group_end, first_col, out_cols, groups.c_stride, lane,
            partner_has_columns ? &control.exchange : nullptr, exchanges & 1, thread == 0,
            staging_base + thread / 32 * kWarpStagingBytes<Tile, kGated, kScales>);
        exchanges += partner_has_columns ? 1 : 0;
      }
    }
    if (kGated && row_tile_columns != nullptr) {
      consumers_sync();
      if (thread == 0 && p.tile_index >= 0)
        hand_over_columns(&row_tile_columns[p.tile_index], static_cast<int>(min(cols_per_tile, out_cols - first_col)));
    }
  }
  if (row_pairs) cluster_sync();
}

// cuTensorMapEncodeTiled, from the driver the runtime has loaded (no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      function = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// The tensor map of weights [experts, n, k] (K-major) for boxes of `box_rows` rows of 128
// bytes, 128-byte swizzle (the tile format), zeros past the edges.
cudaError_t weight_tensor_map(CUtensorMap& map, const void* weights, int64_t experts, int64_t n, int64_t k,
                              int element_bytes, int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(experts)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(k * element_bytes),
                                 static_cast<cuuint64_t>(n * k * element_bytes)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kRowBytes / element_bytes), static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result =
      encode(&map, element_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
             const_cast<void*>(weights), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename Tile, bool kGated, Scales kScales>
cudaError_t launch_specialized(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles,
                               Activation activation, cudaStream_t stream) {
  constexpr bool kFp8 = Tile::kFp8;
  auto* kernel = specialized_gemm_kernel<Tile, kGated, kScales>;
  constexpr size_t kSharedBytes = specialized_shared_bytes<Tile, kGated, kScales>();
  static const cudaError_t attribute_error = [&] {
    const cudaError_t error =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSharedBytes));
    return error != cudaSuccess ? error : prefer_max_shared_memory(kernel);
  }();
  if (attribute_error != cudaSuccess) return attribute_error;
  // Both maps exist for the launch; one without weights stands in for the other (never read).
  const int box_rows = Tile::kCols / 2;  // a B tile is two boxes
  CUtensorMap routed{}, shared{};
  const bool has_routed = groups.b_routed && groups.local_experts > 0 && groups.n > 0 && groups.k > 0;
  const bool has_shared = groups.b_shared && groups.n_shared > 0 && groups.k_shared > 0;
  if (has_routed)
    if (const cudaError_t error = weight_tensor_map(routed, groups.b_routed, groups.local_experts, groups.n, groups.k,
                                                    Operand<kFp8>::kBytes, box_rows);
        error != cudaSuccess)
      return error;
  if (has_shared)
    if (const cudaError_t error = weight_tensor_map(shared, groups.b_shared, 1, groups.n_shared, groups.k_shared,
                                                    Operand<kFp8>::kBytes, box_rows);
        error != cudaSuccess)
      return error;
  if (!has_routed) routed = shared;
  if (!has_shared) shared = routed;
  const bool column_pairs = pairs_column_tiles<Tile, kGated>(groups);
  const bool row_pairs = pairs_row_tiles<Tile, kGated>(groups);
  // A group of the fused quantisation is a tile's columns, or a pair's.
  if (quantizes_per_group<Tile, kGated>(groups) &&
      groups.quantize.group != (column_pairs ? 2 : 1) * kSpecializedOutCols<Tile, kGated>)
    return cudaErrorInvalidValue;
  // Persistent: as many CTAs as the GPU holds at once (in clusters of two where paired), at
  // most one per possible work item; split K's slices share them (the rule that splits keeps
  // its CTAs within one wave).
  static const std::pair<cudaError_t, int64_t> resident[2] = {resident_ctas(kernel, Tile::kThreads, kSharedBytes, 1),
                                                               resident_ctas(kernel, Tile::kThreads, kSharedBytes, 2)};
  const unsigned unit = column_pairs || row_pairs ? 2 : 1;  // CTAs a cluster
  const auto [resident_error, resident_count] = resident[unit - 1];
  if (resident_error != cudaSuccess) return resident_error;
  const int64_t items = specialized_items(max_tiles, specialized_column_tiles<Tile, kGated>(groups), row_pairs);
  if (items > std::numeric_limits<int32_t>::max()) return cudaErrorInvalidConfiguration;  // the kernel counts them in int
  const int64_t ctas = std::min(items, std::max<int64_t>(resident_count / groups.k_splits, unit)) / unit * unit;
  return launch_kernel_in_clusters(Start::kEarly, unit, kernel,
                                   dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(groups.k_splits)),
                                   dim3(Tile::kThreads), kSharedBytes, stream, routed, shared, groups, layout,
                                   activation);
}

}  // namespace

int specialized_tile_cols(bool fp8, bool gated, int64_t likely_tiles, int64_t out_cols, int64_t k, int k_splits) {
  static_assert(Bf16NarrowTile::kCols == Fp8NarrowTile::kCols && Bf16Tile::kCols == Fp8Tile::kCols);
  // Rounds of one CTA an SM that a width's items take (the persistent CTAs walk them in turn).
  auto waves = [&](int cols) {
    const int64_t items = std::max<int64_t>(1, likely_tiles) * column_tile_count(out_cols, cols, gated) * k_splits;
    return (items + multiprocessor_count() - 1) / multiprocessor_count();
  };
  const int64_t narrow = waves(Bf16NarrowTile::kCols), wide = waves(Bf16Tile::kCols);
  if (!fp8) {
    // The width whose rounds take the least time, the wider on a tie, by an item's time in
    // 40ths of a 256-wide one's. 128 wide: half the work at about 1.25 times the time per flop,
    // 25 (the 128 x 128 tile on every launch: +20 to +26% at T=16384, where waves are many;
    // -13% at qwen3-30b-a3b T=2048, where 144 items of 256 make two rounds on 132 SMs, the
    // second of 12 items). 192 wide: three quarters of the work, 32 (one round of 128 items at
    // qwen3-30b-a3b T=1024, where 96 of 256 leave 36 SMs idle).
    struct Width {
      int cols, item_time;
    };
    Width best{Bf16Tile::kCols, 40};
    int64_t best_time = wide * best.item_time;
    for (const Width width : {Width{Bf16MidTile::kCols, 32}, Width{Bf16NarrowTile::kCols, 25}})
      if (const int64_t time = waves(width.cols) * width.item_time; time < best_time) best = width, best_time = time;
    return best.cols;
  }
  // e4m3: a 256-wide item costs 1.6 + c / k_tiles narrow ones, c = 6.4 gated (GEMM1's
  // epilogue also activates and quantises), 2.4 not: the quarter fewer bytes a flop of its
  // K loop (fp8_block T=16384 -10 to -15% on the wide tile), less its fill and epilogue, which
  // weigh more the shorter the loop. Fitted to each GEMM measured on either width
  // (fp8_block, ep=8): wide lost 2-6% at qwen3-30b-a3b T=1024-4096 (K 16 and 6 tiles) and
  // on qwen3-235b-a22b T=2048's GEMM1 (288 items of 256 in three rounds against five), won 4-6%
  // on deepseek-v3's GEMM2 (K 16 tiles) from T=2048 and qwen3-235b-a22b's (12) at T=16384.
  constexpr int kDepth = Operand<true>::kDepth;
  const int64_t k_tiles = std::max<int64_t>(1, ((k + kDepth - 1) / kDepth + k_splits - 1) / k_splits);
  return (16 * k_tiles + (gated ? 64 : 24)) * wide < 10 * k_tiles * narrow ? Fp8Tile::kCols : Fp8NarrowTile::kCols;
}

cudaError_t launch_specialized_gemm(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles,
                                    int64_t likely_tiles, bool gated, Activation activation, cudaStream_t stream) {
  if (gated && groups.k_splits != 1) return cudaErrorInvalidValue;  // GEMM1 writes whole rows
  auto with_tile = [&]<typename Tile, Scales kScales>() {
    return gated ? launch_specialized<Tile, true, kScales>(groups, layout, max_tiles, activation, stream)
                 : launch_specialized<Tile, false, kScales>(groups, layout, max_tiles, activation, stream);
  };
  const int cols =
      specialized_tile_cols(groups.fp8, gated, likely_tiles, column_extent(groups, gated), groups.k, groups.k_splits);
  auto by_width = [&]<typename NarrowTile, typename WideTile, Scales kScales>() {
    return cols == NarrowTile::kCols ? with_tile.template operator()<NarrowTile, kScales>()
                                     : with_tile.template operator()<WideTile, kScales>();
  };
  if (!groups.fp8)
    return cols == Bf16MidTile::kCols ? with_tile.template operator()<Bf16MidTile, Scales::kNone>()
                                      : by_width.template operator()<Bf16NarrowTile, Bf16Tile, Scales::kNone>();
  const bool scales_along_k = groups.a_routed_scale.k_stride != 0 || groups.b_routed_scale.k_stride != 0;
  // Scales in the epilogue (per channel, per tensor) take either width too: with the scales
  // loaded first, the wide tile beat the narrow one at ep=8, T=4096-16384, on deepseek-v3 and
  // qwen3-235b-a22b by 3-10 points (fp8_channel -22 to -27% against the narrow tile as it
  // was, fp8_tensor -12 to -18%) and tied on qwen3-30b-a3b (H200, docs/KERNELS.md,
  // thirty-third session). (It had lost 2.6-6.0% in the tenth session, when the epilogue
  // loaded each of its 64 scales a thread beside its use.)
  return scales_along_k ? by_width.template operator()<Fp8NarrowTile, Fp8Tile, Scales::kPerKTile>()
                        : by_width.template operator()<Fp8NarrowTile, Fp8Tile, Scales::kEpilogue>();
}

}  // namespace epmoe::cuda
