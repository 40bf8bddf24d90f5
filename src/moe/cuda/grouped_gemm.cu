// Grouped GEMM over the experts' row tiles, bf16 tensor cores (f32 accumulate), with the
// gather of A rows and the gated activation fused.
//
// Work: blockIdx.x = a row tile of PairLayout (one group = one expert, up to tile_rows
// consecutive slots), blockIdx.y = a column tile. Tiles past tile_count exit at once, so
// the grid is sized from an upper bound and the launch needs no host synchronisation.
// Layout: A rows (activations, K-major) are gathered per slot through a_row_of_slot; B is
// the expert's weight [N, K], K-major, so both operands are "K-contiguous" and a C tile is
// sum_k A[m, k] B[n, k] (a TN GEMM). Tiles of A (rows x 64) and B (cols x 64) stream through
// a STAGES-deep cp.async ring in shared memory, 16-byte chunks XOR-swizzled by row (the
// 128-byte swizzle wgmma reads, and free of bank conflicts for ldmatrix).
// Gated (GEMM1): the B tile interleaves gate and up rows in blocks of 8 (8 gate rows of
// columns c..c+7, then the 8 up rows of the same columns), so each thread's accumulators
// hold gate and up of the same output element, and act(gate) * up is written directly as
// the bf16 intermediate: no extra pass over it.
// Tensor cores: wgmma (sm_90a) for tiles of 64 x 128 and 128 x 256; mma.sync for the 16-row decode
// tile, where the weights stream once and bandwidth, not the instruction, is the bound.
// Both keep their accumulators in the same fragment order, so one epilogue serves both.
#include <cuda_bf16.h>

#include <algorithm>

#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kDepth = 64;            // K per pipeline stage: 128 bytes of bf16 per row
constexpr int kChunksPerRow = kDepth / 8;  // 16-byte chunks

enum class Instruction { kMmaSync, kWgmma };

// A tile shape and the tensor-core instruction that computes it. Chosen by
// choose_tile_rows(); only the three configs below are instantiated.
//   mma.sync: WarpsM x WarpsN warps, each a (Rows / WarpsM) x (Cols / WarpsN) tile of m16n8k16.
//   wgmma:    Rows / 64 warpgroups, each m64 x Cols (one m64nColsk16 per 16 of K); warp w of the
//             CTA holds rows 16w..16w+15, so the epilogue indexes both alike.
template <Instruction Kind, int Rows, int Cols, int Stages, int WarpsM, int WarpsN>
struct Config {
  static constexpr Instruction kInstruction = Kind;
  static constexpr int kRows = Rows, kCols = Cols, kStages = Stages, kWarpsN = WarpsN;
  static constexpr int kThreads = WarpsM * WarpsN * 32;
  static constexpr int kWarpRows = Rows / WarpsM, kWarpCols = Cols / WarpsN;
  static constexpr int kMmaM = kWarpRows / 16, kMmaN = kWarpCols / 8;
  static constexpr int kStageElements = (Rows + Cols) * kDepth;
  // + 1 KiB to align the ring to the 1024-byte period of the 128-byte swizzle (wgmma needs it).
  static constexpr size_t kSharedBytes = size_t{Stages} * kStageElements * sizeof(uint16_t) + 1024;
  static_assert(kWarpRows % 16 == 0 && kWarpCols % 16 == 0, "warp tile must hold whole mma tiles and gate/up pairs");
  static_assert(Kind != Instruction::kWgmma || (WarpsN == 1 && kWarpRows == 16 && (Cols == 128 || Cols == 256)),
                "wgmma configs: one warp per 16 rows, m64n128 or m64n256 per warpgroup");
};

// Decode: narrow column tiles (twice the CTAs of 128) and a deep ring (7 stages of 8 KiB of
// weights in flight per CTA), so even one or two experts keep every SM streaming.
using DecodeConfig = Config<Instruction::kMmaSync, 16, 64, 8, 1, 4>;
using MediumConfig = Config<Instruction::kWgmma, 64, 128, 4, 4, 1>;
using LargeConfig = Config<Instruction::kWgmma, 128, 256, 4, 8, 1>;

__device__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Element offset of (row, chunk) in a swizzled tile of 64-element rows.
__device__ int swizzled(int row, int chunk) { return row * kDepth + ((chunk ^ (row & 7)) * 8); }

__device__ void copy_async(uint16_t* destination, const uint16_t* source, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(destination)), "l"(source),
               "r"(valid ? 16 : 0));
}

__device__ void ldmatrix_x4(uint32_t (&out)[4], const uint16_t* address) {
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

// wgmma descriptor of a K-major bf16 tile with 64-element (128-byte) rows, 128-byte swizzle:
// start address >> 4, leading offset 16 B (unused for this layout), stride 1024 B between
// groups of 8 rows, layout type 1 (128B swizzle). The tile must be 1024-byte aligned.
__device__ uint64_t wgmma_descriptor(const uint16_t* tile) {
  const uint64_t address = shared_address(tile);
  return ((address & 0x3ffff) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// d[j][q]: n8 block j of the warpgroup's m64n128 accumulator, in the mma.sync fragment order.
__device__ void wgmma_m64n128k16(float (&d)[16][4], uint64_t a_descriptor, uint64_t b_descriptor) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(a_descriptor), "l"(b_descriptor));
}

__device__ void wgmma_m64n256k16(float (&d)[32][4], uint64_t a_descriptor, uint64_t b_descriptor) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]),
        "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]),
        "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]),
        "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]),
        "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]),
        "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]),
        "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]),
        "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]),
        "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]),
        "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]),
        "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]),
        "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]),
        "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]),
        "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]),
        "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]),
        "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]),
        "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
      : "l"(a_descriptor), "l"(b_descriptor));
}

// One k16 step of the warpgroup's m64 x Cols tile.
template <int Cols>
__device__ void wgmma_step(float (&d)[Cols / 8][4], uint64_t a_descriptor, uint64_t b_descriptor) {
  if constexpr (Cols == 128) {
    wgmma_m64n128k16(d, a_descriptor, b_descriptor);
  } else {
    wgmma_m64n256k16(d, a_descriptor, b_descriptor);
  }
}

__device__ float activate(Activation activation, float value) {
  if (activation == Activation::kSilu) return value / (1.0f + expf(-value));
  return 0.5f * value * (1.0f + erff(value * 0.70710678118654752f));
}

__device__ void store_pair(uint16_t* destination, float first, float second) {
  const __nv_bfloat162 packed = __floats2bfloat162_rn(first, second);
  *reinterpret_cast<__nv_bfloat162*>(destination) = packed;
}

template <typename Cfg, bool kGated>
__global__ void __launch_bounds__(Cfg::kThreads) grouped_gemm_kernel(GemmGroups groups, PairLayout layout,
                                                                     Activation activation) {
  extern __shared__ __align__(128) uint8_t shared_raw[];
  uint16_t* shared_tiles = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t{1023});
  allow_successor();
  wait_for_predecessor();
  const int tile = blockIdx.x;
  if (tile >= *layout.tile_count) return;
  const int group = layout.tile_group[tile];
  const int32_t first_slot = layout.tile_row[tile];
  const int32_t group_end = layout.group_offsets[group + 1];
  const bool shared = group == groups.local_experts;
  const int64_t N = shared ? groups.n_shared : groups.n;
  const int64_t K = shared ? groups.k_shared : groups.k;
  const uint16_t* A = shared ? groups.a_shared : groups.a_routed;
  const uint16_t* B = shared ? groups.b_shared : groups.b_routed + static_cast<int64_t>(group) * N * K;
  // Output columns of this tile: gated tiles produce Cols / 2 intermediate columns.
  const int64_t out_cols = kGated ? N / 2 : N;
  const int64_t first_col = static_cast<int64_t>(blockIdx.y) * (kGated ? Cfg::kCols / 2 : Cfg::kCols);
  if (first_col >= out_cols) return;

  // The global rows this thread copies into each stage, fixed over the K loop.
  constexpr int kAChunks = Cfg::kRows * kChunksPerRow / Cfg::kThreads;
  constexpr int kBChunks = Cfg::kCols * kChunksPerRow / Cfg::kThreads;
  static_assert(kAChunks * Cfg::kThreads == Cfg::kRows * kChunksPerRow || Cfg::kRows * kChunksPerRow < Cfg::kThreads,
                "A tile chunks must spread evenly over the threads");
  const uint16_t* a_source[kAChunks > 0 ? kAChunks : 1];
  const uint16_t* b_source[kBChunks];
  const int chunk = threadIdx.x % kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kAChunks > 0 ? kAChunks : 1); ++i) {
    const int row = (threadIdx.x + i * Cfg::kThreads) / kChunksPerRow;
    const int32_t slot = first_slot + row;
    a_source[i] = nullptr;
    if (row < Cfg::kRows && slot < group_end) {
      const int64_t a_row = groups.a_row_of_slot ? groups.a_row_of_slot[slot] : slot;
      a_source[i] = A + a_row * groups.a_stride + chunk * 8;
    }
  }
#pragma unroll
  for (int i = 0; i < kBChunks; ++i) {
    const int row = (threadIdx.x + i * Cfg::kThreads) / kChunksPerRow;
    int64_t b_row;
    bool valid;
    if constexpr (kGated) {
      const int64_t col = first_col + (row / 16) * 8 + row % 8;  // the output column of this B row
      b_row = (row % 16 < 8 ? 0 : out_cols) + col;
      valid = col < out_cols;
    } else {
      b_row = first_col + row;
      valid = b_row < N;
    }
    b_source[i] = valid ? B + b_row * K + chunk * 8 : nullptr;
  }

  auto load_stage = [&](int stage, int64_t k0) {
    uint16_t* a_tile = shared_tiles + stage * Cfg::kStageElements;
    uint16_t* b_tile = a_tile + Cfg::kRows * kDepth;
    const bool k_valid = k0 + chunk * 8 < K;
#pragma unroll
    for (int i = 0; i < (kAChunks > 0 ? kAChunks : 1); ++i) {
      const int row = (threadIdx.x + i * Cfg::kThreads) / kChunksPerRow;
      if (row >= Cfg::kRows) continue;
      const bool valid = a_source[i] && k_valid;
      copy_async(a_tile + swizzled(row, chunk), valid ? a_source[i] + k0 : A, valid);
    }
#pragma unroll
    for (int i = 0; i < kBChunks; ++i) {
      const int row = (threadIdx.x + i * Cfg::kThreads) / kChunksPerRow;
      const bool valid = b_source[i] && k_valid;
      copy_async(b_tile + swizzled(row, chunk), valid ? b_source[i] + k0 : B, valid);
    }
  };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = (warp / Cfg::kWarpsN) * Cfg::kWarpRows;
  const int warp_col = (warp % Cfg::kWarpsN) * Cfg::kWarpCols;
  float acc[Cfg::kMmaM][Cfg::kMmaN][4] = {};

  // Split K (blockIdx.z of gridDim.z): this CTA sums K tiles [first_k_tile, + k_tiles).
  const int all_k_tiles = static_cast<int>((K + kDepth - 1) / kDepth);
  const int tiles_per_split = (all_k_tiles + static_cast<int>(gridDim.z) - 1) / static_cast<int>(gridDim.z);
  const int first_k_tile = static_cast<int>(blockIdx.z) * tiles_per_split;
  const int k_tiles = max(0, min(all_k_tiles - first_k_tile, tiles_per_split));
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, static_cast<int64_t>(first_k_tile + s) * kDepth);
    asm volatile("cp.async.commit_group;\n");
  }
  if constexpr (Cfg::kInstruction == Instruction::kMmaSync) {
    for (int kt = 0; kt < k_tiles; ++kt) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(Cfg::kStages - 2));
      __syncthreads();
      const int next = kt + Cfg::kStages - 1;
      if (next < k_tiles) load_stage(next % Cfg::kStages, static_cast<int64_t>(first_k_tile + next) * kDepth);
      asm volatile("cp.async.commit_group;\n");

      const uint16_t* a_tile = shared_tiles + (kt % Cfg::kStages) * Cfg::kStageElements;
      const uint16_t* b_tile = a_tile + Cfg::kRows * kDepth;
#pragma unroll
      for (int kk = 0; kk < kDepth / 16; ++kk) {
        uint32_t a_frag[Cfg::kMmaM][4];
#pragma unroll
        for (int mi = 0; mi < Cfg::kMmaM; ++mi) {
          const int row = warp_row + mi * 16 + lane % 16;
          ldmatrix_x4(a_frag[mi], a_tile + swizzled(row, kk * 2 + lane / 16));
        }
#pragma unroll
        for (int np = 0; np < Cfg::kMmaN / 2; ++np) {
          uint32_t b_frag[4];
          const int row = warp_col + np * 16 + lane % 8 + (lane / 16) * 8;
          ldmatrix_x4(b_frag, b_tile + swizzled(row, kk * 2 + (lane / 8) % 2));
#pragma unroll
          for (int mi = 0; mi < Cfg::kMmaM; ++mi) {
            mma_bf16(acc[mi][2 * np], a_frag[mi], b_frag[0], b_frag[1]);
            mma_bf16(acc[mi][2 * np + 1], a_frag[mi], b_frag[2], b_frag[3]);
          }
        }
      }
    }
    asm volatile("cp.async.wait_group 0;\n");
  } else {
    // Warpgroup g multiplies rows 64g..64g+63 of the A tile by the whole B tile. One wgmma
    // group stays in flight while the next stage lands; a stage is refilled only after
    // every warpgroup's wgmma on it has completed (wait_group 1, then the barrier).
    const int warpgroup = warp / 4;
    for (int kt = 0; kt < k_tiles; ++kt) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(Cfg::kStages - 2));
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async data -> tensor cores
      __syncthreads();
      const uint16_t* a_tile = shared_tiles + (kt % Cfg::kStages) * Cfg::kStageElements;
      const uint16_t* b_tile = a_tile + Cfg::kRows * kDepth;
      const uint64_t a_descriptor = wgmma_descriptor(a_tile + warpgroup * 64 * kDepth);
      const uint64_t b_descriptor = wgmma_descriptor(b_tile);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDepth / 16; ++kk)  // +32 bytes along K inside the swizzle atom
        wgmma_step<Cfg::kCols>(acc[0], a_descriptor + 2 * kk, b_descriptor + 2 * kk);
      wgmma_commit();
      wgmma_wait<1>();
      __syncthreads();
      const int next = kt + Cfg::kStages - 1;
      if (next < k_tiles) load_stage(next % Cfg::kStages, static_cast<int64_t>(first_k_tile + next) * kDepth);
      asm volatile("cp.async.commit_group;\n");
    }
    wgmma_wait<0>();
    asm volatile("cp.async.wait_group 0;\n");
  }

  // Epilogue: thread holds rows lane/4 and lane/4 + 8 of each m16 tile, two columns each.
#pragma unroll
  for (int mi = 0; mi < Cfg::kMmaM; ++mi) {
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
}

template <typename Cfg, bool kGated>
cudaError_t launch_config(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles,
                          Activation activation, cudaStream_t stream) {
  auto* kernel = grouped_gemm_kernel<Cfg, kGated>;
  static const cudaError_t attribute_error = [&] {
    const cudaError_t error =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(Cfg::kSharedBytes));
    return error != cudaSuccess ? error : prefer_max_shared_memory(reinterpret_cast<const void*>(kernel));
  }();
  if (attribute_error != cudaSuccess) return attribute_error;
  const int64_t widest = std::max(groups.n, groups.n_shared) / (kGated ? 2 : 1);
  const int64_t cols_per_tile = kGated ? Cfg::kCols / 2 : Cfg::kCols;
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((widest + cols_per_tile - 1) / cols_per_tile),
                  static_cast<unsigned>(groups.k_splits));
  return launch_chained(kernel, grid, dim3(Cfg::kThreads), Cfg::kSharedBytes, stream, groups, layout, activation);
}

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

}  // namespace

int choose_k_splits(int tile_rows, int64_t expected_row_tiles, int64_t n, int64_t k) {
  if (tile_rows != DecodeConfig::kRows) return 1;  // larger tiles fill the GPU on their own
  const int64_t ctas = std::max<int64_t>(1, expected_row_tiles) * ((n + DecodeConfig::kCols - 1) / DecodeConfig::kCols);
  const int64_t wanted = (2 * multiprocessor_count() + ctas - 1) / ctas;
  const int64_t most = std::max<int64_t>(1, k / (4 * kDepth));  // keep at least 4 K tiles per split
  return static_cast<int>(std::clamp<int64_t>(wanted, 1, std::min<int64_t>(most, kMaxKSplits)));
}

int choose_tile_rows(int64_t slots, int64_t groups) {
  const int64_t rows_per_group = groups > 0 ? slots / groups : slots;
  if (rows_per_group <= DecodeConfig::kRows) return DecodeConfig::kRows;
  if (rows_per_group <= 2 * MediumConfig::kRows) return MediumConfig::kRows;
  return LargeConfig::kRows;
}

cudaError_t launch_grouped_gemm(const GemmGroups& groups, const PairLayout& layout, int64_t max_tiles, bool gated,
                                Activation activation, int tile_rows, cudaStream_t stream) {
  if (max_tiles == 0) return cudaSuccess;
  auto dispatch = [&]<typename Cfg>() {
    return gated ? launch_config<Cfg, true>(groups, layout, max_tiles, activation, stream)
                 : launch_config<Cfg, false>(groups, layout, max_tiles, activation, stream);
  };
  switch (tile_rows) {
    case DecodeConfig::kRows: return dispatch.template operator()<DecodeConfig>();
    case MediumConfig::kRows: return dispatch.template operator()<MediumConfig>();
    case LargeConfig::kRows: return dispatch.template operator()<LargeConfig>();
    default: return cudaErrorInvalidValue;  // only the tile heights choose_tile_rows returns exist
  }
}

}  // namespace epmoe::cuda
