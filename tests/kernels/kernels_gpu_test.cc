// The CUDA kernels (keel::kernels::gpu) against their CPU references (keel::kernels::cpu) on fresh
// random inputs. Device outputs are poisoned before every run (0xFF, then a second pattern, since
// -1 is a legitimate slot and position), and results must equal the reference bit for bit, except
// UnpermuteCombineBackward's weight gradients (float32 tolerance, as permute.h says). Condensation
// inputs keep every cosine far from the threshold, so rounding cannot flip a decision.
#include <gtest/gtest.h>

#if KEEL_KERNELS_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/add.h"
#include "kernels/checksum.h"
#include "kernels/condense.h"
#include "kernels/device.h"
#include "kernels/histogram.h"
#include "kernels/host_device.h"
#include "kernels/permute.h"
#include "kernels/remap.h"

namespace keel::kernels {
namespace {

constexpr unsigned char kPoisons[] = {0xff, 0x5a};

#define ASSERT_OK(expr)                                        \
  do {                                                         \
    const ::keel::Status keel_status_ = (expr);                \
    ASSERT_TRUE(keel_status_.ok()) << keel_status_.ToString(); \
  } while (0)

#define ASSERT_CUDA(call)                                                                    \
  do {                                                                                       \
    const cudaError_t keel_error_ = (call);                                                  \
    ASSERT_EQ(keel_error_, cudaSuccess) << #call << ": " << cudaGetErrorString(keel_error_); \
  } while (0)

// A fresh seed per case, printed on failure so that the case can be replayed.
uint64_t FreshSeed() {
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

class CudaStream {
 public:
  CudaStream() {
    if (cudaStreamCreate(&stream_) != cudaSuccess) ADD_FAILURE() << "cudaStreamCreate failed";
  }
  ~CudaStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Stream get() const { return stream_; }
  // Waits for the work enqueued so far; kernel faults surface here.
  cudaError_t Sync() const { return cudaStreamSynchronize(stream_); }

 private:
  cudaStream_t stream_ = nullptr;
};

// `count` elements of T in device memory, starting `offset` elements into the allocation (to test
// addresses that are not 16-byte aligned). Uploads and downloads are synchronous.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count, size_t offset = 0) : count_(count), offset_(offset) {
    if (cudaMalloc(&allocation_, (count + offset) * sizeof(T) + 1) != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc of " << (count + offset) * sizeof(T) << " bytes failed";
      allocation_ = nullptr;
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host, size_t offset = 0)
      : DeviceBuffer(host.size(), offset) {
    Upload(host);
  }
  ~DeviceBuffer() {
    if (allocation_ != nullptr) cudaFree(allocation_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(allocation_) + offset_; }
  size_t size() const { return count_; }

  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), count_);
    ASSERT_CUDA(cudaMemcpy(get(), host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  void Fill(unsigned char byte) { ASSERT_CUDA(cudaMemset(get(), byte, count_ * sizeof(T))); }
  std::vector<T> Download() const {
    std::vector<T> host(count_);
    const cudaError_t error =
        cudaMemcpy(host.data(), get(), count_ * sizeof(T), cudaMemcpyDeviceToHost);
    EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
    return host;
  }

 private:
  void* allocation_ = nullptr;
  size_t count_;
  size_t offset_;
};

// Element-wise bit equality (so NaN poison left behind counts as a difference).
template <typename T>
void ExpectSameBits(const std::vector<T>& want, const std::vector<T>& got, const char* what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  size_t mismatches = 0;
  size_t first = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(T)) != 0 && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << what << ": " << mismatches << " of " << want.size()
                            << " elements differ; first at " << first << ": want " << +want[first]
                            << ", got " << +got[first];
}

// Rows of `dtype` as raw bytes (bf16 = uint16_t), so both dtypes share one code path.
using Bytes = std::vector<unsigned char>;

float RowElement(const Bytes& rows, DType dtype, int64_t index) {
  if (dtype == DType::kFloat32) {
    float value;
    std::memcpy(&value, rows.data() + 4 * index, 4);
    return value;
  }
  uint16_t value;
  std::memcpy(&value, rows.data() + 2 * index, 2);
  return Bf16ToFloat(value);
}

void SetRowElement(Bytes& rows, DType dtype, int64_t index, float value) {
  if (dtype == DType::kFloat32) {
    std::memcpy(rows.data() + 4 * index, &value, 4);
  } else {
    const uint16_t bf16 = FloatToBf16(value);
    std::memcpy(rows.data() + 2 * index, &bf16, 2);
  }
}

Bytes RandomRows(int64_t elements, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  Bytes rows(elements * DTypeBytes(dtype));
  for (int64_t i = 0; i < elements; ++i) SetRowElement(rows, dtype, i, value(rng));
  return rows;
}

void ExpectSameRows(const Bytes& want, const Bytes& got, DType dtype, const char* what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  const int64_t elements = static_cast<int64_t>(want.size()) / DTypeBytes(dtype);
  int64_t mismatches = 0;
  int64_t first = 0;
  for (int64_t i = 0; i < elements; ++i) {
    const size_t at = i * DTypeBytes(dtype);
    if (std::memcmp(want.data() + at, got.data() + at, DTypeBytes(dtype)) != 0 &&
        mismatches++ == 0) {
      first = i;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": " << mismatches << " of " << elements
                           << " elements differ; first at " << first << ": want "
                           << RowElement(want, dtype, first) << ", got "
                           << RowElement(got, dtype, first);
}

const char* DTypeName(DType dtype) { return dtype == DType::kFloat32 ? "fp32" : "bf16"; }

// Router output over `num_ids` ids: ~8% unused (-1), ~4% invalid, the rest skewed towards a few
// hot ids so that quotas overflow and tokens repeat ranks.
template <typename Id>
std::vector<Id> RandomIds(int64_t count, int num_ids, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> percent(0, 99);
  std::uniform_int_distribution<int> small(0, 5);
  std::vector<Id> ids(count);
  for (Id& id : ids) {
    const int roll = percent(rng);
    if (roll < 8 || (num_ids == 0 && roll < 50)) {
      id = -1;
    } else if (roll < 12 || num_ids == 0) {
      id = roll % 2 == 0 ? static_cast<Id>(num_ids + small(rng)) : static_cast<Id>(-2 - small(rng));
    } else {
      const int hot = std::min(num_ids, 8);
      id = static_cast<Id>(roll < 50 ? rng() % hot : rng() % num_ids);
    }
  }
  return ids;
}

// ---- Histograms

// One histogram on the GPU against the CPU reference, through `workspace` (zero-filled once by the
// caller, as histogram.h asks; the call must leave it ready for the next).
template <typename Id>
void CheckExpertHistogram(int64_t num_entries, int num_experts,
                          DeviceBuffer<unsigned char>& workspace, const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "sizeof(Id) " << sizeof(Id) << " num_entries " << num_entries
                                    << " num_experts " << num_experts << " seed " << seed);
  ASSERT_GE(static_cast<int64_t>(workspace.size()), gpu::HistogramWorkspaceBytes(num_experts));
  std::mt19937_64 rng(seed);
  const std::vector<Id> ids = RandomIds<Id>(num_entries, num_experts, rng);
  std::vector<int32_t> counts(num_experts);
  std::vector<int32_t> invalid(1);
  ASSERT_OK(
      cpu::ExpertHistogram(ids.data(), num_entries, num_experts, counts.data(), invalid.data()));

  DeviceBuffer<Id> device_ids(ids);
  DeviceBuffer<int32_t> device_counts(num_experts);
  DeviceBuffer<int32_t> device_invalid(1);
  for (unsigned char poison : kPoisons) {
    device_counts.Fill(poison);
    device_invalid.Fill(poison);
    ASSERT_OK(gpu::ExpertHistogram(device_ids.get(), num_entries, num_experts, device_counts.get(),
                                   device_invalid.get(), workspace.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameBits(counts, device_counts.Download(), "counts");
    ExpectSameBits(invalid, device_invalid.Download(), "invalid");
  }
}

TEST(KernelsGpuTest, ExpertHistogramMatchesCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  // 13000 experts do not fit in shared memory: the kernel counts in the workspace instead.
  for (int num_experts : {0, 1, 5, 256, 13000}) {
    DeviceBuffer<unsigned char> workspace(gpu::HistogramWorkspaceBytes(num_experts));
    workspace.Fill(0);
    for (int64_t num_entries : {0, 1, 7, 1000, 65539}) {
      CheckExpertHistogram<int32_t>(num_entries, num_experts, workspace, stream);
      CheckExpertHistogram<int64_t>(num_entries, num_experts, workspace, stream);
    }
  }
}

// One workspace, zero-filled once, serves calls of every size and expert count up to the one it
// was sized for, in any order: each call leaves it zeroed.
TEST(KernelsGpuTest, HistogramWorkspaceServesManyCalls) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  const std::pair<int64_t, int> calls[] = {{65536, 256}, {5000, 13000}, {1, 7},   {65536, 256},
                                           {300001, 64}, {0, 256},      {257, 1}, {65536, 256}};
  DeviceBuffer<unsigned char> workspace(gpu::HistogramWorkspaceBytes(13000));
  workspace.Fill(0);
  for (int round = 0; round < 3; ++round) {
    for (const auto& [num_entries, num_experts] : calls) {
      CheckExpertHistogram<int32_t>(num_entries, num_experts, workspace, stream);
    }
  }
}

template <typename Id>
void CheckRankHistogram(int64_t num_tokens, int top_k, int num_ids, int num_ranks,
                        const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message()
               << "sizeof(Id) " << sizeof(Id) << " num_tokens " << num_tokens << " top_k " << top_k
               << " num_ids " << num_ids << " num_ranks " << num_ranks << " seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<Id> ids = RandomIds<Id>(num_tokens * top_k, num_ids, rng);
  std::vector<int32_t> rank_of(num_ids);
  for (int32_t& rank : rank_of) rank = static_cast<int32_t>(rng() % num_ranks);
  std::vector<int32_t> entries(num_ranks);
  std::vector<int32_t> tokens(num_ranks);
  std::vector<int32_t> invalid(1);
  ASSERT_OK(cpu::RankHistogram(ids.data(), num_tokens, top_k, rank_of.data(), num_ids, num_ranks,
                               entries.data(), tokens.data(), invalid.data()));

  DeviceBuffer<Id> device_ids(ids);
  DeviceBuffer<int32_t> device_rank_of(rank_of);
  DeviceBuffer<int32_t> device_entries(num_ranks);
  DeviceBuffer<int32_t> device_tokens(num_ranks);
  DeviceBuffer<int32_t> device_invalid(1);
  for (unsigned char poison : kPoisons) {
    device_entries.Fill(poison);
    device_tokens.Fill(poison);
    device_invalid.Fill(poison);
    ASSERT_OK(gpu::RankHistogram(device_ids.get(), num_tokens, top_k, device_rank_of.get(), num_ids,
                                 num_ranks, device_entries.get(), device_tokens.get(),
                                 device_invalid.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameBits(entries, device_entries.Download(), "entries");
    ExpectSameBits(tokens, device_tokens.Download(), "tokens");
    ExpectSameBits(invalid, device_invalid.Download(), "invalid");
  }
}

TEST(KernelsGpuTest, RankHistogramMatchesCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  struct Shape {
    int num_ids;
    int num_ranks;
  };
  // 7000 ranks do not fit in shared memory (two bins each): global-memory counting.
  for (const Shape shape : {Shape{1, 1}, Shape{40, 3}, Shape{256, 64}, Shape{300, 7000}}) {
    for (int top_k : {1, 3, 8}) {
      for (int64_t num_tokens : {0, 1, 5, 333, 8192}) {
        CheckRankHistogram<int32_t>(num_tokens, top_k, shape.num_ids, shape.num_ranks, stream);
        CheckRankHistogram<int64_t>(num_tokens, top_k, shape.num_ids, shape.num_ranks, stream);
      }
    }
  }
}

// ---- Remap with quotas

struct HostQuotas {
  std::vector<int32_t> copy_begin{0};
  std::vector<int32_t> copy_slot;
  std::vector<int32_t> copy_quota;
  std::vector<int32_t> slot_rank;
  int num_ranks = 0;

  QuotaTable Table(const int32_t* begin, const int32_t* slot, const int32_t* quota,
                   const int32_t* rank) const {
    QuotaTable table;
    table.copy_begin = begin;
    table.copy_slot = slot;
    table.copy_quota = quota;
    table.slot_rank = rank;
    table.num_experts = static_cast<int>(copy_begin.size()) - 1;
    table.num_copies = static_cast<int>(copy_slot.size());
    table.num_slots = static_cast<int>(slot_rank.size());
    table.num_ranks = num_ranks;
    return table;
  }
};

// Experts with 0 to 5 copies (some with none), quotas from 0 to 30 (zeros included).
HostQuotas RandomQuotas(int num_experts, int num_ranks, std::mt19937_64& rng) {
  HostQuotas quotas;
  quotas.num_ranks = num_ranks;
  const int num_slots = num_experts + 7;
  for (int e = 0; e < num_experts; ++e) {
    const int roll = static_cast<int>(rng() % 20);
    const int copies = roll < 2 ? 0 : roll < 10 ? 1 : roll < 16 ? 2 : roll < 19 ? 3 : 5;
    for (int c = 0; c < copies; ++c) {
      quotas.copy_slot.push_back(static_cast<int32_t>(rng() % num_slots));
      quotas.copy_quota.push_back(rng() % 5 == 0 ? 0 : static_cast<int32_t>(1 + rng() % 30));
    }
    quotas.copy_begin.push_back(static_cast<int32_t>(quotas.copy_slot.size()));
  }
  for (int s = 0; s < num_slots; ++s) {
    quotas.slot_rank.push_back(static_cast<int32_t>(rng() % num_ranks));
  }
  return quotas;
}

// One remap on the GPU against the CPU reference, through `workspace` (zero-filled once by the
// caller, as remap.h asks; the call must leave it ready for the next).
template <typename Id>
void CheckRemap(int64_t num_entries, int num_experts, int num_ranks,
                DeviceBuffer<unsigned char>& workspace, const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message()
               << "sizeof(Id) " << sizeof(Id) << " num_entries " << num_entries << " num_experts "
               << num_experts << " num_ranks " << num_ranks << " seed " << seed);
  ASSERT_GE(static_cast<int64_t>(workspace.size()),
            gpu::RemapWorkspaceBytes(num_entries, num_experts));
  std::mt19937_64 rng(seed);
  const HostQuotas quotas = RandomQuotas(num_experts, num_ranks, rng);
  const std::vector<Id> ids = RandomIds<Id>(num_entries, num_experts, rng);
  std::vector<int32_t> slot(num_entries);
  std::vector<int32_t> send_counts(num_ranks);
  std::vector<int32_t> invalid(1);
  ASSERT_OK(cpu::RemapWithQuotas(ids.data(), num_entries,
                                 quotas.Table(quotas.copy_begin.data(), quotas.copy_slot.data(),
                                              quotas.copy_quota.data(), quotas.slot_rank.data()),
                                 slot.data(), send_counts.data(), invalid.data()));

  DeviceBuffer<int32_t> copy_begin(quotas.copy_begin);
  DeviceBuffer<int32_t> copy_slot(quotas.copy_slot);
  DeviceBuffer<int32_t> copy_quota(quotas.copy_quota);
  DeviceBuffer<int32_t> slot_rank(quotas.slot_rank);
  const QuotaTable device_table =
      quotas.Table(copy_begin.get(), copy_slot.get(), copy_quota.get(), slot_rank.get());
  DeviceBuffer<Id> device_ids(ids);
  DeviceBuffer<int32_t> device_slot(num_entries);
  DeviceBuffer<int32_t> device_send_counts(num_ranks);
  DeviceBuffer<int32_t> device_invalid(1);
  for (unsigned char poison : kPoisons) {
    device_slot.Fill(poison);
    device_send_counts.Fill(poison);
    device_invalid.Fill(poison);
    ASSERT_OK(gpu::RemapWithQuotas(device_ids.get(), num_entries, device_table, device_slot.get(),
                                   device_send_counts.get(), device_invalid.get(), workspace.get(),
                                   stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameBits(slot, device_slot.Download(), "slot");
    ExpectSameBits(send_counts, device_send_counts.Download(), "send_counts");
    ExpectSameBits(invalid, device_invalid.Download(), "invalid");
  }
}

template <typename Id>
void CheckRemap(int64_t num_entries, int num_experts, int num_ranks, const CudaStream& stream) {
  DeviceBuffer<unsigned char> workspace(gpu::RemapWorkspaceBytes(num_entries, num_experts));
  workspace.Fill(0);
  CheckRemap<Id>(num_entries, num_experts, num_ranks, workspace, stream);
}

TEST(KernelsGpuTest, RemapWithQuotasMatchesCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  // Up to 1024 experts rank in one launch; 1025 and 13000 take three passes, and 13000 do not fit
  // in shared memory, so their running counters stay in the workspace.
  for (int num_experts : {0, 1, 7, 256, 1024, 1025, 13000}) {
    for (int64_t num_entries : {0, 1, 31, 33, 257, 5000, 65543}) {
      CheckRemap<int32_t>(num_entries, num_experts, 64, stream);
      CheckRemap<int64_t>(num_entries, num_experts, 5, stream);
    }
  }
  // More entries than 128 blocks of 2048: each warp of the one launch walks several chunks.
  CheckRemap<int32_t>(300001, 256, 64, stream);
}

// One workspace, zero-filled once, serves calls of every size in any order, whichever path each
// takes: each call leaves it ready for the next.
TEST(KernelsGpuTest, RemapWorkspaceServesManyCalls) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  const std::pair<int64_t, int> calls[] = {{65536, 256}, {5000, 256},   {65536, 2000},
                                           {1, 7},       {300001, 256}, {65536, 256},
                                           {257, 1024},  {65536, 256}};
  int64_t bytes = 0;
  for (const auto& [num_entries, num_experts] : calls) {
    bytes = std::max(bytes, gpu::RemapWorkspaceBytes(num_entries, num_experts));
  }
  DeviceBuffer<unsigned char> workspace(bytes);
  workspace.Fill(0);
  for (int round = 0; round < 3; ++round) {
    for (const auto& [num_entries, num_experts] : calls) {
      CheckRemap<int32_t>(num_entries, num_experts, 64, workspace, stream);
    }
  }
}

// ---- Permutation index

void CheckPermutationIndex(int64_t num_entries, int num_slots, int num_buckets,
                           const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "num_entries " << num_entries << " num_slots " << num_slots
                                    << " num_buckets " << num_buckets << " seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> bucket_of_slot(num_slots);
  for (int32_t& bucket : bucket_of_slot) bucket = static_cast<int32_t>(rng() % num_buckets);
  const std::vector<int32_t> slot = RandomIds<int32_t>(num_entries, num_slots, rng);
  std::vector<int32_t> position(num_entries);
  std::vector<int32_t> bucket_begin(num_buckets + 1);
  std::vector<int32_t> invalid(1);
  ASSERT_OK(cpu::PermutationIndex(slot.data(), num_entries, bucket_of_slot.data(), num_slots,
                                  num_buckets, position.data(), bucket_begin.data(),
                                  invalid.data()));

  DeviceBuffer<int32_t> device_slot(slot);
  DeviceBuffer<int32_t> device_bucket_of_slot(bucket_of_slot);
  DeviceBuffer<int32_t> device_position(num_entries);
  DeviceBuffer<int32_t> device_bucket_begin(num_buckets + 1);
  DeviceBuffer<int32_t> device_invalid(1);
  DeviceBuffer<unsigned char> workspace(gpu::PermutationWorkspaceBytes(num_entries, num_buckets));
  for (unsigned char poison : kPoisons) {
    device_position.Fill(poison);
    device_bucket_begin.Fill(poison);
    device_invalid.Fill(poison);
    workspace.Fill(poison);
    ASSERT_OK(gpu::PermutationIndex(device_slot.get(), num_entries, device_bucket_of_slot.get(),
                                    num_slots, num_buckets, device_position.get(),
                                    device_bucket_begin.get(), device_invalid.get(),
                                    workspace.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameBits(position, device_position.Download(), "position");
    ExpectSameBits(bucket_begin, device_bucket_begin.Download(), "bucket_begin");
    ExpectSameBits(invalid, device_invalid.Download(), "invalid");
  }
}

TEST(KernelsGpuTest, PermutationIndexMatchesCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  struct Shape {
    int num_slots;
    int num_buckets;
  };
  for (const Shape shape :
       {Shape{0, 1}, Shape{1, 1}, Shape{5, 3}, Shape{288, 64}, Shape{300, 300}, Shape{20, 13000}}) {
    for (int64_t num_entries : {0, 1, 31, 33, 257, 5000, 65543}) {
      CheckPermutationIndex(num_entries, shape.num_slots, shape.num_buckets, stream);
    }
  }
}

// ---- Permute, unpermute-combine and their backward

struct RowCase {
  DType dtype;
  int64_t num_tokens;
  int top_k;
  int64_t hidden;
  int misalign;  // elements by which every row buffer is shifted (1: no 16-byte accesses)
};

// Positions from a random routing (some entries unrouted), as the engine builds them, plus three
// rows at the end that no entry maps to.
struct Routing {
  std::vector<int32_t> position;
  int64_t num_rows = 0;
};

Routing RandomRouting(int64_t num_entries, std::mt19937_64& rng) {
  constexpr int kSlots = 6;
  const std::vector<int32_t> bucket_of_slot{3, 0, 2, 1, 0, 3};
  std::vector<int32_t> slot(num_entries);
  for (int32_t& s : slot) s = rng() % 7 == 0 ? -1 : static_cast<int32_t>(rng() % kSlots);
  Routing routing;
  routing.position.resize(num_entries);
  std::vector<int32_t> bucket_begin(5);
  int32_t invalid = 0;
  EXPECT_TRUE(cpu::PermutationIndex(slot.data(), num_entries, bucket_of_slot.data(), kSlots, 4,
                                    routing.position.data(), bucket_begin.data(), &invalid)
                  .ok());
  routing.num_rows = bucket_begin[4] + 3;
  return routing;
}

std::vector<float> RandomWeights(int64_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> weight(-1.0f, 1.0f);
  std::vector<float> weights(count);
  for (float& w : weights) w = weight(rng);
  return weights;
}

void CheckRowKernels(const RowCase& c, const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message()
               << DTypeName(c.dtype) << " num_tokens " << c.num_tokens << " top_k " << c.top_k
               << " hidden " << c.hidden << " misalign " << c.misalign << " seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t num_entries = c.num_tokens * c.top_k;
  const Routing routing = RandomRouting(num_entries, rng);
  const int64_t num_rows = routing.num_rows;
  const int32_t* position = routing.position.data();
  const size_t shift = c.misalign * DTypeBytes(c.dtype);
  const Bytes tokens = RandomRows(c.num_tokens * c.hidden, c.dtype, rng);
  const Bytes rows = RandomRows(num_rows * c.hidden, c.dtype, rng);
  const Bytes grad_rows_in = RandomRows(num_rows * c.hidden, c.dtype, rng);
  const Bytes grad_tokens = RandomRows(c.num_tokens * c.hidden, c.dtype, rng);
  const std::vector<float> weights = RandomWeights(num_entries, rng);

  DeviceBuffer<int32_t> device_position(routing.position);
  DeviceBuffer<float> device_weights(weights);
  DeviceBuffer<unsigned char> device_tokens(tokens, shift);
  DeviceBuffer<unsigned char> device_rows(rows, shift);
  DeviceBuffer<unsigned char> device_grad_rows_in(grad_rows_in, shift);
  DeviceBuffer<unsigned char> device_grad_tokens(grad_tokens, shift);
  DeviceBuffer<unsigned char> device_token_out(tokens.size(), shift);
  DeviceBuffer<unsigned char> device_row_out(rows.size(), shift);
  DeviceBuffer<float> device_grad_weights(num_entries);

  for (unsigned char poison : kPoisons) {
    // Permute writes only the mapped rows: the rest keep their poison on both sides.
    Bytes want(rows.size(), poison);
    ASSERT_OK(cpu::Permute(tokens.data(), c.num_tokens, c.top_k, c.hidden, c.dtype, position,
                           want.data(), num_rows));
    device_row_out.Fill(poison);
    ASSERT_OK(gpu::Permute(device_tokens.get(), c.num_tokens, c.top_k, c.hidden, c.dtype,
                           device_position.get(), device_row_out.get(), num_rows, stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameRows(want, device_row_out.Download(), c.dtype, "Permute out");

    want.assign(tokens.size(), poison);
    ASSERT_OK(cpu::PermuteBackward(grad_rows_in.data(), num_rows, position, c.num_tokens, c.top_k,
                                   c.hidden, c.dtype, want.data()));
    device_token_out.Fill(poison);
    ASSERT_OK(gpu::PermuteBackward(device_grad_rows_in.get(), num_rows, device_position.get(),
                                   c.num_tokens, c.top_k, c.hidden, c.dtype, device_token_out.get(),
                                   stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameRows(want, device_token_out.Download(), c.dtype, "PermuteBackward grad_in");

    want.assign(tokens.size(), poison);
    ASSERT_OK(cpu::UnpermuteCombine(rows.data(), num_rows, position, weights.data(), c.num_tokens,
                                    c.top_k, c.hidden, c.dtype, want.data()));
    device_token_out.Fill(poison);
    ASSERT_OK(gpu::UnpermuteCombine(device_rows.get(), num_rows, device_position.get(),
                                    device_weights.get(), c.num_tokens, c.top_k, c.hidden, c.dtype,
                                    device_token_out.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameRows(want, device_token_out.Download(), c.dtype, "UnpermuteCombine out");

    want.assign(rows.size(), poison);
    std::vector<float> grad_weights(num_entries);
    ASSERT_OK(cpu::UnpermuteCombineBackward(grad_tokens.data(), rows.data(), num_rows, position,
                                            weights.data(), c.num_tokens, c.top_k, c.hidden,
                                            c.dtype, want.data(), grad_weights.data()));
    device_row_out.Fill(poison);
    device_grad_weights.Fill(poison);
    ASSERT_OK(gpu::UnpermuteCombineBackward(
        device_grad_tokens.get(), device_rows.get(), num_rows, device_position.get(),
        device_weights.get(), c.num_tokens, c.top_k, c.hidden, c.dtype, device_row_out.get(),
        device_grad_weights.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameRows(want, device_row_out.Download(), c.dtype, "UnpermuteCombineBackward grad_rows");
    const std::vector<float> got_weights = device_grad_weights.Download();
    ASSERT_EQ(got_weights.size(), grad_weights.size());
    for (int64_t entry = 0; entry < num_entries; ++entry) {
      // Summation order differs: allow float32 rounding relative to the sum of |terms|.
      double magnitude = 0.0;
      const int32_t row = position[entry];
      for (int64_t h = 0; row >= 0 && h < c.hidden; ++h) {
        magnitude +=
            std::fabs(double{RowElement(grad_tokens, c.dtype, entry / c.top_k * c.hidden + h)} *
                      RowElement(rows, c.dtype, row * c.hidden + h));
      }
      ASSERT_NEAR(got_weights[entry], grad_weights[entry], 1e-5 * magnitude + 1e-6)
          << "grad_weights[" << entry << "]";
    }

    // The weight gradients are reduced in a fixed tree: the same bits on every run.
    ASSERT_OK(gpu::UnpermuteCombineBackward(
        device_grad_tokens.get(), device_rows.get(), num_rows, device_position.get(),
        device_weights.get(), c.num_tokens, c.top_k, c.hidden, c.dtype, device_row_out.get(),
        device_grad_weights.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameBits(got_weights, device_grad_weights.Download(), "grad_weights run to run");
  }
}

TEST(KernelsGpuTest, PermuteAndUnpermuteMatchCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  struct Shape {
    int64_t num_tokens;
    int top_k;
    int64_t hidden;
  };
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const Shape s : {Shape{0, 2, 8}, Shape{1, 1, 1}, Shape{5, 2, 7}, Shape{17, 3, 13},
                          Shape{33, 8, 64}, Shape{64, 8, 1000}, Shape{96, 8, 7168}}) {
      for (int misalign : {0, 1}) {
        CheckRowKernels({dtype, s.num_tokens, s.top_k, s.hidden, misalign}, stream);
      }
    }
  }
}

// ---- Checksums

void CheckSlotChecksums(int64_t num_slots, int64_t slot_bytes, int64_t stride_bytes,
                        int base_offset, const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message()
               << "num_slots " << num_slots << " slot_bytes " << slot_bytes << " stride_bytes "
               << stride_bytes << " base_offset " << base_offset << " seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t span = num_slots > 0 ? (num_slots - 1) * stride_bytes + slot_bytes : 0;
  Bytes memory(span);
  for (unsigned char& byte : memory) byte = static_cast<unsigned char>(rng());
  const uint64_t checksum_seed = rng();
  std::vector<uint64_t> checksums(num_slots);
  ASSERT_OK(cpu::SlotChecksums(memory.data(), num_slots, slot_bytes, stride_bytes, checksum_seed,
                               checksums.data()));

  DeviceBuffer<unsigned char> device_memory(memory, base_offset);
  DeviceBuffer<uint64_t> device_checksums(num_slots);
  for (unsigned char poison : kPoisons) {
    device_checksums.Fill(poison);
    ASSERT_OK(gpu::SlotChecksums(device_memory.get(), num_slots, slot_bytes, stride_bytes,
                                 checksum_seed, device_checksums.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameBits(checksums, device_checksums.Download(), "checksums");
  }
}

TEST(KernelsGpuTest, SlotChecksumsMatchCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  for (int64_t slot_bytes : {0, 1, 7, 8, 9, 1000, (1 << 20) + 3}) {
    for (int64_t stride_extra : {0, 1, 8, 13}) {
      for (int64_t num_slots : {0, 1, 3}) {
        for (int base_offset : {0, 1, 3, 8}) {
          CheckSlotChecksums(num_slots, slot_bytes, slot_bytes + stride_extra, base_offset, stream);
        }
      }
    }
  }
  // More slots than one launch covers in its second grid dimension.
  CheckSlotChecksums(70000, 24, 24, 0, stream);
  CheckSlotChecksums(70000, 21, 23, 1, stream);
}

// ---- Gradient sums

// `offset` elements into both allocations: 2-byte elements need only 2-byte alignment.
template <typename T>
void CheckAddInto(GradientType type, const std::vector<T>& acc, const std::vector<T>& source,
                  const CudaStream& stream, size_t offset = 0) {
  std::vector<T> want = acc;
  ASSERT_OK(cpu::AddInto(type, want.data(), source.data(),
                         static_cast<int64_t>(want.size() * sizeof(T))));
  DeviceBuffer<T> device_acc(acc, offset);
  DeviceBuffer<T> device_source(source, offset);
  ASSERT_OK(gpu::AddInto(type, device_acc.get(), device_source.get(),
                         static_cast<int64_t>(acc.size() * sizeof(T)), stream.get()));
  ASSERT_CUDA(stream.Sync());
  ExpectSameBits(want, device_acc.Download(), "AddInto");
}

// bf16 or fp16 operand pairs: half uniform over all bits (NaN, infinities, subnormals), half of
// nearby magnitude with random signs (cancellation, ties), the first few replaced by special
// pairs (inf - inf, NaNs, overflow, signed zeros, subnormals).
void SixteenBitPairs(GradientType type, size_t count, std::mt19937_64& rng,
                     std::vector<uint16_t>& acc, std::vector<uint16_t>& source) {
  const int fraction_bits = type == GradientType::kBFloat16 ? 7 : 10;
  const auto near = static_cast<uint16_t>((1u << (fraction_bits + 2)) - 1);
  acc.resize(count);
  source.resize(count);
  for (size_t i = 0; i < count; ++i) {
    acc[i] = static_cast<uint16_t>(rng());
    const auto draw = static_cast<uint16_t>(rng());
    source[i] =
        i % 2 == 0
            ? draw
            : static_cast<uint16_t>((acc[i] & ~near & 0x7fff) | (draw & near) | (draw & 0x8000));
  }
  const std::vector<std::pair<uint16_t, uint16_t>> special =
      type == GradientType::kBFloat16
          ? std::vector<std::pair<uint16_t, uint16_t>>{{0x7f80, 0xff80}, {0x7fc1, 0x3f80},
                                                       {0xffc0, 0x0000}, {0x7f7f, 0x7f7f},
                                                       {0x8000, 0x8000}, {0x0001, 0x8001}}
          : std::vector<std::pair<uint16_t, uint16_t>>{{0x7c00, 0xfc00}, {0x7e01, 0x3c00},
                                                       {0xfe00, 0x0000}, {0x7bff, 0x7bff},
                                                       {0x8000, 0x8000}, {0x0001, 0x8001}};
  for (size_t i = 0; i < special.size() && i < count; ++i) {
    acc[i] = special[i].first;
    source[i] = special[i].second;
  }
}

TEST(KernelsGpuTest, AddIntoMatchesCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (size_t count : {size_t{0}, size_t{1}, size_t{255}, size_t{1} << 20}) {
    std::vector<float> f_acc(count), f_source(count);
    std::vector<double> d_acc(count), d_source(count);
    std::vector<uint64_t> i_acc(count), i_source(count);
    for (size_t i = 0; i < count; ++i) {
      f_acc[i] = static_cast<float>(normal(rng));
      f_source[i] = static_cast<float>(normal(rng) * 1e-3);
      d_acc[i] = normal(rng);
      d_source[i] = normal(rng) * 1e-9;
      i_acc[i] = rng();
      i_source[i] = rng();
    }
    CheckAddInto(GradientType::kFloat32, f_acc, f_source, stream);
    CheckAddInto(GradientType::kFloat64, d_acc, d_source, stream);
    CheckAddInto(GradientType::kFixedInt64, i_acc, i_source, stream);
    for (GradientType type : {GradientType::kBFloat16, GradientType::kFloat16}) {
      std::vector<uint16_t> h_acc;
      std::vector<uint16_t> h_source;
      SixteenBitPairs(type, count, rng, h_acc, h_source);
      for (size_t offset : {size_t{0}, size_t{1}}) {
        CheckAddInto(type, h_acc, h_source, stream, offset);
      }
    }
  }
}

// 2-byte elements at an odd address are refused, naming the pointer.
TEST(KernelsGpuTest, AddIntoRefusesSixteenBitElementsAtOddAddresses) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  DeviceBuffer<unsigned char> acc(9);
  DeviceBuffer<unsigned char> source(9);
  for (GradientType type : {GradientType::kBFloat16, GradientType::kFloat16}) {
    Status status = gpu::AddInto(type, acc.get() + 1, source.get(), 8, stream.get());
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("acc is not aligned to its 2-byte elements"), std::string::npos)
        << status.ToString();
    status = gpu::AddInto(type, acc.get(), source.get() + 1, 8, stream.get());
    EXPECT_NE(status.message().find("source is not aligned to its 2-byte elements"),
              std::string::npos)
        << status.ToString();
  }
}

// ---- Condensation

struct CondenseCase {
  DType dtype;
  int64_t num_rows;
  int64_t hidden;
  int window;
  float threshold;
  int num_buckets;
  bool rows_outside_buckets;
};

// Rows in families: a new random (Gaussian) direction, an exact copy of an earlier row scaled by a
// power of two (cosine 1 up to rounding), or a zero row. Distinct directions in 64+ dimensions
// have cosines within a few 1/sqrt(hidden) of 0, far below the thresholds used here.
Bytes FamilyRows(const CondenseCase& c, std::mt19937_64& rng) {
  std::normal_distribution<float> gaussian(0.0f, 1.0f);
  Bytes rows(c.num_rows * c.hidden * DTypeBytes(c.dtype));
  for (int64_t i = 0; i < c.num_rows; ++i) {
    const int roll = static_cast<int>(rng() % 100);
    if (roll < 5) {
      for (int64_t h = 0; h < c.hidden; ++h) SetRowElement(rows, c.dtype, i * c.hidden + h, 0.0f);
    } else if (roll < 50 && i > 0) {
      const int64_t reach = std::min<int64_t>(i, 2 * c.window + 2);
      const int64_t from = i - 1 - static_cast<int64_t>(rng() % reach);
      const float scale = std::array<float, 3>{1.0f, 2.0f, 0.5f}[rng() % 3];
      for (int64_t h = 0; h < c.hidden; ++h) {
        SetRowElement(rows, c.dtype, i * c.hidden + h,
                      scale * RowElement(rows, c.dtype, from * c.hidden + h));
      }
    } else {
      for (int64_t h = 0; h < c.hidden; ++h) {
        SetRowElement(rows, c.dtype, i * c.hidden + h, gaussian(rng));
      }
    }
  }
  return rows;
}

std::vector<int32_t> RandomBucketBegin(const CondenseCase& c, std::mt19937_64& rng) {
  const int64_t first = c.rows_outside_buckets ? std::min<int64_t>(2, c.num_rows) : 0;
  const int64_t last = c.rows_outside_buckets ? std::max(first, c.num_rows - 3) : c.num_rows;
  std::vector<int32_t> begin(c.num_buckets + 1);
  for (int32_t& b : begin) b = static_cast<int32_t>(first + rng() % (last - first + 1));
  std::sort(begin.begin(), begin.end());
  begin.front() = static_cast<int32_t>(first);
  begin.back() = static_cast<int32_t>(last);
  return begin;
}

// Cosine in double of rows a and b; NaN when either is a zero row.
double Cosine(const Bytes& rows, DType dtype, int64_t hidden, int64_t a, int64_t b) {
  double dot = 0.0, aa = 0.0, bb = 0.0;
  for (int64_t h = 0; h < hidden; ++h) {
    const double x = RowElement(rows, dtype, a * hidden + h);
    const double y = RowElement(rows, dtype, b * hidden + h);
    dot += x * y;
    aa += x * x;
    bb += y * y;
  }
  return aa == 0.0 || bb == 0.0 ? std::nan("") : dot / std::sqrt(aa * bb);
}

void CheckCondense(const CondenseCase& c, const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message()
               << DTypeName(c.dtype) << " num_rows " << c.num_rows << " hidden " << c.hidden
               << " window " << c.window << " threshold " << c.threshold << " num_buckets "
               << c.num_buckets << " outside " << c.rows_outside_buckets << " seed " << seed);
  std::mt19937_64 rng(seed);
  const Bytes rows = FamilyRows(c, rng);
  const std::vector<int32_t> bucket_begin = RandomBucketBegin(c, rng);
  // Every pair the rule compares must be clearly on one side of the threshold.
  for (int b = 0; b < c.num_buckets; ++b) {
    for (int64_t i = bucket_begin[b]; i < bucket_begin[b + 1]; ++i) {
      for (int64_t j = std::max<int64_t>(bucket_begin[b], i - c.window); j < i; ++j) {
        const double cosine = Cosine(rows, c.dtype, c.hidden, i, j);
        if (!std::isnan(cosine)) {
          ASSERT_GT(std::fabs(cosine - c.threshold), 0.05) << "rows " << i << ", " << j;
        }
      }
    }
  }
  std::vector<int32_t> representative(c.num_rows);
  std::vector<int32_t> kept(c.num_buckets);
  ASSERT_OK(cpu::CondenseRows(rows.data(), c.num_rows, c.hidden, c.dtype, bucket_begin.data(),
                              c.num_buckets, c.threshold, c.window, representative.data(),
                              kept.data()));

  DeviceBuffer<unsigned char> device_rows(rows);
  DeviceBuffer<int32_t> device_bucket_begin(bucket_begin);
  DeviceBuffer<int32_t> device_representative(c.num_rows);
  DeviceBuffer<int32_t> device_kept(c.num_buckets);
  for (unsigned char poison : kPoisons) {
    device_representative.Fill(poison);
    device_kept.Fill(poison);
    ASSERT_OK(gpu::CondenseRows(device_rows.get(), c.num_rows, c.hidden, c.dtype,
                                device_bucket_begin.get(), c.num_buckets, c.threshold, c.window,
                                device_representative.get(), device_kept.get(), stream.get()));
    ASSERT_CUDA(stream.Sync());
    ExpectSameBits(representative, device_representative.Download(), "representative");
    ExpectSameBits(kept, device_kept.Download(), "kept");
  }
}

TEST(KernelsGpuTest, CondenseRowsMatchesCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t hidden : {64, 99, 256}) {
      for (int64_t num_rows : {0, 1, 40, 500}) {
        for (int window : {1, 4, 32}) {
          CheckCondense({dtype, num_rows, hidden, window, 0.9f, 1, false}, stream);
          CheckCondense({dtype, num_rows, hidden, window, 0.9f, 7, true}, stream);
        }
      }
    }
    CheckCondense({dtype, 300, 512, 32, 0.6f, 13, false}, stream);
    CheckCondense({dtype, 50, 64, 8, 0.9f, 0, true}, stream);
  }
}

void CheckExpand(DType dtype, int64_t num_rows, int64_t hidden, int misalign,
                 const CudaStream& stream) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " num_rows " << num_rows << " hidden "
                                    << hidden << " misalign " << misalign << " seed " << seed);
  std::mt19937_64 rng(seed);
  // About a third of the rows are represented by an earlier row that represents itself.
  std::vector<int32_t> representative(num_rows);
  std::vector<int32_t> leaders;
  for (int64_t i = 0; i < num_rows; ++i) {
    if (!leaders.empty() && rng() % 3 == 0) {
      representative[i] = leaders[rng() % leaders.size()];
    } else {
      representative[i] = static_cast<int32_t>(i);
      leaders.push_back(static_cast<int32_t>(i));
    }
  }
  Bytes rows = RandomRows(num_rows * hidden, dtype, rng);
  DeviceBuffer<unsigned char> device_rows(rows, misalign * DTypeBytes(dtype));
  DeviceBuffer<int32_t> device_representative(representative);
  ASSERT_OK(cpu::ExpandCondensed(rows.data(), num_rows, hidden, dtype, representative.data()));
  ASSERT_OK(gpu::ExpandCondensed(device_rows.get(), num_rows, hidden, dtype,
                                 device_representative.get(), stream.get()));
  ASSERT_CUDA(stream.Sync());
  ExpectSameRows(rows, device_rows.Download(), dtype, "rows");
}

TEST(KernelsGpuTest, ExpandCondensedMatchesCpu) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  CudaStream stream;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t hidden : {1, 7, 64, 1000}) {
      for (int64_t num_rows : {0, 1, 50, 333}) {
        for (int misalign : {0, 1}) CheckExpand(dtype, num_rows, hidden, misalign, stream);
      }
    }
  }
}

// ---- Arguments: the GPU functions reject what the CPU references reject, with the same message.

void ExpectSameError(const Status& cpu_status, const Status& gpu_status) {
  EXPECT_EQ(gpu_status.code(), StatusCode::kInvalidArgument) << gpu_status.ToString();
  EXPECT_EQ(gpu_status.ToString(), cpu_status.ToString());
}

TEST(KernelsGpuTest, RejectsWhatTheCpuRejects) {
  if (!keel::kernels::GpuAvailable()) GTEST_SKIP() << "no GPU";
  // Never dereferenced: every call fails its argument checks first.
  int32_t ints[4] = {0, 0, 0, 0};
  float floats[4] = {0, 0, 0, 0};
  uint64_t words[2] = {0, 0};
  const Stream stream = nullptr;
  ExpectSameError(cpu::ExpertHistogram(ints, -3, 2, ints, ints),
                  gpu::ExpertHistogram(ints, -3, 2, ints, ints, ints, stream));
  ExpectSameError(
      cpu::ExpertHistogram(static_cast<const int64_t*>(nullptr), 2, 2, ints, ints),
      gpu::ExpertHistogram(static_cast<const int64_t*>(nullptr), 2, 2, ints, ints, ints, stream));
  ExpectSameError(cpu::RankHistogram(ints, 2, 0, ints, 1, 1, ints, ints, ints),
                  gpu::RankHistogram(ints, 2, 0, ints, 1, 1, ints, ints, ints, stream));
  QuotaTable table;
  table.num_experts = -1;
  ExpectSameError(cpu::RemapWithQuotas(ints, 1, table, ints, ints, ints),
                  gpu::RemapWithQuotas(ints, 1, table, ints, ints, ints, ints, stream));
  ExpectSameError(cpu::PermutationIndex(ints, 1, ints, 1, -1, ints, ints, ints),
                  gpu::PermutationIndex(ints, 1, ints, 1, -1, ints, ints, ints, ints, stream));
  ExpectSameError(cpu::Permute(floats, 1, 1, 0, DType::kFloat32, ints, floats, 1),
                  gpu::Permute(floats, 1, 1, 0, DType::kFloat32, ints, floats, 1, stream));
  ExpectSameError(cpu::PermuteBackward(floats, 1, ints, 1, 0, 4, DType::kBFloat16, floats),
                  gpu::PermuteBackward(floats, 1, ints, 1, 0, 4, DType::kBFloat16, floats, stream));
  ExpectSameError(
      cpu::UnpermuteCombine(floats, 1, ints, nullptr, 1, 1, 4, DType::kFloat32, floats),
      gpu::UnpermuteCombine(floats, 1, ints, nullptr, 1, 1, 4, DType::kFloat32, floats, stream));
  ExpectSameError(cpu::UnpermuteCombineBackward(floats, floats, 1, ints, floats, 1, 1, 1,
                                                DType::kFloat32, floats, nullptr),
                  gpu::UnpermuteCombineBackward(floats, floats, 1, ints, floats, 1, 1, 1,
                                                DType::kFloat32, floats, nullptr, stream));
  ExpectSameError(cpu::SlotChecksums(words, 2, 16, 8, 0, words),
                  gpu::SlotChecksums(words, 2, 16, 8, 0, words, stream));
  ExpectSameError(
      cpu::CondenseRows(floats, 1, 4, DType::kFloat32, ints, 1, 1.5f, 4, ints, ints),
      gpu::CondenseRows(floats, 1, 4, DType::kFloat32, ints, 1, 1.5f, 4, ints, ints, stream));
  ExpectSameError(
      cpu::CondenseRows(floats, 1, 4, DType::kFloat32, ints, 1, 0.9f, 0, ints, ints),
      gpu::CondenseRows(floats, 1, 4, DType::kFloat32, ints, 1, 0.9f, 0, ints, ints, stream));
  ExpectSameError(cpu::ExpandCondensed(floats, -1, 4, DType::kFloat32, ints),
                  gpu::ExpandCondensed(floats, -1, 4, DType::kFloat32, ints, stream));
  // The workspace is the GPU's alone.
  const Status missing_workspace =
      gpu::PermutationIndex(ints, 300, ints, 1, 1, ints, ints, ints, nullptr, stream);
  EXPECT_EQ(missing_workspace.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing_workspace.message().find("workspace"), std::string::npos)
      << missing_workspace.ToString();
}

}  // namespace
}  // namespace keel::kernels

#else  // !KEEL_KERNELS_CUDA

TEST(KernelsGpuTest, SkippedWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif  // KEEL_KERNELS_CUDA
