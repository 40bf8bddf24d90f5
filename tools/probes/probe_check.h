// The probes' CUDA check (tools/probes/*_probe.cu): the failing call, where, and the runtime's
// reason, then exit.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define PROBE_CHECK(call)                                                                                 \
  do {                                                                                                    \
    const cudaError_t probe_error = (call);                                                               \
    if (probe_error != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(probe_error)); \
      std::exit(1);                                                                                       \
    }                                                                                                     \
  } while (0)
