// CUDA version of kernels/add.h: one thread per element, grid-stride.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/add.h"
#include "kernels/arguments.h"
#include "kernels/cuda_check.h"
#include "kernels/host_device.h"

namespace keel::kernels::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// The element types' own +; the 16-bit types add through kernels/host_device.h, as the CPU does.
struct PlainSum {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Bf16Sum {
  __device__ uint16_t operator()(uint16_t a, uint16_t b) const { return AddBf16(a, b); }
};
struct Fp16Sum {
  __device__ uint16_t operator()(uint16_t a, uint16_t b) const { return AddFp16(a, b); }
};

template <typename T, typename Sum>
__global__ void AddKernel(T* acc, const T* source, int64_t count) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    acc[i] = Sum{}(acc[i], source[i]);
  }
}

template <typename T, typename Sum = PlainSum>
Status Launch(void* acc, const void* source, int64_t count, Stream stream) {
  if (count == 0) return Status::Ok();
  const unsigned blocks = GridSize(count, kThreads, kMaxBlocks);
  AddKernel<T, Sum>
      <<<blocks, kThreads, 0, stream>>>(static_cast<T*>(acc), static_cast<const T*>(source), count);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(AddKernel);
  return Status::Ok();
}

Status CheckAligned(const char* name, const void* pointer, int64_t alignment) {
  if (reinterpret_cast<uintptr_t>(pointer) % static_cast<uintptr_t>(alignment) == 0) {
    return Status::Ok();
  }
  return InvalidArgument(std::string(name) + " is not aligned to its " + std::to_string(alignment) +
                         "-byte elements");
}

}  // namespace

Status AddInto(GradientType type, void* acc, const void* source, int64_t num_bytes, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_bytes", num_bytes));
  const int64_t element = static_cast<int64_t>(GradientElementBytes(type));
  const int64_t count = num_bytes / element;
  KEEL_RETURN_IF_ERROR(CheckPointer("acc", acc, count));
  KEEL_RETURN_IF_ERROR(CheckPointer("source", source, count));
  KEEL_RETURN_IF_ERROR(CheckAligned("acc", acc, element));
  KEEL_RETURN_IF_ERROR(CheckAligned("source", source, element));
  switch (type) {
    case GradientType::kFloat32:
      return Launch<float>(acc, source, count, stream);
    case GradientType::kFloat64:
      return Launch<double>(acc, source, count, stream);
    case GradientType::kFixedInt64:
      return Launch<unsigned long long>(acc, source, count, stream);
    case GradientType::kBFloat16:
      return Launch<uint16_t, Bf16Sum>(acc, source, count, stream);
    case GradientType::kFloat16:
      return Launch<uint16_t, Fp16Sum>(acc, source, count, stream);
  }
  return InvalidArgument("type is not a GradientType");
}

}  // namespace keel::kernels::gpu
