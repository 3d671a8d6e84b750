// GpuAvailable() for builds without CUDA; kernels/device.cu defines it when CUDA is on.
#include "kernels/device.h"

namespace keel::kernels {

#if !KEEL_KERNELS_CUDA
bool GpuAvailable() { return false; }
#endif

}  // namespace keel::kernels
