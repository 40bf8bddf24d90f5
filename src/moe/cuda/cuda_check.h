// CUDA_CHECK(expr): a failed CUDA runtime call becomes a Status naming the file, the line,
// the expression and CUDA's message. For functions that return Status.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "epmoe/status.h"

namespace epmoe {

inline Status cuda_error(cudaError_t error, const char* expression, const char* file, int line) {
  std::string message = file;
  message += ":" + std::to_string(line) + ": ";
  message += expression;
  message += " failed: ";
  message += cudaGetErrorString(error);
  return {StatusCode::kInternal, message};
}

}  // namespace epmoe

#define CUDA_CHECK(expr)                                                                      \
  do {                                                                                        \
    const cudaError_t epmoe_cuda_error_ = (expr);                                             \
    if (epmoe_cuda_error_ != cudaSuccess)                                                     \
      return ::epmoe::cuda_error(epmoe_cuda_error_, #expr, __FILE__, __LINE__);               \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
