// CPU reference of kernels/add.h.
#include "kernels/add.h"

#include <cstring>

#include "kernels/arguments.h"
#include "kernels/host_device.h"

namespace keel::kernels::cpu {
namespace {

// The element types' own +; the 16-bit types add through kernels/host_device.h, as the GPU does.
struct PlainSum {
  template <typename T>
  T operator()(T a, T b) const {
    return a + b;
  }
};
struct Bf16Sum {
  uint16_t operator()(uint16_t a, uint16_t b) const { return AddBf16(a, b); }
};
struct Fp16Sum {
  uint16_t operator()(uint16_t a, uint16_t b) const { return AddFp16(a, b); }
};

// memcpy in and out: the buffers are plain bytes, with no promise of alignment.
template <typename T, typename Sum = PlainSum>
void AddElements(std::byte* acc, const std::byte* source, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    T a;
    T b;
    std::memcpy(&a, acc + i * sizeof(T), sizeof(T));
    std::memcpy(&b, source + i * sizeof(T), sizeof(T));
    a = Sum{}(a, b);
    std::memcpy(acc + i * sizeof(T), &a, sizeof(T));
  }
}

}  // namespace

Status AddInto(GradientType type, void* acc, const void* source, int64_t num_bytes) {
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_bytes", num_bytes));
  const int64_t count = num_bytes / static_cast<int64_t>(GradientElementBytes(type));
  KEEL_RETURN_IF_ERROR(CheckPointer("acc", acc, count));
  KEEL_RETURN_IF_ERROR(CheckPointer("source", source, count));
  auto* a = static_cast<std::byte*>(acc);
  const auto* s = static_cast<const std::byte*>(source);
  switch (type) {
    case GradientType::kFloat32:
      AddElements<float>(a, s, count);
      break;
    case GradientType::kFloat64:
      AddElements<double>(a, s, count);
      break;
    case GradientType::kFixedInt64:  // unsigned: wraps instead of overflowing
      AddElements<uint64_t>(a, s, count);
      break;
    case GradientType::kBFloat16:
      AddElements<uint16_t, Bf16Sum>(a, s, count);
      break;
    case GradientType::kFloat16:
      AddElements<uint16_t, Fp16Sum>(a, s, count);
      break;
  }
  return Status::Ok();
}

}  // namespace keel::kernels::cpu
