// CPU references of the expert histograms: one pass over the entries in order.
#include "kernels/histogram.h"

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/arguments.h"

namespace keel::kernels::cpu {
namespace {

template <typename Id>
Status Expert(const Id* ids, int64_t num_entries, int num_experts, int32_t* counts,
              int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(
      CheckExpertHistogramArguments(ids, num_entries, num_experts, counts, invalid));
  std::fill(counts, counts + num_experts, 0);
  int32_t bad = 0;
  for (int64_t i = 0; i < num_entries; ++i) {
    const Id id = ids[i];
    if (id >= 0 && id < num_experts) {
      ++counts[id];
    } else if (id != -1) {
      ++bad;
    }
  }
  *invalid = bad;
  return Status::Ok();
}

template <typename Id>
Status Rank(const Id* ids, int64_t num_tokens, int top_k, const int32_t* rank_of, int num_ids,
            int num_ranks, int32_t* entries, int32_t* tokens, int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(CheckRankHistogramArguments(ids, num_tokens, top_k, rank_of, num_ids,
                                                   num_ranks, entries, tokens, invalid));
  for (int i = 0; i < num_ids; ++i) {
    if (rank_of[i] < 0 || rank_of[i] >= num_ranks) {
      return InvalidArgument("rank_of[" + std::to_string(i) + "] = " + std::to_string(rank_of[i]) +
                             " is not a rank in [0, " + std::to_string(num_ranks) + ")");
    }
  }
  std::fill(entries, entries + num_ranks, 0);
  std::fill(tokens, tokens + num_ranks, 0);
  // last_token[r]: the last token counted on rank r, so a token counts once per rank.
  std::vector<int64_t> last_token(num_ranks, -1);
  int32_t bad = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < top_k; ++k) {
      const Id id = ids[t * top_k + k];
      if (id < 0 || id >= num_ids) {
        if (id != -1) ++bad;
        continue;
      }
      const int rank = rank_of[id];
      ++entries[rank];
      if (last_token[rank] != t) {
        last_token[rank] = t;
        ++tokens[rank];
      }
    }
  }
  *invalid = bad;
  return Status::Ok();
}

}  // namespace

Status ExpertHistogram(const int32_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid) {
  return Expert(ids, num_entries, num_experts, counts, invalid);
}

Status ExpertHistogram(const int64_t* ids, int64_t num_entries, int num_experts, int32_t* counts,
                       int32_t* invalid) {
  return Expert(ids, num_entries, num_experts, counts, invalid);
}

Status RankHistogram(const int32_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid) {
  return Rank(ids, num_tokens, top_k, rank_of, num_ids, num_ranks, entries, tokens, invalid);
}

Status RankHistogram(const int64_t* ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
                     int num_ids, int num_ranks, int32_t* entries, int32_t* tokens,
                     int32_t* invalid) {
  return Rank(ids, num_tokens, top_k, rank_of, num_ids, num_ranks, entries, tokens, invalid);
}

}  // namespace keel::kernels::cpu
