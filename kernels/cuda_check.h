// Internal to kernels/*.cu: turns CUDA error codes into keel::Status at the boundary (naming the
// call, CUDA's error and file:line) and sizes launch grids. Argument checks: kernels/arguments.h.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "keel/status.hpp"

namespace keel::kernels {

inline Status CudaError(cudaError_t error, const char* call, const char* file, int line) {
  return Internal(std::string(call) + " failed: " + cudaGetErrorName(error) + " (" +
                  cudaGetErrorString(error) + ") at " + file + ":" + std::to_string(line));
}

// Returns Internal from the enclosing function when the CUDA call `call` fails.
#define KEEL_CUDA_RETURN_IF_ERROR(call)                                               \
  do {                                                                                \
    const cudaError_t keel_cuda_error_ = (call);                                      \
    if (keel_cuda_error_ != cudaSuccess) {                                            \
      return ::keel::kernels::CudaError(keel_cuda_error_, #call, __FILE__, __LINE__); \
    }                                                                                 \
  } while (0)

// After every `kernel<<<...>>>`: a launch reports bad configurations and missing devices only
// through cudaGetLastError.
#define KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(kernel)                                         \
  do {                                                                                    \
    const cudaError_t keel_cuda_error_ = cudaGetLastError();                              \
    if (keel_cuda_error_ != cudaSuccess) {                                                \
      return ::keel::kernels::CudaError(keel_cuda_error_, "launch of " #kernel, __FILE__, \
                                        __LINE__);                                        \
    }                                                                                     \
  } while (0)

// Blocks for `work` items at `per_block` items each, at least 1 and at most `max_blocks`
// (kernels loop over the rest).
inline unsigned GridSize(int64_t work, int64_t per_block, int64_t max_blocks = 65535) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, max_blocks));
}

}  // namespace keel::kernels
