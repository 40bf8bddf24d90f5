// main() of the GPU tests: exits with 77 (ctest: skipped) when no CUDA device is usable,
// so the suite passes on machines without a GPU and runs everything where there is one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t error = cudaGetDeviceCount(&devices);
  if (error != cudaSuccess || devices == 0) {
    std::printf("no CUDA device (%s): GPU tests skipped\n",
                error != cudaSuccess ? cudaGetErrorString(error) : "none found");
    return 77;
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
