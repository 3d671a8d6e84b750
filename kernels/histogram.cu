// CUDA versions of kernels/histogram.h: each block counts its entries in shared memory, then adds
// its non-zero bins to zeroed totals with one atomic each. Integer sums do not depend on the
// order of the adds, so the counts equal the CPU reference's.
//
// RankHistogram's totals are its outputs, cleared by memsets. ExpertHistogram is one launch: its
// totals live in the caller's workspace, which every call leaves zeroed, and the last block to
// finish moves them to the outputs. Each operation on a stream costs 3-4 us of latency at these
// sizes, more than the counting (docs/benchmarks.md, "On an H100").
#include <algorithm>

#include <cuda_runtime.h>

#include "kernels/arguments.h"
#include "kernels/cuda_check.h"
#include "kernels/histogram.h"

namespace keel::kernels::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerThread = 8;
constexpr int kMaxBlocks = 1024;
// 32 KiB of bins, well inside the 48 KiB of shared memory a block may use without opting in; more
// bins count straight into the global outputs (slower, same result).
constexpr int kMaxSharedBins = 8192;

// Bins in shared memory when they fit, else the global output itself: atomicAdd through a generic
// pointer works on either.
__device__ int32_t* BlockBins(int32_t* shared, int32_t* global, bool use_shared) {
  return use_shared ? shared : global;
}

__device__ void ZeroShared(int32_t* bins, int num_bins) {
  for (int b = threadIdx.x; b < num_bins; b += blockDim.x) bins[b] = 0;
}

__device__ void FlushShared(const int32_t* bins, int num_bins, int32_t* global) {
  for (int b = threadIdx.x; b < num_bins; b += blockDim.x) {
    if (bins[b] > 0) atomicAdd(&global[b], bins[b]);
  }
}

// The workspace of ExpertHistogram: this header, then the totals ([num_experts] int32).
struct HistogramHeader {
  unsigned finished;  // blocks done in this call
  int32_t invalid;    // invalid entries counted so far in this call
};
constexpr int64_t kHeaderBytes = 256;

int32_t* WorkspaceTotals(void* workspace) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + kHeaderBytes);
}

// Called by every thread of every block once its counts are in `totals` and `header->invalid`:
// the last block to get here moves them to the outputs and zeroes them for the next call.
__device__ void HandOverIfLast(HistogramHeader* header, int32_t* totals, int num_experts,
                               int32_t* counts, int32_t* invalid) {
  __shared__ bool last_block;
  __threadfence();  // this thread's adds are visible before the block counts itself finished
  __syncthreads();
  if (threadIdx.x == 0) last_block = atomicAdd(&header->finished, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last_block) return;
  // Atomic exchanges read the totals where the other blocks' atomics wrote them, and clear them.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = atomicExch(&totals[e], 0);
  if (threadIdx.x == 0) {
    *invalid = atomicExch(&header->invalid, 0);
    atomicExch(&header->finished, 0u);
  }
}

template <typename Id>
__global__ void ExpertHistogramKernel(const Id* ids, int64_t num_entries, int num_experts,
                                      bool shared_bins, HistogramHeader* header, int32_t* totals,
                                      int32_t* counts, int32_t* invalid) {
  extern __shared__ int32_t shared[];
  __shared__ int32_t block_invalid;
  int32_t* bins = BlockBins(shared, totals, shared_bins);
  if (shared_bins) ZeroShared(shared, num_experts);
  if (threadIdx.x == 0) block_invalid = 0;
  __syncthreads();

  // Each thread loads kItemsPerThread ids at once, then counts them: at these sizes the time is
  // the loads' latency, which one load after another would pay kItemsPerThread times.
  int32_t thread_invalid = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t first = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; first < num_entries;
       first += stride * kItemsPerThread) {
    Id loaded[kItemsPerThread];
#pragma unroll
    for (int item = 0; item < kItemsPerThread; ++item) {
      const int64_t i = first + item * stride;
      loaded[item] = i < num_entries ? ids[i] : Id{-1};
    }
#pragma unroll
    for (int item = 0; item < kItemsPerThread; ++item) {
      const Id id = loaded[item];
      if (id >= 0 && id < num_experts) {
        atomicAdd(&bins[id], 1);
      } else if (id != -1) {
        ++thread_invalid;
      }
    }
  }
  if (thread_invalid > 0) atomicAdd(&block_invalid, thread_invalid);
  __syncthreads();

  if (shared_bins) FlushShared(shared, num_experts, totals);
  if (threadIdx.x == 0 && block_invalid > 0) atomicAdd(&header->invalid, block_invalid);
  HandOverIfLast(header, totals, num_experts, counts, invalid);
}

// Rank of entry `id`, or -1 for an unused entry, or -2 for an invalid one. rank_of is trusted
// (the CPU reference checks it); a rank outside [0, num_ranks) counts as invalid rather than
// writing out of bounds.
template <typename Id>
__device__ int RankOfEntry(Id id, const int32_t* rank_of, int num_ids, int num_ranks) {
  if (id == -1) return -1;
  if (id < 0 || id >= num_ids) return -2;
  const int rank = rank_of[id];
  return rank >= 0 && rank < num_ranks ? rank : -2;
}

template <typename Id>
__global__ void RankHistogramKernel(const Id* ids, int64_t num_tokens, int top_k,
                                    const int32_t* rank_of, int num_ids, int num_ranks,
                                    bool shared_bins, int32_t* entries, int32_t* tokens,
                                    int32_t* invalid) {
  extern __shared__ int32_t shared[];  // [2][num_ranks]: entries, then tokens
  __shared__ int32_t block_invalid;
  int32_t* entry_bins = BlockBins(shared, entries, shared_bins);
  int32_t* token_bins = BlockBins(shared + num_ranks, tokens, shared_bins);
  if (shared_bins) ZeroShared(shared, 2 * num_ranks);
  if (threadIdx.x == 0) block_invalid = 0;
  __syncthreads();

  int32_t thread_invalid = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < num_tokens; t += stride) {
    const Id* token_ids = ids + t * top_k;
    for (int k = 0; k < top_k; ++k) {
      const int rank = RankOfEntry(token_ids[k], rank_of, num_ids, num_ranks);
      if (rank == -2) ++thread_invalid;
      if (rank < 0) continue;
      atomicAdd(&entry_bins[rank], 1);
      // The token counts on `rank` at its first entry there.
      bool first_on_rank = true;
      for (int earlier = 0; earlier < k && first_on_rank; ++earlier) {
        first_on_rank = RankOfEntry(token_ids[earlier], rank_of, num_ids, num_ranks) != rank;
      }
      if (first_on_rank) atomicAdd(&token_bins[rank], 1);
    }
  }
  if (thread_invalid > 0) atomicAdd(&block_invalid, thread_invalid);
  __syncthreads();

  if (shared_bins) {
    FlushShared(shared, num_ranks, entries);
    FlushShared(shared + num_ranks, num_ranks, tokens);
  }
  if (threadIdx.x == 0 && block_invalid > 0) atomicAdd(invalid, block_invalid);
}

template <typename Id>
Status Expert(const Id* ids, int64_t num_entries, int num_experts, int32_t* counts,
              int32_t* invalid, void* workspace, Stream stream) {
  KEEL_RETURN_IF_ERROR(
      CheckExpertHistogramArguments(ids, num_entries, num_experts, counts, invalid));
  KEEL_RETURN_IF_ERROR(CheckPointer("workspace", workspace,
                                    num_entries > 0 ? HistogramWorkspaceBytes(num_experts) : 0));
  if (num_entries == 0) {
    if (num_experts > 0) {
      KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counts, 0, sizeof(int32_t) * num_experts, stream));
    }
    KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(invalid, 0, sizeof(int32_t), stream));
    return Status::Ok();
  }

  const bool shared_bins = num_experts <= kMaxSharedBins;
  const size_t shared_bytes = shared_bins ? sizeof(int32_t) * num_experts : 0;
  ExpertHistogramKernel<<<GridSize(num_entries, kThreads * kItemsPerThread, kMaxBlocks), kThreads,
                          shared_bytes, stream>>>(ids, num_entries, num_experts, shared_bins,
                                                  static_cast<HistogramHeader*>(workspace),
                                                  WorkspaceTotals(workspace), counts, invalid);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(ExpertHistogramKernel);
  return Status::Ok();
}

template <typename Id>
Status Rank(const Id* ids, int64_t num_tokens, int top_k, const int32_t* rank_of, int num_ids,
            int num_ranks, int32_t* entries, int32_t* tokens, int32_t* invalid, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckRankHistogramArguments(ids, num_tokens, top_k, rank_of, num_ids,
                                                   num_ranks, entries, tokens, invalid));
  if (num_ranks > 0) {
    KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(entries, 0, sizeof(int32_t) * num_ranks, stream));
    KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(tokens, 0, sizeof(int32_t) * num_ranks, stream));
  }
  KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(invalid, 0, sizeof(int32_t), stream));
  if (num_tokens == 0) return Status::Ok();

  const bool shared_bins = 2 * int64_t{num_ranks} <= kMaxSharedBins;
  const size_t shared_bytes = shared_bins ? 2 * sizeof(int32_t) * num_ranks : 0;
  RankHistogramKernel<<<GridSize(num_tokens, kThreads, kMaxBlocks), kThreads, shared_bytes,
                        stream>>>(ids, num_tokens, top_k, rank_of, num_ids, num_ranks, shared_bins,
                                  entries, tokens, invalid);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(RankHistogramKernel);
  return Status::Ok();
}

}  // namespace

int64_t HistogramWorkspaceBytes(int num_experts) {
  return kHeaderBytes + static_cast<int64_t>(sizeof(int32_t)) * std::max(num_experts, 0);
}

Status ExpertHistogram(const int32_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid, void* workspace, Stream stream) {
  return Expert(ids, num_entries, num_experts, counts, invalid, workspace, stream);
}

Status ExpertHistogram(const int64_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid, void* workspace, Stream stream) {
  return Expert(ids, num_entries, num_experts, counts, invalid, workspace, stream);
}

Status RankHistogram(const int32_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid, Stream stream) {
  return Rank(ids, num_tokens, top_k, rank_of, num_ids, num_ranks, entries, tokens, invalid,
              stream);
}

Status RankHistogram(const int64_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid, Stream stream) {
  return Rank(ids, num_tokens, top_k, rank_of, num_ids, num_ranks, entries, tokens, invalid,
              stream);
}

}  // namespace keel::kernels::gpu
