// The per-step planner's one pass over the traffic (internal to placement/: its caller is
// step_planner.cc), in a portable version and one for CPUs with AVX-512.
#pragma once

#include <cstddef>
#include <cstdint>

namespace keel {

// What one pass over the traffic tells: `bits`, the OR of the entries' bit patterns, whose sign
// bit is set when some entry is negative, -0.0 or a NaN with its sign bit; `fractional`, whether
// some entry is not a whole number. An entry of 2^52 or more (all whole) or an infinity may count
// either way (the portable pass tests (x + 2^52) - 2^52 == x, the AVX-512 pass x - round(x) == 0),
// and a NaN counts as fractional: the caller sends either to its exact checks through the totals.
struct EntryBits {
  std::uint64_t bits = 0;
  bool fractional = false;
};

// Which version of ScanByExpert runs: the best the CPU has, or the named one (tests compare them).
enum class ScanPath { kBest, kPortable, kAvx512 };
// Whether `path` runs as named on this CPU (kAvx512 needs AVX-512 F, DQ and VL; without it
// ScanByExpert falls back to the portable pass).
bool ScanPathAvailable(ScanPath path);

// The one pass over the traffic by expert (`num_sources` entries per expert, a multiple of 4):
// the EntryBits of every entry; lane_totals[e], expert e's sources added in four lanes (kept in
// lanes[4 * e, 4 * e + 4), scratch, until the end) and then across them; and sent[s] (set, not
// added to), what source s sends to all experts. Such a sum differs from the sum in source (or
// expert) order only in rounding, so it is that sum whenever every partial sum is exact: whole
// entries whose total stays below 2^53. Every path gives the same bits then.
EntryBits ScanByExpert(const double* by_expert, int num_experts, int num_sources, double* sent,
                       double* lanes, double* lane_totals, ScanPath path = ScanPath::kBest);

// EntryBits of values[0, n), where ScanByExpert does not apply.
EntryBits ScanEntries(const double* values, std::size_t n);

}  // namespace keel
