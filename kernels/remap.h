// Logical -> physical remap with quotas: the per-step quota plan says how many of this rank's
// entries of each expert go to each of the expert's copies; these functions give every (token, k)
// entry its physical slot, deterministically, and count what goes to each destination rank.
#pragma once

#include <cstdint>
#include <span>

#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

// This rank's quotas for one layer and step, by expert in CSR form: the copies of expert e are
// c in [copy_begin[e], copy_begin[e + 1]); copy c is physical slot copy_slot[c] and receives
// copy_quota[c] of this rank's entries of e. All pointers are on the device that runs the kernel.
struct QuotaTable {
  const int32_t* copy_begin = nullptr;  // [num_experts + 1] int32, non-decreasing, from 0
  const int32_t* copy_slot = nullptr;   // [num_copies] int32, each in [0, num_slots)
  const int32_t* copy_quota = nullptr;  // [num_copies] int32, each >= 0
  const int32_t* slot_rank = nullptr;   // [num_slots] int32: the rank that holds each slot
  int num_experts = 0;
  int num_copies = 0;  // copy_begin[num_experts]
  int num_slots = 0;
  int num_ranks = 0;
};

// A table over arrays that hold it (host or device memory alike); the counts come from the sizes.
QuotaTable MakeQuotaTable(std::span<const int32_t> copy_begin, std::span<const int32_t> copy_slot,
                          std::span<const int32_t> copy_quota, std::span<const int32_t> slot_rank,
                          int num_ranks);

// The assignment rule, the same on every device: the entries of expert e, taken in entry order
// (token-major, then k), fill e's copies in CSR order, copy c taking copy_quota[c] of them; entries
// past the sum of e's quotas (rounding dust) go to e's last copy. An entry of -1 gets slot -1; an
// entry whose expert is invalid or has no copy gets slot -1 and is counted in `invalid`.

namespace cpu {

//   ids:         [num_entries] int32 or int64 ([num_tokens, top_k] flattened)
//   slot:        [num_entries] int32, overwritten: the physical slot of each entry, or -1
//   send_counts: [num_ranks] int32, overwritten: entries assigned to slots on each rank
//   invalid:     [1] int32, overwritten
Status RemapWithQuotas(const int32_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid);
Status RemapWithQuotas(const int64_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid);

}  // namespace cpu

namespace gpu {

// Device pointers, enqueued on `stream`; `workspace` holds the per-block counts of the stable
// ranking and must have RemapWorkspaceBytes(num_entries, num_experts) bytes (device memory). It
// carries a little state from one call to the next: zero-fill it once after allocating it (e.g.
// cudaMemset), and each call leaves it ready for the next. One workspace serves one stream at a
// time; it may serve calls of any size up to the one it was sized for. With up to 1024 experts the
// remap is one launch (a workspace that was not zero-filled makes that launch fail with a device
// error rather than hang); with more it is three.
int64_t RemapWorkspaceBytes(int64_t num_entries, int num_experts);
Status RemapWithQuotas(const int32_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid, void* workspace,
                       Stream stream);
Status RemapWithQuotas(const int64_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid, void* workspace,
                       Stream stream);

}  // namespace gpu
}  // namespace keel::kernels
