// Chained launches (programmatic dependent launch): a kernel launched with
// launch_chained() may start while its predecessor in the stream is finishing, and must call
// wait_for_predecessor() before it touches memory the predecessor writes. Each kernel of
// the pipeline calls allow_successor() first, so the next launch overlaps the tail of this
// one; at decode sizes, where the layer is a chain of short kernels, this hides most of the
// gaps between them. Captured into a CUDA graph the chain keeps its programmatic edges.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

namespace epmoe::cuda {

__device__ __forceinline__ void wait_for_predecessor() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void allow_successor() { asm volatile("griddepcontrol.launch_dependents;\n"); }

// counters[0, count) = 0 by every thread of the grid, a grid-stride apart: GEMM1's arrival
// counters, zeroed by whichever launch comes first in a call (the sort, or x's quantisation).
__device__ inline void zero_by_grid(int32_t* counters, int64_t count) {
  const int64_t threads = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += threads) counters[i] = 0;
}

// Every kernel of the pipeline asks for the same L1/shared split (as much shared memory as
// possible, what the GEMMs need), so consecutive kernels do not make the SMs reconfigure
// between them, which would serialise the chained launches. Call once per kernel (a
// launcher's kernels at once: the first error is returned).
template <typename... Kernels>
cudaError_t prefer_max_shared_memory(Kernels*... kernels) {
  for (const void* kernel : {reinterpret_cast<const void*>(kernels)...})
    if (const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                       cudaSharedmemCarveoutMaxShared);
        error != cudaSuccess)
      return error;
  return cudaSuccess;
}

// When a launch may start: kEarly, while its predecessor in the stream finishes (each kernel
// of the operator after its first); kAfterPredecessor, once the predecessor has finished (the
// operator's first kernel), so that in a chain of calls one call's kernels do not become
// resident, early launch after early launch, while the previous call's last GEMM still
// streams. Measured (deepseek-v3 ep=8, graphs of 4 calls): T=16 / 64 373 / 631 us against
// 384 / 656 before, within run-to-run noise; T=1 unchanged.
enum class Start { kEarly, kAfterPredecessor };

// launch_kernel with the grid cut into clusters of `cluster` CTAs along x (1: no clusters);
// grid.x must be a multiple of it.
template <typename... Params, typename... Args>
cudaError_t launch_kernel_in_clusters(Start start, unsigned cluster, void (*kernel)(Params...), dim3 grid, dim3 block,
                                      size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (start == Start::kEarly) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count++].val.clusterDim = {cluster, 1, 1};
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t launch_kernel(Start start, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                          cudaStream_t stream, Args&&... args) {
  return launch_kernel_in_clusters(start, 1, kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
}

// The SMs of the current device (132 where the query fails: a tuning input only).
int multiprocessor_count();

// How many CTAs of `kernel` the GPU holds at once, in clusters of `cluster` (for grids of
// resident CTAs that walk the work themselves).
template <typename Kernel>
std::pair<cudaError_t, int64_t> resident_ctas(Kernel* kernel, unsigned threads, size_t shared_bytes, unsigned cluster) {
  if (cluster == 1) {
    int per_multiprocessor = 0;
    cudaError_t error =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, threads, shared_bytes);
    if (error == cudaSuccess && per_multiprocessor == 0) error = cudaErrorInvalidConfiguration;
    return {error, int64_t{per_multiprocessor} * multiprocessor_count()};
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim = {cluster, 1, 1};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  const cudaError_t error = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
  if (error == cudaSuccess && clusters == 0) return {cudaErrorInvalidConfiguration, 0};
  return {error, int64_t{clusters} * cluster};
}

template <typename... Params, typename... Args>
cudaError_t launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                           Args&&... args) {
  return launch_kernel(Start::kEarly, kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
}

}  // namespace epmoe::cuda
