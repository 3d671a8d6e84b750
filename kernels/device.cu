// GpuAvailable() for builds with CUDA (kernels/device.cc has the one for builds without).
#include <cuda_runtime.h>

#include "kernels/device.h"

namespace keel::kernels {

bool GpuAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // Clear the error so that the next launch check does not report it as its own.
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

}  // namespace keel::kernels
