// What the grouped GEMM kernels share (grouped_gemm.cu: cp.async tiles for decode and mid
// sizes; grouped_gemm_specialized.cu: the warp-specialised 128-row tile): the shared-memory
// tile format, the wgmma instructions that read it, and the epilogue's pieces (activation,
// fp8 scale indices, GEMM1's fused quantisation).
//
// Tile format: rows of 128 bytes of K (64 bf16 or 128 e4m3), K-major, 16-byte chunks
// XOR-swizzled by row (chunk ^ (row % 8)) in 1024-byte-aligned tiles: the 128-byte swizzle
// that wgmma reads and TMA writes, and free of bank conflicts for ldmatrix.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fp8_codes.cuh"
#include "launchers.h"

namespace epmoe::cuda {

inline constexpr int kRowBytes = 128;  // K bytes per pipeline stage and tile row: 64 bf16 or 128 e4m3
inline constexpr int kChunksPerRow = kRowBytes / 16;  // 16-byte chunks
inline constexpr int kStepsPerStage = kRowBytes / 32;  // tensor-core steps of 32 K bytes (k16 bf16, k32 e4m3)

// The element type of A and B: its size, and the K elements one stage holds.
template <bool kFp8>
struct Operand {
  static constexpr int kBytes = kFp8 ? 1 : 2;
  static constexpr int kDepth = kRowBytes / kBytes;
};

// How a GEMM applies fp8 scales: none (bf16); per K tile, as the tile's sums are added to
// the accumulator (scales that change along K: fp8_block); or once in the epilogue (per
// channel / per tensor). Either way the tensor cores' sums are moved into the f32
// accumulator every K tile of 128: fp8 wgmma accumulates with reduced precision (about 14
// bits, DeepSeek-V3 report), which long K sums would show.
enum class Scales { kNone, kPerKTile, kEpilogue };

__device__ inline uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The first 1024-byte aligned byte of dynamic shared memory (swizzled tiles need it). Pointer
// arithmetic on `raw` itself, so the compiler still knows the result is shared memory and
// reads through it with LDS, not generic loads.
__device__ inline uint8_t* aligned_tiles(uint8_t* raw) { return raw + (1024 - shared_address(raw) % 1024) % 1024; }

// Split K: the K tiles [first, + count) of a GEMM over `k` elements (K tiles of `depth`)
// that split `split` of `splits` sums; count may be 0 (the split's partial sums are zero).
struct KTileRange {
  int first, count;
};
__device__ inline KTileRange split_k_tiles(int64_t k, int depth, int split, int splits) {
  const int all = static_cast<int>((k + depth - 1) / depth);
  const int per_split = (all + splits - 1) / splits;
  return {split * per_split, max(0, min(all - split * per_split, per_split))};
}

// Byte offset of (row, 16-byte chunk) in a swizzled tile of 128-byte rows.
__device__ inline int swizzled(int row, int chunk) { return row * kRowBytes + ((chunk ^ (row & 7)) * 16); }

// 16 bytes global -> shared, zero-filled when !valid (source must still be a valid address).
__device__ inline void copy_async(uint8_t* destination, const uint8_t* source, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(destination)), "l"(source),
               "r"(valid ? 16 : 0));
}

// 4 bytes global -> shared (a scale), through L1.
__device__ inline void copy_scale_async(float* destination, const float* source) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(destination)), "l"(source));
}

// wgmma descriptor of a K-major tile with 128-byte rows (bf16 or e4m3), 128-byte swizzle:
// start address >> 4, leading offset 16 B (unused for this layout), stride 1024 B between
// groups of 8 rows, layout type 1 (128B swizzle). The tile must be 1024-byte aligned.
// The high word is the same for every tile, and the low word's address field (16-byte
// units, 14 bits) holds any shared address: a K loop steps a descriptor along its ring and
// along K by 32-bit adds to the low word (64-bit adds cost a carry chain per step).
inline constexpr uint32_t kDescriptorHigh = (1024 >> 4) | (1u << 30);
__device__ inline uint32_t wgmma_descriptor_low(const uint8_t* tile) {
  return ((shared_address(tile) & 0x3ffff) >> 4) | (1u << 16);
}
__device__ inline uint64_t wgmma_descriptor(uint32_t low) { return uint64_t{kDescriptorHigh} << 32 | low; }
__device__ inline uint64_t wgmma_descriptor(const uint8_t* tile) { return wgmma_descriptor(wgmma_descriptor_low(tile)); }

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// The accumulator operands of one wgmma: d[j][q] is n8 block j in the mma.sync fragment
// order (thread holds rows lane / 4 + 8 (q / 2), columns 8 j + 2 (lane % 4) + q % 2 of its
// warp's 16 rows); 2 blocks (n16), 16 (n128), 24 (n192) or 32 (n256).
#define EPMOE_WG_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define EPMOE_WG_D16(j) EPMOE_WG_D4(j), EPMOE_WG_D4(j + 1), EPMOE_WG_D4(j + 2), EPMOE_WG_D4(j + 3)
#define EPMOE_WG_D64(j) EPMOE_WG_D16(j), EPMOE_WG_D16(j + 4), EPMOE_WG_D16(j + 8), EPMOE_WG_D16(j + 12)
#define EPMOE_WG_REGS8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define EPMOE_WG_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define EPMOE_WG_REGS96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
#define EPMOE_WG_REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// scale-d as a predicate from operand `n`: 0 overwrites d with the product, 1 adds to it.
#define EPMOE_WG_SCALE_D(n) "{\n.reg .pred keep;\nsetp.ne.b32 keep, %" #n ", 0;\n"

// One 32-byte K step of a warpgroup's m64 x Cols tile: k16 of bf16 or k32 of e4m3 (fp8
// has no transpose flags: both operands are K-major, as ours are). accumulate = false
// overwrites d (the first step of a fresh sum) instead of adding to it.
template <int Cols, bool kFp8>
__device__ inline void wgmma_step(float (&d)[Cols / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(Cols == 128 || Cols == 256 || (Cols == 192 && !kFp8) || (Cols == 16 && kFp8),
                "wgmma steps: bf16 m64n128 / m64n192 / m64n256, e4m3 m64n128 / m64n256 / m64n16");
  const int keep = accumulate;
  if constexpr (Cols == 16) {
    asm volatile(EPMOE_WG_SCALE_D(10) "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 " EPMOE_WG_REGS8
                 ", %8, %9, keep, 1, 1;\n}\n"
                 : EPMOE_WG_D4(0), EPMOE_WG_D4(1) : "l"(a), "l"(b), "r"(keep));
  } else if constexpr (Cols == 128 && !kFp8) {
    asm volatile(EPMOE_WG_SCALE_D(66) "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " EPMOE_WG_REGS64
                 ", %64, %65, keep, 1, 1, 0, 0;\n}\n"
                 : EPMOE_WG_D64(0) : "l"(a), "l"(b), "r"(keep));
  } else if constexpr (Cols == 128) {
    asm volatile(EPMOE_WG_SCALE_D(66) "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " EPMOE_WG_REGS64
                 ", %64, %65, keep, 1, 1;\n}\n"
                 : EPMOE_WG_D64(0) : "l"(a), "l"(b), "r"(keep));
  } else if constexpr (Cols == 192) {
    asm volatile(EPMOE_WG_SCALE_D(98) "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 " EPMOE_WG_REGS96
                 ", %96, %97, keep, 1, 1, 0, 0;\n}\n"
                 : EPMOE_WG_D64(0), EPMOE_WG_D16(16), EPMOE_WG_D16(20) : "l"(a), "l"(b), "r"(keep));
  } else if constexpr (kFp8) {
    asm volatile(EPMOE_WG_SCALE_D(130) "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " EPMOE_WG_REGS128
                                       ", %128, %129, keep, 1, 1;\n}\n"
                 : EPMOE_WG_D64(0), EPMOE_WG_D64(16)
                 : "l"(a), "l"(b), "r"(keep));
  } else {
    asm volatile(EPMOE_WG_SCALE_D(130) "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " EPMOE_WG_REGS128
                 ", %128, %129, keep, 1, 1, 0, 0;\n}\n"
                 : EPMOE_WG_D64(0), EPMOE_WG_D64(16) : "l"(a), "l"(b), "r"(keep));
  }
}

// One K tile (a stage's 128 bytes of K) of a warpgroup's m64 x Cols product: its wgmma steps,
// 32 bytes apart along K inside the swizzle atom (2 in the descriptors' 16-byte address
// units). fresh starts a new sum (fp8_block's, every K tile) instead of adding to d.
template <int Cols, bool kFp8>
__device__ inline void wgmma_k_tile(float (&d)[Cols / 8][4], uint32_t a_descriptor, uint32_t b_descriptor, bool fresh) {
#pragma unroll
  for (int kk = 0; kk < kStepsPerStage; ++kk)
    wgmma_step<Cols, kFp8>(d, wgmma_descriptor(a_descriptor + 2 * kk), wgmma_descriptor(b_descriptor + 2 * kk),
                           !fresh || kk > 0);
}

// fp8_block's promotion on the 128-row tile: the n128 sums of round `round` (B rows 128 round
// on) added to the accumulator times the K tile's scales: a_scale[h] of the thread's rows h,
// b_scale of the B half its columns lie in (gate or up rows; a plain tile's two halves).
template <int kMmaN>
__device__ inline void promote_round(float (&acc)[kMmaN][4], const float (&sums)[128 / 8][4], int round,
                                     const float (&a_scale)[2], const float (&b_scale)[2]) {
#pragma unroll
  for (int j = 0; j < 128 / 8; ++j) {
    const int block = round * (128 / 8) + j;
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[block][q] += sums[j][q] * (a_scale[q / 2] * b_scale[block >= kMmaN / 2 ? 1 : 0]);
  }
}

// The gated activations. SiLU by the fast exponential and division: a few float ulp, far
// inside the bf16 rounding of what the epilogues write (expf and the IEEE division, with
// its range check and slow-path call, were much of the e4m3 tile's epilogue). GELU by erf.
struct Silu {
  __device__ float operator()(float value) const { return __fdividef(value, 1.0f + __expf(-value)); }
};
struct Gelu {
  __device__ float operator()(float value) const { return 0.5f * value * (1.0f + erff(value * 0.70710678118654752f)); }
};
__device__ inline float activate(Activation activation, float value) {
  return activation == Activation::kSilu ? Silu{}(value) : Gelu{}(value);
}

// Two values as bf16 in one word, the first in the low half (the lower address).
__device__ inline uint32_t pack_bf16x2(float first, float second) {
  const __nv_bfloat162 packed = __floats2bfloat162_rn(first, second);
  return reinterpret_cast<const uint32_t&>(packed);
}
__device__ inline void store_pair(uint16_t* destination, float first, float second) {
  *reinterpret_cast<uint32_t*>(destination) = pack_bf16x2(first, second);
}

// The output columns the grid covers: the wider of the routed and the shared experts'.
__host__ __device__ inline int64_t column_extent(const GemmGroups& groups, bool gated) {
  return (groups.n > groups.n_shared ? groups.n : groups.n_shared) / (gated ? 2 : 1);
}
// Column tiles over out_cols output columns for tiles of tile_cols B rows (gated: half of
// them gate rows, so tile_cols / 2 outputs a tile).
__host__ __device__ inline int64_t column_tile_count(int64_t out_cols, int tile_cols, bool gated) {
  const int64_t outputs = gated ? tile_cols / 2 : tile_cols;
  return (out_cols + outputs - 1) / outputs;
}

// A row tile of the list (PairLayout) and the group it belongs to: what both GEMM kernels
// read before their main loop.
struct RowTile {
  int group;
  int32_t first_slot, group_end;  // the tile's first slot, the group's end
  bool shared;                    // the shared experts' group
  int64_t n, k;                   // the group's B is [n, k]
};
__device__ inline RowTile row_tile(const GemmGroups& groups, const PairLayout& layout, int tile) {
  const int group = layout.tile_group[tile];
  const bool shared = group == groups.local_experts;
  return {group, layout.tile_row[tile], layout.group_offsets[group] + layout.group_counts[group], shared,
          shared ? groups.n_shared : groups.n, shared ? groups.k_shared : groups.k};
}
// Row tile `tile` (< groups.early_shared_tiles) of the shared group, which sort_pairs puts
// first in the main list: known without the sort's output.
__device__ inline RowTile early_shared_tile(const GemmGroups& groups, int tile, int tile_rows) {
  return {groups.local_experts, groups.shared_first_slot + tile * tile_rows,
          groups.shared_first_slot + groups.shared_rows, true, groups.n_shared, groups.k_shared};
}
// The A row behind row `row` of the tile (a gather through the slot map a_row_of_slot, the
// groups' own or a CTA's copy; the shared group's slot shared_first_slot + t is token t), or
// -1 past the group.
__device__ inline int64_t a_row_of(const GemmGroups& groups, const RowTile& tile, int row,
                                   const int32_t* a_row_of_slot) {
  const int32_t slot = tile.first_slot + row;
  if (slot >= tile.group_end) return -1;
  if (!a_row_of_slot) return slot;
  return tile.shared ? slot - groups.shared_first_slot : a_row_of_slot[slot];
}
__device__ inline int64_t a_row_of(const GemmGroups& groups, const RowTile& tile, int row) {
  return a_row_of(groups, tile, row, groups.a_row_of_slot);
}

// Where the fp8 scales of row (or weight row) `n` of group `group` start; K tile k adds
// k * k_stride.
__device__ inline int32_t scale_index(const ScaleGrid& grid, int64_t n, int group) {
  const int64_t block_row = grid.block_n == 1 ? n : n / grid.block_n;  // (a uniform branch, no division)
  return static_cast<int32_t>(block_row * grid.row_stride + group * grid.group_stride);
}

// The hand-over by row tile (GemmGroups::row_tile_columns), on the specialised and the decode
// tile. GEMM1, once every thread of the epilogue has written the item (after a barrier): the
// columns it completed, released at GPU scope (the barrier orders the other threads' stores
// before this thread's fence).
__device__ inline void hand_over_columns(int32_t* count, int columns) {
  __threadfence();
  atomicAdd(count, columns);
}
// GEMM2, before the item's A loads: until all `columns` of the row tile are in (acquire; a
// barrier after it orders the other threads' copies). The cache operator of a copy is a
// hint, not a weaker order: cp.async.ca reads through L1 are ordered as well (the acquire
// compiles to LDG.STRONG.GPU with CCTL.IVALL, which drops the SM's L1 lines).
__device__ inline void wait_for_columns(const int32_t* count, int64_t columns) {
  for (;;) {
    int32_t written;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(written) : "l"(count) : "memory");
    if (written >= columns) return;
    __nanosleep(200);
  }
}

// Synchronises the `threads` threads of a CTA that run an epilogue, on named barrier 1.
__device__ inline void sync_epilogue(int threads) { asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory"); }

// GEMM1's fused quantisation on grouped_gemm.cu's tiles (EpilogueQuantize, arrival counters
// `arrivals` of the tile list the GEMM runs; the specialised tile quantises from its
// registers instead): called by the `threads` epilogue threads of
// a CTA (`thread` = this one's index among them) once their bf16 outputs (rows [first_slot,
// + rows), columns [first_col, + tile_cols) of c) are written. The last CTA of the scope to
// arrive quantises the scope: a group of 128 columns, or its own tile under a static scale,
// so at most 128 values per row, held in registers; each warp loads kBatch rows at once
// (the loads of this tail are exposed at decode sizes). Returns the columns this CTA
// quantised (the scope's, for the hand-over by row tile), 0 where another CTA will.
__device__ inline int quantize_output(const EpilogueQuantize& q, int32_t* arrivals, const uint16_t* c,
                                       int64_t c_stride, int tile,
                                       int32_t first_slot, int rows, int64_t first_col, int tile_cols,
                                       int64_t out_cols, int thread, int threads) {
  const bool per_group = q.granularity == Fp8Granularity::kPerGroup;
  const int64_t begin = per_group ? first_col / q.group * q.group : first_col;
  const int64_t width = min(per_group ? q.group : tile_cols, out_cols - begin);
  const int writers = static_cast<int>((width + tile_cols - 1) / tile_cols);  // CTAs writing the scope
  __shared__ bool last;
  __threadfence();  // this CTA's outputs are visible to every SM before its arrival is
  sync_epilogue(threads);
  if (thread == 0)
    last = writers == 1 || atomicAdd(arrivals + tile * q.scopes_per_tile + begin / q.group, 1) == writers - 1;
  sync_epilogue(threads);
  if (!last) return 0;
  __threadfence();
  constexpr int kBatch = 4;
  const int warps = threads / 32, warp = thread / 32, lane = thread % 32;
  const bool held = 4 * lane < width;
#pragma unroll 1
  for (int first = warp; first < rows; first += warps * kBatch) {
    uint2 quads[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int row = first + j * warps;
      const uint16_t* span = c + (first_slot + row) * c_stride + begin;
      quads[j] = row < rows && held ? __ldcg(reinterpret_cast<const uint2*>(span) + lane) : make_uint2(0, 0);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t row = first + j * warps, slot = first_slot + row;
      if (row < rows) {  // warp-uniform
        const uint2 quad[1] = {quads[j]};
        const float scale = quantize_held(quad, held, q.static_scale, q.codes + slot * c_stride + begin, lane);
        if (lane == 0 && per_group) q.scales[slot * ((c_stride + q.group - 1) / q.group) + begin / q.group] = scale;
      }
    }
  }
  return static_cast<int>(width);
}

}  // namespace epmoe::cuda
