// CUDA versions of kernels/condense.h, in the rule's three steps, one warp per row:
//   MarkLeaders:         representative[i] = i for a leader, kNotLeader otherwise;
//   PickRepresentatives: a non-leader takes the earliest similar leader in its window;
//   CountKept:           one block per bucket turns the rest (no similar leader) into their own
//                        representatives and counts the rows kept.
// There is no workspace, so norms are recomputed per pair; cosines are float32 like the CPU's,
// summed in another order, so they agree to rounding.
#include <cuda_runtime.h>
#include <cuda/atomic>

#include <string>

#include "kernels/arguments.h"
#include "kernels/condense.h"
#include "kernels/cuda_check.h"
#include "kernels/rows.cuh"

namespace keel::kernels::gpu {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kCopyThreads = 128;
constexpr int kCountThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 30;
constexpr int32_t kNotLeader = -1;

// First row of the bucket that holds `row`, or -1 when no bucket does. bucket_begin is trusted to
// be non-decreasing within [0, num_rows] (the CPU reference checks it).
__device__ int64_t BucketBeginOf(const int32_t* bucket_begin, int num_buckets, int64_t row) {
  // upper = the number of entries of bucket_begin[0, num_buckets] that are <= row.
  int lower = 0;
  int upper = num_buckets + 1;
  while (lower < upper) {
    const int middle = lower + (upper - lower) / 2;
    if (bucket_begin[middle] <= row) {
      lower = middle + 1;
    } else {
      upper = middle;
    }
  }
  const int bucket = upper - 1;
  if (bucket < 0 || bucket >= num_buckets) return -1;
  return bucket_begin[bucket];
}

// Earliest row of `row`'s window, or `row` itself when it has none (no bucket).
__device__ int64_t WindowBegin(const int32_t* bucket_begin, int num_buckets, int window,
                               int64_t row) {
  const int64_t begin = BucketBeginOf(bucket_begin, num_buckets, row);
  if (begin < 0) return row;
  return max(max(begin, row - window), int64_t{0});
}

template <typename T, int V>
__device__ float SquaredNorm(const Pack<T, V>* row, int64_t packs_per_row) {
  float sum = 0.0f;
  for (int64_t p = threadIdx.x % kWarp; p < packs_per_row; p += kWarp) {
    const Pack<T, V> x = row[p];
#pragma unroll
    for (int v = 0; v < V; ++v) sum = fmaf(ToFloat(x.value[v]), ToFloat(x.value[v]), sum);
  }
  return WarpSum(sum);
}

__device__ inline uint32_t Bits(float value) { return __float_as_uint(value); }
__device__ inline uint32_t Bits(uint16_t value) { return value; }

// Identical rows (bit for bit), or cosine(a, b) >= threshold below 1; for the whole warp. |a|^2
// is given. Zero rows match only zero rows.
template <typename T, int V>
__device__ bool Similar(const Pack<T, V>* a, float a_squared_norm, const Pack<T, V>* b,
                        int64_t packs_per_row, float threshold) {
  float dot = 0.0f;
  float b_squared_norm = 0.0f;
  bool identical = true;
  for (int64_t p = threadIdx.x % kWarp; p < packs_per_row; p += kWarp) {
    const Pack<T, V> x = a[p];
    const Pack<T, V> y = b[p];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      dot = fmaf(ToFloat(x.value[v]), ToFloat(y.value[v]), dot);
      b_squared_norm = fmaf(ToFloat(y.value[v]), ToFloat(y.value[v]), b_squared_norm);
      identical = identical && Bits(x.value[v]) == Bits(y.value[v]);
    }
  }
  if (__all_sync(0xffffffffu, identical)) return true;
  if (threshold >= 1.0f) return false;
  dot = WarpSum(dot);
  b_squared_norm = WarpSum(b_squared_norm);
  if (a_squared_norm == 0.0f || b_squared_norm == 0.0f) {
    return a_squared_norm == 0.0f && b_squared_norm == 0.0f;
  }
  // The product of two floats is exact in double, and so is the square root of a square: two
  // identical rows (same dot products, same order) have a cosine of exactly 1.
  return static_cast<double>(dot) /
             sqrt(static_cast<double>(a_squared_norm) * static_cast<double>(b_squared_norm)) >=
         static_cast<double>(threshold);
}

__device__ int64_t GlobalWarp() {
  return int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarp;
}

__device__ int64_t NumWarps() { return int64_t{gridDim.x} * kWarpsPerBlock; }

template <typename T, int V>
__global__ void MarkLeaders(const Pack<T, V>* rows, int64_t num_rows, int64_t packs_per_row,
                            const int32_t* bucket_begin, int num_buckets, float threshold,
                            int window, int32_t* representative) {
  for (int64_t i = GlobalWarp(); i < num_rows; i += NumWarps()) {
    const Pack<T, V>* row = rows + i * packs_per_row;
    const int64_t first = WindowBegin(bucket_begin, num_buckets, window, i);
    const float squared_norm = first < i ? SquaredNorm(row, packs_per_row) : 0.0f;
    bool leader = true;
    for (int64_t j = first; j < i && leader; ++j) {
      leader = !Similar(row, squared_norm, rows + j * packs_per_row, packs_per_row, threshold);
    }
    if (threadIdx.x % kWarp == 0) representative[i] = leader ? static_cast<int32_t>(i) : kNotLeader;
  }
}

// Reads and writes of representative[] while other warps update it. A non-leader's entry changes
// from kNotLeader to a smaller row, never to its own index, so "is j a leader" (entry == j) reads
// the same whichever value a warp sees; relaxed atomics make those concurrent accesses defined.
__device__ int32_t LoadRepresentative(int32_t* representative, int64_t row) {
  return cuda::atomic_ref<int32_t, cuda::thread_scope_device>(representative[row])
      .load(cuda::memory_order_relaxed);
}

template <typename T, int V>
__global__ void PickRepresentatives(const Pack<T, V>* rows, int64_t num_rows, int64_t packs_per_row,
                                    const int32_t* bucket_begin, int num_buckets, float threshold,
                                    int window, int32_t* representative) {
  for (int64_t i = GlobalWarp(); i < num_rows; i += NumWarps()) {
    if (LoadRepresentative(representative, i) != kNotLeader) continue;
    const Pack<T, V>* row = rows + i * packs_per_row;
    const float squared_norm = SquaredNorm(row, packs_per_row);
    int64_t chosen = -1;
    for (int64_t j = WindowBegin(bucket_begin, num_buckets, window, i); j < i; ++j) {
      if (LoadRepresentative(representative, j) == j &&
          Similar(row, squared_norm, rows + j * packs_per_row, packs_per_row, threshold)) {
        chosen = j;
        break;
      }
    }
    if (threadIdx.x % kWarp == 0 && chosen >= 0) {
      cuda::atomic_ref<int32_t, cuda::thread_scope_device>(representative[i])
          .store(static_cast<int32_t>(chosen), cuda::memory_order_relaxed);
    }
  }
}

__global__ void CountKept(const int32_t* bucket_begin, int32_t* representative, int32_t* kept) {
  __shared__ int32_t block_kept;
  if (threadIdx.x == 0) block_kept = 0;
  __syncthreads();
  const int bucket = blockIdx.x;
  int32_t thread_kept = 0;
  for (int64_t i = bucket_begin[bucket] + threadIdx.x; i < bucket_begin[bucket + 1];
       i += blockDim.x) {
    if (representative[i] == kNotLeader) representative[i] = static_cast<int32_t>(i);
    if (representative[i] == i) ++thread_kept;
  }
  if (thread_kept > 0) atomicAdd(&block_kept, thread_kept);
  __syncthreads();
  if (threadIdx.x == 0) kept[bucket] = block_kept;
}

template <typename T, int V>
__global__ void ExpandKernel(Pack<T, V>* rows, int64_t num_rows, int64_t packs_per_row,
                             const int32_t* representative) {
  for (int64_t i = blockIdx.x; i < num_rows; i += gridDim.x) {
    const int32_t from = representative[i];
    // Representatives are never written, so the rows read here are final.
    if (from == i || from < 0 || from >= num_rows) continue;
    for (int64_t p = threadIdx.x; p < packs_per_row; p += blockDim.x) {
      rows[i * packs_per_row + p] = rows[from * packs_per_row + p];
    }
  }
}

}  // namespace

Status CondenseRows(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                    const int32_t* bucket_begin, int num_buckets, float threshold, int window,
                    int32_t* representative, int32_t* kept, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckCondenseArguments(rows, num_rows, hidden, dtype, bucket_begin,
                                              num_buckets, threshold, window, representative,
                                              kept));
  if (num_rows == 0) {
    if (num_buckets > 0) {
      KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kept, 0, sizeof(int32_t) * num_buckets, stream));
    }
    return Status::Ok();
  }

  KEEL_RETURN_IF_ERROR(DispatchRows(dtype, hidden, {rows}, [&](auto element, auto width) {
    using T = decltype(element);
    constexpr int V = decltype(width)::value;
    const auto* packed = static_cast<const Pack<T, V>*>(rows);
    const unsigned grid = GridSize(num_rows, kWarpsPerBlock, kMaxBlocks);
    MarkLeaders<T, V><<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(
        packed, num_rows, hidden / V, bucket_begin, num_buckets, threshold, window, representative);
    KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(MarkLeaders);
    PickRepresentatives<T, V><<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(
        packed, num_rows, hidden / V, bucket_begin, num_buckets, threshold, window, representative);
    KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(PickRepresentatives);
    return Status::Ok();
  }));
  if (num_buckets == 0) return Status::Ok();
  CountKept<<<static_cast<unsigned>(num_buckets), kCountThreads, 0, stream>>>(bucket_begin,
                                                                              representative, kept);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(CountKept);
  return Status::Ok();
}

Status ExpandCondensed(void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                       const int32_t* representative, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckExpandArguments(rows, num_rows, hidden, dtype, representative));
  if (num_rows == 0) return Status::Ok();
  return DispatchRows(dtype, hidden, {rows}, [&](auto element, auto width) {
    using T = decltype(element);
    constexpr int V = decltype(width)::value;
    ExpandKernel<T, V><<<GridSize(num_rows, 1, kMaxBlocks), kCopyThreads, 0, stream>>>(
        static_cast<Pack<T, V>*>(rows), num_rows, hidden / V, representative);
    KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(ExpandKernel);
    return Status::Ok();
  });
}

}  // namespace keel::kernels::gpu
