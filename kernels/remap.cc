// CPU reference of the logical -> physical remap: one pass over the entries with a running count
// per expert, which is the stable ranking the GPU computes block by block.
#include "kernels/remap.h"

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/arguments.h"

namespace keel::kernels {

QuotaTable MakeQuotaTable(std::span<const int32_t> copy_begin, std::span<const int32_t> copy_slot,
                          std::span<const int32_t> copy_quota, std::span<const int32_t> slot_rank,
                          int num_ranks) {
  QuotaTable table;
  table.copy_begin = copy_begin.data();
  table.copy_slot = copy_slot.data();
  table.copy_quota = copy_quota.data();
  table.slot_rank = slot_rank.data();
  table.num_experts = copy_begin.empty() ? 0 : static_cast<int>(copy_begin.size()) - 1;
  table.num_copies = static_cast<int>(copy_slot.size());
  table.num_slots = static_cast<int>(slot_rank.size());
  table.num_ranks = num_ranks;
  return table;
}

namespace cpu {
namespace {

// The table's contents must make sense before any entry is assigned (the GPU trusts them).
Status CheckQuotaContents(const QuotaTable& quotas) {
  if (quotas.num_experts > 0 && quotas.copy_begin[0] != 0) {
    return InvalidArgument("quotas.copy_begin[0] = " + std::to_string(quotas.copy_begin[0]) +
                           ", not 0");
  }
  for (int e = 0; e < quotas.num_experts; ++e) {
    if (quotas.copy_begin[e + 1] < quotas.copy_begin[e]) {
      return InvalidArgument("quotas.copy_begin decreases at expert " + std::to_string(e + 1) +
                             ": " + std::to_string(quotas.copy_begin[e]) + " -> " +
                             std::to_string(quotas.copy_begin[e + 1]));
    }
  }
  if (quotas.copy_begin[quotas.num_experts] != quotas.num_copies) {
    return InvalidArgument("quotas.copy_begin[num_experts] = " +
                           std::to_string(quotas.copy_begin[quotas.num_experts]) +
                           " is not num_copies = " + std::to_string(quotas.num_copies));
  }
  for (int c = 0; c < quotas.num_copies; ++c) {
    if (quotas.copy_slot[c] < 0 || quotas.copy_slot[c] >= quotas.num_slots) {
      return InvalidArgument("quotas.copy_slot[" + std::to_string(c) +
                             "] = " + std::to_string(quotas.copy_slot[c]) +
                             " is not a slot in [0, " + std::to_string(quotas.num_slots) + ")");
    }
    if (quotas.copy_quota[c] < 0) {
      return InvalidArgument("quotas.copy_quota[" + std::to_string(c) +
                             "] = " + std::to_string(quotas.copy_quota[c]) + " is negative");
    }
  }
  for (int s = 0; s < quotas.num_slots; ++s) {
    if (quotas.slot_rank[s] < 0 || quotas.slot_rank[s] >= quotas.num_ranks) {
      return InvalidArgument("quotas.slot_rank[" + std::to_string(s) +
                             "] = " + std::to_string(quotas.slot_rank[s]) +
                             " is not a rank in [0, " + std::to_string(quotas.num_ranks) + ")");
    }
  }
  return Status::Ok();
}

template <typename Id>
Status Remap(const Id* ids, int64_t num_entries, const QuotaTable& quotas, int32_t* slot,
             int32_t* send_counts, int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(CheckRemapArguments(ids, num_entries, quotas, slot, send_counts, invalid));
  KEEL_RETURN_IF_ERROR(CheckQuotaContents(quotas));
  std::fill(send_counts, send_counts + quotas.num_ranks, 0);
  // copy[e]: the copy that takes e's next entry; left[e]: how much of its quota is left.
  std::vector<int32_t> copy(quotas.copy_begin, quotas.copy_begin + quotas.num_experts);
  std::vector<int64_t> left(quotas.num_experts, 0);
  for (int e = 0; e < quotas.num_experts; ++e) {
    if (copy[e] < quotas.copy_begin[e + 1]) left[e] = quotas.copy_quota[copy[e]];
  }
  int32_t bad = 0;
  for (int64_t i = 0; i < num_entries; ++i) {
    const Id id = ids[i];
    slot[i] = -1;
    if (id == -1) continue;
    if (id < 0 || id >= quotas.num_experts || quotas.copy_begin[id] == quotas.copy_begin[id + 1]) {
      ++bad;
      continue;
    }
    const int32_t last = quotas.copy_begin[id + 1] - 1;
    while (left[id] == 0 && copy[id] < last) left[id] = quotas.copy_quota[++copy[id]];
    --left[id];  // the last copy absorbs entries past every quota: harmlessly negative
    slot[i] = quotas.copy_slot[copy[id]];
    ++send_counts[quotas.slot_rank[slot[i]]];
  }
  *invalid = bad;
  return Status::Ok();
}

}  // namespace

Status RemapWithQuotas(const int32_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid) {
  return Remap(ids, num_entries, quotas, slot, send_counts, invalid);
}

Status RemapWithQuotas(const int64_t* ids, int64_t num_entries, const QuotaTable& quotas,
                       int32_t* slot, int32_t* send_counts, int32_t* invalid) {
  return Remap(ids, num_entries, quotas, slot, send_counts, invalid);
}

}  // namespace cpu
}  // namespace keel::kernels
