// Internal to kernels/*.cu: hidden-state rows as the CUDA kernels read them. A row is walked in
// packs of V elements (16 bytes when every row allows it, else one element) and converted to
// float32 with the same helpers as the CPU references (kernels/host_device.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "keel/status.hpp"
#include "kernels/device.h"
#include "kernels/host_device.h"

namespace keel::kernels {

// V elements of a row loaded or stored in one access.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T value[V];
};

__device__ inline float ToFloat(float value) { return value; }
__device__ inline float ToFloat(uint16_t value) { return Bf16ToFloat(value); }

template <typename T>
__device__ T FromFloat(float value) {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else {
    return FloatToBf16(value);
  }
}

// Sum over a warp by xor butterfly: every lane ends with the same bits (each step adds a pair in
// both orders, and float addition commutes), the same on every run.
__device__ inline float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Calls launch(T{}, std::integral_constant<int, V>{}) with T the element type of `dtype` (float,
// or uint16_t for bf16) and V the elements per access: 16 bytes when `hidden` and every buffer's
// address allow it, else one element.
template <typename Launch>
Status DispatchRows(DType dtype, int64_t hidden, std::initializer_list<const void*> buffers,
                    const Launch& launch) {
  bool aligned = true;
  for (const void* buffer : buffers) {
    aligned = aligned && reinterpret_cast<uintptr_t>(buffer) % 16 == 0;
  }
  if (dtype == DType::kFloat32) {
    if (aligned && hidden % 4 == 0) return launch(float{}, std::integral_constant<int, 4>{});
    return launch(float{}, std::integral_constant<int, 1>{});
  }
  if (aligned && hidden % 8 == 0) return launch(uint16_t{}, std::integral_constant<int, 8>{});
  return launch(uint16_t{}, std::integral_constant<int, 1>{});
}

}  // namespace keel::kernels
