// Expert histograms of router output: how many (token, k) entries chose each expert, and how many
// entries and distinct tokens go to each destination rank. Counts are integers, so the GPU and
// the CPU give the same result whatever the order of atomic adds.
#pragma once

#include <cstdint>

#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

// Router output as every kernel here reads it: `ids` is [num_tokens, top_k] row-major, int32 or
// int64, entry i = (token i / top_k, k i % top_k). -1 marks an unused entry (a dropped token);
// any other id outside [0, num_ids) is invalid: it is counted in `invalid` and otherwise ignored.

namespace cpu {

// counts[e] = entries with id e.
//   ids:     [num_entries] int32 or int64
//   counts:  [num_experts] int32, overwritten
//   invalid: [1] int32, overwritten: entries with an invalid id
Status ExpertHistogram(const int32_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid);
Status ExpertHistogram(const int64_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid);

// Per destination rank, where id x lives on rank rank_of[x] (an expert's home rank, or a
// physical slot's rank when `ids` are slots):
//   entries[r] = (token, k) entries sent to rank r;
//   tokens[r]  = tokens with at least one entry on rank r (what a dispatch that sends a token
//                once per rank moves).
//   ids:      [num_tokens, top_k] int32 or int64
//   rank_of:  [num_ids] int32, each in [0, num_ranks)
//   entries:  [num_ranks] int32, overwritten
//   tokens:   [num_ranks] int32, overwritten
//   invalid:  [1] int32, overwritten
Status RankHistogram(const int32_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid);
Status RankHistogram(const int64_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid);

}  // namespace cpu

namespace gpu {

// The same functions on device pointers, enqueued on `stream` (outputs are complete when the
// stream reaches this point). Host-side argument errors return at once; launch errors too.

// ExpertHistogram counts in one launch: the blocks add their counts into `workspace`, and the last
// block to finish moves them to `counts` and clears the workspace for the next call. `workspace`
// is device memory of HistogramWorkspaceBytes(num_experts) bytes, zero-filled once when allocated;
// calls that share one must not overlap (one stream). It may serve calls with fewer experts.
int64_t HistogramWorkspaceBytes(int num_experts);
Status ExpertHistogram(const int32_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid, void* workspace, Stream stream);
Status ExpertHistogram(const int64_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid, void* workspace, Stream stream);
Status RankHistogram(const int32_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid, Stream stream);
Status RankHistogram(const int64_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid, Stream stream);

}  // namespace gpu
}  // namespace keel::kernels
