// CUDA versions of RemapWithQuotas (kernels/remap.h) and PermutationIndex (kernels/permute.h).
// Both are stable counting sorts of entries by a key (the expert; the send bucket): the rank of an
// entry is its 0-based occurrence among the entries of its key, exactly the CPU reference's
// running count, whatever the scheduling. Entries are walked in chunks of 256, each chunk by one
// warp in entry order, with a warp match per 32 entries and a running counter per key.
//
// PermutationIndex needs every key's total before it can place an entry, so it ranks in three
// passes (three launches):
//   1. CountKeys:   chunk_counts[key][chunk] = entries of `key` in the chunk;
//   2. ScanChunks:  per key, an exclusive scan over the chunks turns the counts into the entries
//                   of the key in earlier chunks, and hands the key's total to the caller;
//   3. RankEntries: rank of an entry = its chunk's offset + the entries of its key before it in
//                   the chunk.
// The outputs the passes add into are cleared by CountKeys' first block rather than by memsets:
// each operation on the stream costs 3-4 us of latency at these sizes (docs/benchmarks.md, "On an
// H200").
//
// RemapWithQuotas only needs each entry's rank, so with up to kOnePassMaxKeys experts it ranks in
// one launch (RankInOnePass): each block counts its range of entries, publishes its counts, adds
// up the counts its predecessors published (waiting for those not yet there), then ranks its
// entries; the last block also has every total and counts the sends. Blocks take their place in
// entry order from a ticket, so a block only ever waits for blocks already running. The
// workspace carries the tickets and a generation number from one call to the next: it is
// zero-filled once by the caller and each call leaves it ready for the next.
#include <algorithm>

#include <cuda_runtime.h>
#include <cuda/atomic>

#include <cub/block/block_scan.cuh>

#include "kernels/arguments.h"
#include "kernels/cuda_check.h"
#include "kernels/permute.h"
#include "kernels/remap.h"

namespace keel::kernels::gpu {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kTilesPerChunk = 8;
constexpr int kChunk = kWarp * kTilesPerChunk;  // entries per chunk (one warp-sized block)
constexpr int kScanThreads = 256;
// 32 KiB of counters, well inside the 48 KiB of shared memory a block may use without opting in;
// with more keys the counters stay in the workspace (slower, same result).
constexpr int kMaxSharedKeys = 8192;

// Keys below 0: the entry takes no rank. kInvalidKey entries are also counted in `invalid`.
constexpr int kNoKey = -1;
constexpr int kInvalidKey = -2;

int64_t NumChunks(int64_t num_entries) { return (num_entries + kChunk - 1) / kChunk; }

int64_t RankingWorkspaceBytes(int64_t num_entries, int num_keys) {
  if (num_entries <= 0 || num_keys <= 0) return 0;
  return NumChunks(num_entries) * num_keys * static_cast<int64_t>(sizeof(int32_t));
}

// One counter per key for the chunk of this block: in shared memory when the keys fit, else the
// chunk's column of chunk_counts ([num_keys][num_chunks]).
struct KeyCounters {
  int32_t* base;
  int64_t stride;
  __device__ int32_t& operator[](int key) const { return base[key * stride]; }
};

__device__ KeyCounters ChunkCounters(int32_t* shared, int32_t* chunk_counts, int64_t num_chunks,
                                     bool use_shared) {
  if (use_shared) return {shared, 1};
  return {chunk_counts + blockIdx.x, num_chunks};
}

__device__ int Lane() { return static_cast<int>(threadIdx.x) % kWarp; }

// The keys of a chunk for the calling warp, one per lane and tile; entries past the end have no
// key. KeyOf: Load(entry) reads an entry's value, and Key(value) turns it into its key, -1 being
// a value without one. The values of every tile are loaded first and then the tables Key reads,
// so each kind of load is in flight for all tiles at once: at these sizes the time is the loads'
// latency, which a load after a load would pay once per tile.
template <typename KeyOf>
__device__ void LoadChunkKeys(const KeyOf& key_of, int64_t chunk, int64_t num_entries,
                              int (&keys)[kTilesPerChunk]) {
  const int64_t chunk_begin = chunk * kChunk;
  decltype(key_of.Load(0)) values[kTilesPerChunk];
#pragma unroll
  for (int tile = 0; tile < kTilesPerChunk; ++tile) {
    const int64_t entry = chunk_begin + tile * kWarp + Lane();
    values[tile] = entry < num_entries ? key_of.Load(entry) : -1;
  }
#pragma unroll
  for (int tile = 0; tile < kTilesPerChunk; ++tile) keys[tile] = key_of.Key(values[tile]);
}

// The lane that speaks for a group of lanes with equal keys.
__device__ bool IsGroupLeader(unsigned peers) {
  return Lane() == __ffs(static_cast<int>(peers)) - 1;
}

// Adds the entries of `chunk` to the calling warp's counters, one per key.
template <typename KeyOf>
__device__ void CountChunk(const KeyOf& key_of, int64_t chunk, int64_t num_entries,
                           const KeyCounters& counters) {
  int keys[kTilesPerChunk];
  LoadChunkKeys(key_of, chunk, num_entries, keys);
  __syncwarp();
#pragma unroll
  for (int tile = 0; tile < kTilesPerChunk; ++tile) {
    const unsigned peers = __match_any_sync(kFullMask, keys[tile]);
    if (keys[tile] >= 0 && IsGroupLeader(peers)) counters[keys[tile]] += __popc(peers);
    __syncwarp();
  }
}

// Ranks the entries of `chunk` from the calling warp's counters (the entries of each key before
// the chunk), advancing them past it. Assign: __device__ void(int64_t entry, int key, int32_t
// rank); rank is meaningful for key >= 0. Returns the chunk's invalid entries.
template <typename KeyOf, typename Assign>
__device__ int RankChunk(const KeyOf& key_of, int64_t chunk, int64_t num_entries,
                         const KeyCounters& counters, const Assign& assign) {
  int keys[kTilesPerChunk];
  LoadChunkKeys(key_of, chunk, num_entries, keys);
  __syncwarp();
  const unsigned lanes_before = (1u << Lane()) - 1;
  int invalid_entries = 0;
  int32_t ranks[kTilesPerChunk];
#pragma unroll
  for (int tile = 0; tile < kTilesPerChunk; ++tile) {
    const int key = keys[tile];
    const unsigned peers = __match_any_sync(kFullMask, key);
    ranks[tile] = key >= 0 ? counters[key] + __popc(peers & lanes_before) : 0;
    __syncwarp();  // every peer has read the counter before its leader advances it
    if (key >= 0 && IsGroupLeader(peers)) counters[key] += __popc(peers);
    __syncwarp();
    invalid_entries += __popc(__ballot_sync(kFullMask, key == kInvalidKey));
  }
  // Assigned after every rank is known, so that the tiles' loads in `assign` overlap.
#pragma unroll
  for (int tile = 0; tile < kTilesPerChunk; ++tile) {
    const int64_t entry = chunk * kChunk + tile * kWarp + Lane();
    if (entry < num_entries) assign(entry, keys[tile], ranks[tile]);
  }
  return invalid_entries;
}

// Clears what the later passes add into (counts[0, size) and *invalid unless it is null). A block
// of the kernel that starts the ranking runs it: a memset before the passes would cost a launch's
// latency each.
struct ZeroOutputs {
  int32_t* counts;
  int size;
  int32_t* invalid;

  __device__ void operator()() const {
    for (int i = threadIdx.x; i < size; i += blockDim.x) counts[i] = 0;
    if (threadIdx.x == 0 && invalid != nullptr) *invalid = 0;
  }
};

template <typename KeyOf>
__global__ void CountKeys(KeyOf key_of, int64_t num_entries, int num_keys, bool use_shared,
                          int32_t* chunk_counts, int64_t num_chunks, ZeroOutputs zero_outputs) {
  extern __shared__ int32_t shared[];
  if (blockIdx.x == 0) zero_outputs();
  const KeyCounters counters = ChunkCounters(shared, chunk_counts, num_chunks, use_shared);
  for (int key = threadIdx.x; key < num_keys; key += kWarp) counters[key] = 0;
  __syncwarp();
  CountChunk(key_of, blockIdx.x, num_entries, counters);
  if (use_shared) {
    for (int key = threadIdx.x; key < num_keys; key += kWarp) {
      chunk_counts[key * num_chunks + blockIdx.x] = shared[key];
    }
  }
}

// Exclusive prefix sums of values[0, count) in place, by the whole block; returns the total.
__device__ int32_t ExclusiveScanInPlace(int32_t* values, int64_t count) {
  using BlockScan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  int32_t before = 0;
  for (int64_t tile = 0; tile < count; tile += kScanThreads) {
    const int64_t i = tile + threadIdx.x;
    const int32_t value = i < count ? values[i] : 0;
    int32_t offset = 0;
    int32_t tile_total = 0;
    BlockScan(scan_storage).ExclusiveSum(value, offset, tile_total);
    if (i < count) values[i] = before + offset;
    before += tile_total;
    __syncthreads();  // scan_storage is reused by the next tile
  }
  return before;
}

// One block per key. OnTotal: __device__ void(int key, int32_t total), called once per key.
template <typename OnTotal>
__global__ void ScanChunks(int32_t* chunk_counts, int64_t num_chunks, OnTotal on_total) {
  const int key = blockIdx.x;
  const int32_t total = ExclusiveScanInPlace(chunk_counts + key * num_chunks, num_chunks);
  if (threadIdx.x == 0) on_total(key, total);
}

template <typename KeyOf, typename Assign>
__global__ void RankEntries(KeyOf key_of, int64_t num_entries, int num_keys, bool use_shared,
                            int32_t* chunk_counts, int64_t num_chunks, Assign assign,
                            int32_t* invalid) {
  extern __shared__ int32_t shared[];
  const KeyCounters counters = ChunkCounters(shared, chunk_counts, num_chunks, use_shared);
  if (use_shared) {
    for (int key = threadIdx.x; key < num_keys; key += kWarp) {
      shared[key] = chunk_counts[key * num_chunks + blockIdx.x];
    }
  }
  __syncwarp();
  const int invalid_entries = RankChunk(key_of, blockIdx.x, num_entries, counters, assign);
  if (threadIdx.x == 0 && invalid_entries > 0) atomicAdd(invalid, invalid_entries);
}

// Passes 1 and 2 of the ranking; chunk_counts is the caller's workspace. num_entries > 0.
template <typename KeyOf, typename OnTotal>
Status CountAndScan(const KeyOf& key_of, int64_t num_entries, int num_keys, int32_t* chunk_counts,
                    const ZeroOutputs& zero_outputs, const OnTotal& on_total, Stream stream) {
  const int64_t num_chunks = NumChunks(num_entries);
  const bool use_shared = num_keys <= kMaxSharedKeys;
  const size_t shared_bytes = use_shared ? sizeof(int32_t) * num_keys : 0;
  CountKeys<<<static_cast<unsigned>(num_chunks), kWarp, shared_bytes, stream>>>(
      key_of, num_entries, num_keys, use_shared, chunk_counts, num_chunks, zero_outputs);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(CountKeys);
  if (num_keys == 0) return Status::Ok();
  ScanChunks<<<static_cast<unsigned>(num_keys), kScanThreads, 0, stream>>>(chunk_counts, num_chunks,
                                                                           on_total);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(ScanChunks);
  return Status::Ok();
}

// Pass 3 of the ranking.
template <typename KeyOf, typename Assign>
Status RankAndAssign(const KeyOf& key_of, int64_t num_entries, int num_keys, int32_t* chunk_counts,
                     const Assign& assign, int32_t* invalid, Stream stream) {
  const int64_t num_chunks = NumChunks(num_entries);
  const bool use_shared = num_keys <= kMaxSharedKeys;
  const size_t shared_bytes = use_shared ? sizeof(int32_t) * num_keys : 0;
  RankEntries<<<static_cast<unsigned>(num_chunks), kWarp, shared_bytes, stream>>>(
      key_of, num_entries, num_keys, use_shared, chunk_counts, num_chunks, assign, invalid);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(RankEntries);
  return Status::Ok();
}

// ---- The one-pass ranking: one block per range of 8 * chunks_per_warp chunks, in entry order.

constexpr int kOnePassWarps = 8;
constexpr int kOnePassThreads = kOnePassWarps * kWarp;
// Counters for [8 warps][1024 keys]: 32 KiB of shared memory.
constexpr int kOnePassMaxKeys = 1024;
// Each block adds up the counts of at most 127 predecessors.
constexpr int kOnePassMaxBlocks = 128;
// About 7 s of waiting for a predecessor: only a workspace that was not zero-filled gets there.
constexpr int64_t kOnePassMaxWaits = int64_t{1} << 26;

// What the workspace carries from one call to the next, in its first kHeaderBytes.
struct OnePassHeader {
  unsigned ticket;      // the next block's place in entry order
  unsigned finished;    // blocks done with the workspace in this call
  int32_t invalid;      // invalid entries counted so far in this call
  unsigned generation;  // calls completed
};
constexpr int64_t kHeaderBytes = 256;

struct OnePassLayout {
  int blocks = 0;
  int64_t chunks_per_warp = 0;
};

OnePassLayout ChooseOnePassLayout(int64_t num_entries) {
  const int64_t num_chunks = NumChunks(num_entries);
  const int64_t blocks =
      std::min<int64_t>((num_chunks + kOnePassWarps - 1) / kOnePassWarps, kOnePassMaxBlocks);
  const int64_t chunks_per_block = (num_chunks + blocks - 1) / blocks;
  OnePassLayout layout;
  layout.chunks_per_warp = (chunks_per_block + kOnePassWarps - 1) / kOnePassWarps;
  const int64_t per_block = layout.chunks_per_warp * kOnePassWarps;
  layout.blocks = static_cast<int>((num_chunks + per_block - 1) / per_block);
  return layout;
}

// Block b's count of `key` is published as states[b * num_keys + key] = flag << 32 | count. The
// flag names the call (bit 31 set, the generation in the rest): states of earlier calls carry
// another flag until the generation repeats, after 2^31 calls, and the three-pass path's
// counts, which share the memory, have a high word below 2^31.
using State = unsigned long long;
using StateRef = cuda::atomic_ref<State, cuda::thread_scope_device>;

__device__ uint32_t FlagOf(unsigned generation) { return 0x80000000u | (generation & 0x7fffffffu); }

__device__ void Publish(State* state, uint32_t flag, int32_t count) {
  StateRef(*state).store(State{flag} << 32 | static_cast<uint32_t>(count),
                         cuda::memory_order_relaxed);
}

// The entries of `key` in blocks [0, place), once every one of them has published its count.
// All loads of a round are issued together; a round with a missing count is repeated.
__device__ int32_t EarlierBlocksCount(State* states, int place, int num_keys, int key,
                                      uint32_t flag) {
  for (int64_t round = 0;; ++round) {
    int32_t sum = 0;
    bool complete = true;
    for (int block = 0; block < place; ++block) {
      const State state =
          StateRef(states[int64_t{block} * num_keys + key]).load(cuda::memory_order_relaxed);
      complete &= static_cast<uint32_t>(state >> 32) == flag;
      sum += static_cast<int32_t>(static_cast<uint32_t>(state));
    }
    if (complete) return sum;
    if (round == kOnePassMaxWaits) __trap();
    __nanosleep(100);
  }
}

// OnTotal: __device__ void(int key, int32_t total), called once per key by the last block, after
// it ran clear_outputs. Writes *invalid once every block is done.
template <typename KeyOf, typename Assign, typename OnTotal>
__global__ void __launch_bounds__(kOnePassThreads)
    RankInOnePass(KeyOf key_of, int64_t num_entries, int num_keys, int64_t chunks_per_warp,
                  OnePassHeader* header, State* states, ZeroOutputs clear_outputs, OnTotal on_total,
                  Assign assign, int32_t* invalid) {
  extern __shared__ int32_t counts[];  // [kOnePassWarps][num_keys]
  __shared__ unsigned block_place;
  __shared__ uint32_t flag;
  __shared__ int32_t block_invalid;
  if (threadIdx.x == 0) {
    block_place = atomicAdd(&header->ticket, 1u);
    flag = FlagOf(cuda::atomic_ref<unsigned, cuda::thread_scope_device>(header->generation)
                      .load(cuda::memory_order_relaxed));
    block_invalid = 0;
    if (block_place >= gridDim.x) __trap();  // a workspace that was not zero-filled
  }
  for (int i = threadIdx.x; i < kOnePassWarps * num_keys; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  const int place = static_cast<int>(block_place);
  const bool last_place = place == static_cast<int>(gridDim.x) - 1;
  if (last_place) clear_outputs();

  // Count each warp's chunks.
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const KeyCounters counters{counts + warp * num_keys, 1};
  const int64_t first_chunk = (int64_t{place} * kOnePassWarps + warp) * chunks_per_warp;
  const int64_t end_chunk = first_chunk + chunks_per_warp;
  for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
    CountChunk(key_of, chunk, num_entries, counters);
  }
  __syncthreads();

  // Per key: the warps' counts become their offsets within the block, the block's count is
  // published (every key before any wait), and the earlier blocks' counts are added.
  for (int key = threadIdx.x; key < num_keys; key += blockDim.x) {
    int32_t block_count = 0;
    for (int w = 0; w < kOnePassWarps; ++w) {
      const int32_t count = counts[w * num_keys + key];
      counts[w * num_keys + key] = block_count;
      block_count += count;
    }
    Publish(&states[int64_t{place} * num_keys + key], flag, block_count);
  }
  for (int key = threadIdx.x; key < num_keys; key += blockDim.x) {
    const int32_t before = EarlierBlocksCount(states, place, num_keys, key, flag);
    for (int w = 0; w < kOnePassWarps; ++w) counts[w * num_keys + key] += before;
    if (last_place) {
      const State own =
          StateRef(states[int64_t{place} * num_keys + key]).load(cuda::memory_order_relaxed);
      on_total(key, before + static_cast<int32_t>(static_cast<uint32_t>(own)));
    }
  }
  __syncthreads();

  // Rank each warp's chunks.
  int invalid_entries = 0;
  for (int64_t chunk = first_chunk; chunk < end_chunk; ++chunk) {
    invalid_entries += RankChunk(key_of, chunk, num_entries, counters, assign);
  }
  if (Lane() == 0 && invalid_entries > 0) atomicAdd(&block_invalid, invalid_entries);
  __syncthreads();

  // The last block to finish hands out the invalid count and readies the header for the next call.
  if (threadIdx.x == 0) {
    if (block_invalid > 0) atomicAdd(&header->invalid, block_invalid);
    __threadfence();
    if (atomicAdd(&header->finished, 1u) == gridDim.x - 1) {
      *invalid = atomicExch(&header->invalid, 0);
      atomicExch(&header->ticket, 0u);
      atomicExch(&header->finished, 0u);
      atomicAdd(&header->generation, 1u);
    }
  }
}

// The whole ranking in one launch; `workspace` holds the header, then the states. 0 < num_keys
// <= kOnePassMaxKeys, num_entries > 0.
template <typename KeyOf, typename Assign, typename OnTotal>
Status RankInOneLaunch(const KeyOf& key_of, int64_t num_entries, int num_keys, void* workspace,
                       const ZeroOutputs& clear_outputs, const OnTotal& on_total,
                       const Assign& assign, int32_t* invalid, Stream stream) {
  const OnePassLayout layout = ChooseOnePassLayout(num_entries);
  auto* header = static_cast<OnePassHeader*>(workspace);
  auto* states = reinterpret_cast<State*>(static_cast<char*>(workspace) + kHeaderBytes);
  const size_t shared_bytes = sizeof(int32_t) * kOnePassWarps * num_keys;
  RankInOnePass<<<static_cast<unsigned>(layout.blocks), kOnePassThreads, shared_bytes, stream>>>(
      key_of, num_entries, num_keys, layout.chunks_per_warp, header, states, clear_outputs,
      on_total, assign, invalid);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(RankInOnePass);
  return Status::Ok();
}

// ---- RemapWithQuotas: key = expert. The quota table's contents are trusted (the CPU reference
// checks them); only slot_rank lookups are bounds-checked, since they pick a write address.

template <typename Id>
struct ExpertKey {
  const Id* ids;
  const int32_t* copy_begin;
  int num_experts;

  __device__ Id Load(int64_t entry) const { return ids[entry]; }
  // Loads under a condition rather than behind a branch, so that LoadChunkKeys' tiles overlap.
  __device__ int Key(Id id) const {
    const bool known = id >= 0 && id < num_experts;
    const int32_t begin = known ? copy_begin[id] : 0;
    const int32_t end = known ? copy_begin[id + 1] : 0;
    if (id == -1) return kNoKey;
    return known && begin != end ? static_cast<int>(id) : kInvalidKey;
  }
};

// Entry `rank` of `expert` goes to the first copy whose cumulative quota exceeds rank, else to
// the last copy.
__device__ int CopyOfEntry(const QuotaTable& quotas, int expert, int32_t rank) {
  const int last = quotas.copy_begin[expert + 1] - 1;
  int64_t filled = 0;
  for (int copy = quotas.copy_begin[expert]; copy < last; ++copy) {
    filled += quotas.copy_quota[copy];
    if (rank < filled) return copy;
  }
  return last;
}

struct AssignCopy {
  QuotaTable quotas;
  int32_t* slot;

  __device__ void operator()(int64_t entry, int expert, int32_t rank) const {
    slot[entry] = expert < 0 ? -1 : quotas.copy_slot[CopyOfEntry(quotas, expert, rank)];
  }
};

// The same rule applied to an expert's total: copy c takes clamp(total - earlier quotas, 0,
// quota[c]) entries, the last copy everything left.
struct CountSends {
  QuotaTable quotas;
  int32_t* send_counts;

  __device__ void operator()(int expert, int32_t total) const {
    const int first = quotas.copy_begin[expert];
    const int last = quotas.copy_begin[expert + 1] - 1;
    int64_t earlier_quotas = 0;
    for (int copy = first; copy <= last; ++copy) {
      const int64_t left = max(int64_t{total} - earlier_quotas, int64_t{0});
      const int64_t taken = copy == last ? left : min(left, int64_t{quotas.copy_quota[copy]});
      earlier_quotas += quotas.copy_quota[copy];
      const int slot = quotas.copy_slot[copy];
      if (taken == 0 || slot < 0 || slot >= quotas.num_slots) continue;
      const int rank = quotas.slot_rank[slot];
      if (rank >= 0 && rank < quotas.num_ranks) {
        atomicAdd(&send_counts[rank], static_cast<int32_t>(taken));
      }
    }
  }
};

bool UsesOnePass(int num_experts) { return num_experts > 0 && num_experts <= kOnePassMaxKeys; }

template <typename Id>
Status Remap(const Id* ids, int64_t num_entries, const QuotaTable& quotas, int32_t* slot,
             int32_t* send_counts, int32_t* invalid, void* workspace, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckRemapArguments(ids, num_entries, quotas, slot, send_counts, invalid));
  KEEL_RETURN_IF_ERROR(
      CheckPointer("workspace", workspace, RemapWorkspaceBytes(num_entries, quotas.num_experts)));
  if (num_entries == 0) {
    if (quotas.num_ranks > 0) {
      KEEL_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(send_counts, 0, sizeof(int32_t) * quotas.num_ranks, stream));
    }
    KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(invalid, 0, sizeof(int32_t), stream));
    return Status::Ok();
  }

  const ExpertKey<Id> key_of{ids, quotas.copy_begin, quotas.num_experts};
  if (UsesOnePass(quotas.num_experts)) {
    return RankInOneLaunch(key_of, num_entries, quotas.num_experts, workspace,
                           ZeroOutputs{send_counts, quotas.num_ranks, nullptr},
                           CountSends{quotas, send_counts}, AssignCopy{quotas, slot}, invalid,
                           stream);
  }
  // The three passes leave the header alone, so a workspace may serve both paths.
  auto* chunk_counts =
      quotas.num_experts > 0
          ? reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + kHeaderBytes)
          : nullptr;
  KEEL_RETURN_IF_ERROR(CountAndScan(key_of, num_entries, quotas.num_experts, chunk_counts,
                                    ZeroOutputs{send_counts, quotas.num_ranks, invalid},
                                    CountSends{quotas, send_counts}, stream));
  return RankAndAssign(key_of, num_entries, quotas.num_experts, chunk_counts,
                       AssignCopy{quotas, slot}, invalid, stream);
}

// ---- PermutationIndex: key = bucket of the entry's slot. bucket_of_slot is trusted (the CPU
// reference checks it); a bucket outside [0, num_buckets) counts as invalid rather than writing
// out of bounds.

struct BucketKey {
  const int32_t* slot;
  const int32_t* bucket_of_slot;
  int num_slots;
  int num_buckets;

  __device__ int32_t Load(int64_t entry) const { return slot[entry]; }
  // As ExpertKey::Key, a load under a condition.
  __device__ int Key(int32_t s) const {
    const bool known = s >= 0 && s < num_slots;
    const int32_t bucket = known ? bucket_of_slot[s] : -1;
    if (s == -1) return kNoKey;
    return known && bucket >= 0 && bucket < num_buckets ? bucket : kInvalidKey;
  }
};

// Parks each bucket's total in bucket_begin until ScanBucketTotals turns them into offsets.
struct StoreBucketTotal {
  int32_t* bucket_begin;

  __device__ void operator()(int bucket, int32_t total) const { bucket_begin[bucket] = total; }
};

__global__ void ScanBucketTotals(int32_t* bucket_begin, int num_buckets) {
  const int32_t total = ExclusiveScanInPlace(bucket_begin, num_buckets);
  if (threadIdx.x == 0) bucket_begin[num_buckets] = total;
}

struct AssignPosition {
  const int32_t* bucket_begin;
  int32_t* position;

  __device__ void operator()(int64_t entry, int bucket, int32_t rank) const {
    position[entry] = bucket < 0 ? -1 : bucket_begin[bucket] + rank;
  }
};

}  // namespace

int64_t RemapWorkspaceBytes(int64_t num_entries, int num_experts) {
  if (num_entries <= 0 || num_experts <= 0) return 0;
  if (!UsesOnePass(num_experts)) {
    return kHeaderBytes + RankingWorkspaceBytes(num_entries, num_experts);
  }
  return kHeaderBytes + int64_t{ChooseOnePassLayout(num_entries).blocks} * num_experts *
                            static_cast<int64_t>(sizeof(State));
}

Status RemapWithQuotas(const int32_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid, void* workspace,
                       Stream stream) {
  return Remap(ids, num_entries, quotas, slot, send_counts, invalid, workspace, stream);
}

Status RemapWithQuotas(const int64_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid, void* workspace,
                       Stream stream) {
  return Remap(ids, num_entries, quotas, slot, send_counts, invalid, workspace, stream);
}

int64_t PermutationWorkspaceBytes(int64_t num_entries, int num_buckets) {
  return RankingWorkspaceBytes(num_entries, num_buckets);
}

Status PermutationIndex(const int32_t* slot, int64_t num_entries, const int32_t* bucket_of_slot,
                        int num_slots, int num_buckets, int32_t* position, int32_t* bucket_begin,
                        int32_t* invalid, void* workspace, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckPermutationIndexArguments(
      slot, num_entries, bucket_of_slot, num_slots, num_buckets, position, bucket_begin, invalid));
  KEEL_RETURN_IF_ERROR(
      CheckPointer("workspace", workspace, PermutationWorkspaceBytes(num_entries, num_buckets)));
  if (num_entries == 0) {
    KEEL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(invalid, 0, sizeof(int32_t), stream));
    KEEL_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(bucket_begin, 0, sizeof(int32_t) * (int64_t{num_buckets} + 1), stream));
    return Status::Ok();
  }

  const BucketKey key_of{slot, bucket_of_slot, num_slots, num_buckets};
  auto* chunk_counts = static_cast<int32_t*>(workspace);
  KEEL_RETURN_IF_ERROR(CountAndScan(key_of, num_entries, num_buckets, chunk_counts,
                                    ZeroOutputs{nullptr, 0, invalid},
                                    StoreBucketTotal{bucket_begin}, stream));
  ScanBucketTotals<<<1, kScanThreads, 0, stream>>>(bucket_begin, num_buckets);
  KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(ScanBucketTotals);
  return RankAndAssign(key_of, num_entries, num_buckets, chunk_counts,
                       AssignPosition{bucket_begin, position}, invalid, stream);
}

}  // namespace keel::kernels::gpu
