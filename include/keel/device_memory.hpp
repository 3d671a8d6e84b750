// Device memory as Keel sees it: which buffers live on the GPU, and the few things the engine and
// migration do to them besides sending them: allocate them, copy them, add gradients into them,
// checksum them, and stage them through page-locked host memory for a transport that moves host
// memory only. The CPU never reads or writes device memory itself; everything goes through this
// interface. Implementations: CreateCudaDeviceMemory (a GPU), CreateGuardedHostMemory (tests
// without one: host memory that traps every direct CPU access) and CreateHostMemory (plain host
// memory, what the engine uses for host buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "keel/status.hpp"

namespace keel {

// How gradient buffers are added. Sums always run in the same fixed order (home first, then the
// other copies by ascending slot, then this step's transient replicas), so a given placement
// always gives the same bits. kFixedInt64 (gradients as int64 fixed point, sums wrapping modulo
// 2^64) is order-independent too: training is then bitwise identical under every placement.
// kBFloat16 and kFloat16 (IEEE half) are what trainers keep in bf16 and fp16: each add widens
// both elements to float32, adds once and rounds to nearest even, and a NaN sum is the type's
// canonical quiet NaN, so the CPU and the GPU give the same bits. New types are appended: the
// values are the C API's KEEL_GRADIENT_* numbers.
enum class GradientType { kFloat32, kFloat64, kFixedInt64, kBFloat16, kFloat16 };

// Bytes of one gradient element of `type`.
constexpr size_t GradientElementBytes(GradientType type) {
  switch (type) {
    case GradientType::kFloat32:
      return 4;
    case GradientType::kBFloat16:
    case GradientType::kFloat16:
      return 2;
    case GradientType::kFloat64:
    case GradientType::kFixedInt64:
      break;
  }
  return 8;
}

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // True when `data` points into device memory (the CPU must not touch it); false for every
  // other pointer, null included.
  virtual bool IsDeviceMemory(const void* data) = 0;

  // [bytes] of device memory (contents undefined); give it back with FreeDevice.
  virtual Result<std::byte*> AllocateDevice(size_t bytes) = 0;
  virtual void FreeDevice(std::byte* data) = 0;

  // [bytes] of page-locked host memory, which device copies read and write at full speed; give
  // it back with FreeHost.
  virtual Result<std::byte*> AllocateHost(size_t bytes) = 0;
  virtual void FreeHost(std::byte* data) = 0;

  // Starts copying `bytes` bytes from `source` to `destination` (device or host memory, in any
  // combination) and returns its number: 0 for the first operation, then 1, 2... Operations
  // (copies and adds) complete in the order they started. Both buffers must stay valid until the
  // copy completed.
  virtual Result<uint64_t> StartCopy(std::byte* destination, const std::byte* source,
                                     size_t bytes) = 0;
  // Starts acc[i] += source[i] over the `bytes` bytes of `type` elements of two device buffers
  // (kernels::gpu::AddInto; one add per element, so the bits equal the CPU's) and returns its
  // number, counted with the copies.
  virtual Result<uint64_t> StartAdd(GradientType type, std::byte* acc, const std::byte* source,
                                    size_t bytes) = 0;
  // How many started operations have completed, or the error that stopped this device's work (a
  // CUDA error; after it nothing completes).
  virtual Result<uint64_t> CompletedCopies() = 0;

  // The kernels::cpu::Checksum64 of `bytes` bytes of device memory at `data`, computed on the
  // device after every operation started before; blocks until it is known.
  virtual Result<uint64_t> Checksum(const std::byte* data, size_t bytes) = 0;

  // StartCopy / StartAdd, then waits until that operation completed.
  Status Copy(std::byte* destination, const std::byte* source, size_t bytes);
  Status Add(GradientType type, std::byte* acc, const std::byte* source, size_t bytes);
  // Waits until operation `number` (a StartCopy or StartAdd result) completed.
  Status WaitFor(uint64_t number);
};

// CUDA device `device` (< 0: the device current on the calling thread); every call makes it
// current on its thread. IsDeviceMemory asks cudaPointerGetAttributes (device and managed memory
// count); copies and adds run on a non-blocking stream of its own, one event each;
// AllocateDevice is cudaMalloc, AllocateHost cudaHostAlloc; Checksum runs
// kernels::gpu::SlotChecksums. FailedPrecondition without a usable CUDA device, Unimplemented in
// builds without CUDA.
Result<std::shared_ptr<DeviceMemory>> CreateCudaDeviceMemory(int device = -1);

// Device memory for machines without a GPU, which behaves like a GPU's towards the CPU: each
// AllocateDevice is a memory file mapped twice, once inaccessible (PROT_NONE: the address callers
// get, so any host read or write of it crashes the process with SIGSEGV) and once read-write,
// used only inside this object's own calls, which translate addresses. Copies and adds use the
// kernels' CPU references, so the bits are those a GPU gives. Operations complete synchronously.
Result<std::shared_ptr<DeviceMemory>> CreateGuardedHostMemory();

// Plain host memory behind the same interface: IsDeviceMemory is always false, copies are
// memcpy, adds the kernels' CPU references, AllocateDevice and AllocateHost are operator new.
std::shared_ptr<DeviceMemory> CreateHostMemory();

}  // namespace keel
