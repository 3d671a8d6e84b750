// The per-step planner's one pass over the traffic (internal to placement/: its caller is
// step_planner.cc), over doubles (ScanByExpert) or 32-bit counts (ScanCounts). One version of
// each, in portable vector code (common/simd.h) that the compiler also builds for AVX2.
#pragma once

#include <cstddef>
#include <cstdint>

namespace keel {

// What one pass over the traffic tells: `bits`, the OR of the entries' bit patterns, whose sign
// bit is set when some entry is negative, -0.0 or a NaN with its sign bit; `fractional`, whether
// some entry is not a whole number. An entry of 2^52 or more (all whole) or an infinity may count
// either way (the pass tests (x + 2^52) - 2^52 == x), and a NaN counts as fractional: the caller
// sends either to its exact checks through the totals.
struct EntryBits {
  std::uint64_t bits = 0;
  bool fractional = false;
};

// The one pass over the traffic by expert (`num_sources` entries per expert, a multiple of 4):
// the EntryBits of every entry; lane_totals[e], expert e's sources added in four lanes (kept in
// lanes[4 * e, 4 * e + 4), scratch, until the end) and then across them; and sent[s] (set, not
// added to), what source s sends to all experts. Such a sum differs from the sum in source (or
// expert) order only in rounding, so it is that sum whenever every partial sum is exact: whole
// entries whose total stays below 2^53.
EntryBits ScanByExpert(const double* by_expert, int num_experts, int num_sources, double* sent,
                       double* lanes, double* lane_totals);

// EntryBits of values[0, n), where ScanByExpert does not apply.
EntryBits ScanEntries(const double* values, std::size_t n);

// An expert whose copies all sit on `rank`, whose node's ranks are [first, last); ScanCounts
// takes rank -1 for an expert whose copies sit on several ranks (or none).
struct SingleExpert {
  int expert = 0;
  int rank = 0;
  int first = 0;
  int last = 0;
};

// Where ScanCounts writes. Every source is a rank (source s is rank s).
struct CountSums {
  double* totals = nullptr;  // [num_experts] set: each expert's count over all sources
  double* sent = nullptr;    // [num_sources] set: each source's count over all experts
  // [num_sources] each added to, for the single-rank experts: to_node[s], what source s sends to
  // those of its node; from_node[r], what rank r's receive from their node's sources (its own
  // included); kept[r], what they receive from r itself.
  double* to_node = nullptr;
  double* from_node = nullptr;
  double* kept = nullptr;
  // [num_experts] set when given: `totals` as integers, for a caller that needs both.
  long long* whole_totals = nullptr;
};

// The 32-bit scratch that ScanCounts needs.
constexpr std::size_t ScanCountsScratch(int num_experts, int num_sources) {
  return 8 * static_cast<std::size_t>(num_experts) + 10 * static_cast<std::size_t>(num_sources);
}

// The one pass over integer token counts by expert, `counts` [num_experts * num_sources] (entry
// e * num_sources + s: what source s sends to expert e), `num_sources` a multiple of 8. experts[e]
// says where expert e's copies sit (each node a run of consecutive ranks). Writes `sums`;
// `scratch` [ScanCountsScratch(...)]. Returns the OR of every entry: the sums are exact where
// CountSumsExact(that OR, num_experts * num_sources) holds, as they go in unsigned 32-bit lanes
// (which wrap where it does not; the caller then drops them).
std::uint32_t ScanCounts(const std::int32_t* counts, int num_experts, int num_sources,
                         const SingleExpert* experts, std::uint32_t* scratch,
                         const CountSums& sums);

// Whether ScanCounts's sums are exact: no entry is negative, and `num_entries` entries as large
// as the OR of them all add up to less than 2^31.
inline bool CountSumsExact(std::uint32_t bits, std::size_t num_entries) {
  return bits < (std::uint32_t{1} << 31) &&
         static_cast<std::uint64_t>(bits) * num_entries < (std::uint64_t{1} << 31);
}

}  // namespace keel
