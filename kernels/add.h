// Element-wise sums of gradient buffers: acc[i] += source[i]. One add per element, so the GPU and
// the CPU give the same bits; a caller that adds several sources in a fixed order gets the same
// sum on either. bf16 and fp16 elements add in float32 and round once (AddBf16 and AddFp16 in
// kernels/host_device.h, shared by both).
#pragma once

#include <cstdint>

#include "keel/device_memory.hpp"  // GradientType
#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

namespace cpu {

// acc[i] += source[i] for the num_bytes / GradientElementBytes(type) whole elements (kFixedInt64
// sums wrap modulo 2^64; kBFloat16 and kFloat16 sums round to nearest even, and a NaN sum is the
// type's canonical quiet NaN); trailing bytes stay as they are. Buffers need no alignment and may
// be the same buffer.
//   acc:    [num_bytes] bytes of `type` elements, updated
//   source: [num_bytes] bytes of `type` elements
Status AddInto(GradientType type, void* acc, const void* source, int64_t num_bytes);

}  // namespace cpu

namespace gpu {

// The same on device pointers, enqueued on `stream`. Both pointers must be aligned to the
// element size (cudaMalloc's are); InvalidArgument otherwise.
Status AddInto(GradientType type, void* acc, const void* source, int64_t num_bytes, Stream stream);

}  // namespace gpu
}  // namespace keel::kernels
