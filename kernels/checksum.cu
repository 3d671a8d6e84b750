// CUDA version of SlotChecksums (kernels/checksum.h). Threads sum the per-word terms of a slot,
// each warp adds its sum into checksums[slot] (zeroed first), and a second kernel applies
// ChecksumFinish in place. Sums mod 2^64 are exact in any order, so the value equals the CPU's.
#include <cuda_runtime.h>

#include <string>

#include "kernels/arguments.h"
#include "kernels/checksum.h"
#include "kernels/cuda_check.h"
#include "kernels/host_device.h"

namespace keel::kernels::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWordsPerThread = 16;
constexpr int64_t kMaxBlocksPerSlot = int64_t{1} << 20;
constexpr int64_t kMaxSlotsPerLaunch = 65535;  // gridDim.y

static_assert(sizeof(unsigned long long) == sizeof(uint64_t));

// Word `index` of a slot: 8 little-endian bytes, the last partial word zero-padded. `aligned`
// says whether whole words may be read as one 8-byte load.
__device__ uint64_t LoadWord(const unsigned char* slot, int64_t slot_bytes, int64_t index,
                             bool aligned) {
  const int64_t first = index * 8;
  if (aligned && first + 8 <= slot_bytes) return *reinterpret_cast<const uint64_t*>(slot + first);
  const int64_t end = min(first + 8, slot_bytes);
  uint64_t word = 0;
  for (int64_t b = first; b < end; ++b) word |= uint64_t{slot[b]} << (8 * (b - first));
  return word;
}

__global__ void SumSlotTerms(const unsigned char* base, int64_t num_slots, int64_t slot_bytes,
                             int64_t stride_bytes, uint64_t seed, bool aligned,
                             unsigned long long* sums) {
  const int64_t num_words = (slot_bytes + 7) / 8;
  const int64_t word_stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t s = blockIdx.y; s < num_slots; s += gridDim.y) {
    const unsigned char* slot = base + s * stride_bytes;
    uint64_t sum = 0;
#pragma unroll 4
    for (int64_t w = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < num_words;
         w += word_stride) {
      sum += ChecksumTerm(LoadWord(slot, slot_bytes, w, aligned), w, seed);
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x % 32 == 0 && sum != 0) atomicAdd(&sums[s], sum);
  }
}

__global__ void FinishChecksums(unsigned long long* checksums, int64_t num_slots,
                                int64_t slot_bytes, uint64_t seed) {
  for (int64_t s = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; s < num_slots;
       s += int64_t{gridDim.x} * blockDim.x) {
    checksums[s] = ChecksumFinish(checksums[s], static_cast<uint64_t>(slot_bytes), seed);
  }
}

}  // namespace

Status SlotChecksums(const void* base, int64_t num_slots, int64_t slot_bytes, int64_t stride_bytes,
                     uint64_t seed, uint64_t* checksums, Stream stream) {
  KEEL_RETURN_IF_ERROR(
      CheckSlotChecksumArguments(base, num_slots, slot_bytes, stride_bytes, checksums));
  if (num_slots == 0) return Status::Ok();

  auto* sums = reinterpret_cast<unsigned long long*>(checksums);
  KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sums, 0, sizeof(uint64_t) * num_slots, stream));
  const int64_t num_words = (slot_bytes + 7) / 8;
  if (num_words > 0) {
    // Every slot starts on an 8-byte boundary only if the base and the stride allow it.
    const bool aligned =
        reinterpret_cast<uintptr_t>(base) % 8 == 0 && (stride_bytes % 8 == 0 || num_slots == 1);
    const dim3 grid(GridSize(num_words, kThreads * kWordsPerThread, kMaxBlocksPerSlot),
                    GridSize(num_slots, 1, kMaxSlotsPerLaunch));
    SumSlotTerms<<<grid, kThreads, 0, stream>>>(static_cast<const unsigned char*>(base), num_slots,
                                                slot_bytes, stride_bytes, seed, aligned, sums);
    KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(SumSlotTerms);
  }
  FinishChecksums<<<GridSize(num_slots, kThreads, 1024), kThreads, 0, stream>>>(sums, num_slots,
                                                                                slot_bytes, seed);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(FinishChecksums);
  return Status::Ok();
}

}  // namespace keel::kernels::gpu
