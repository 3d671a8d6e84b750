// Element-wise sums of gradient buffers: acc[i] += source[i]. One add per element, so the GPU and
// the CPU give the same bits; a caller that adds several sources in a fixed order gets the same
// sum on either.
#pragma once

#include <cstdint>

#include "keel/device_memory.hpp"
#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

// What a buffer's elements are. kInt64 sums wrap modulo 2^64 (fixed-point gradients).
enum class AddType { kFloat32, kFloat64, kInt64 };

// Bytes of one element of `type`.
constexpr int64_t AddTypeBytes(AddType type) { return type == AddType::kFloat32 ? 4 : 8; }

// The elements of the engine's gradient type.
constexpr AddType AddTypeOf(GradientType type) {
  switch (type) {
    case GradientType::kFloat32:
      return AddType::kFloat32;
    case GradientType::kFloat64:
      return AddType::kFloat64;
    case GradientType::kFixedInt64:
      break;
  }
  return AddType::kInt64;
}

namespace cpu {

// acc[i] += source[i] for the num_bytes / AddTypeBytes(type) whole elements; trailing bytes stay
// as they are. Buffers need no alignment and may be the same buffer.
//   acc:    [num_bytes] bytes of `type` elements, updated
//   source: [num_bytes] bytes of `type` elements
Status AddInto(AddType type, void* acc, const void* source, int64_t num_bytes);

}  // namespace cpu

namespace gpu {

// The same on device pointers, enqueued on `stream`. Both pointers must be aligned to the
// element size (cudaMalloc's are); InvalidArgument otherwise.
Status AddInto(AddType type, void* acc, const void* source, int64_t num_bytes, Stream stream);

}  // namespace gpu
}  // namespace keel::kernels
