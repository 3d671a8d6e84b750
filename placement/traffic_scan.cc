// The planner's pass over the traffic (traffic_scan.h).
#include "placement/traffic_scan.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "common/simd.h"

namespace keel {
namespace {

// ScanByExpert with four-lane vectors, for any x86-64 CPU (AVX2 where it has it) and other
// targets. Sixteen sources at a time go through every expert, so that their sums in `sent` stay
// in four vector registers.
KEEL_AVX2_CLONES EntryBits ScanByExpertPortable(const double* by_expert, int num_experts,
                                                int num_sources, double* sent, double* lanes,
                                                double* lane_totals) {
  constexpr double kWhole = 4503599627370496.0;  // 2^52
  BitsQuad bits = {};
  BitsQuad fractional = {};
  auto check = [&](const DoubleQuad& quad) {
    bits |= (BitsQuad)quad;
    fractional |= (BitsQuad)((quad + kWhole) - kWhole != quad);
  };
  // Expert e's lanes plus `part`; its first block sets them.
  auto add_lanes = [&](int block, int e, const DoubleQuad& part) {
    DoubleQuad sum = part;
    if (block > 0) {
      std::memcpy(&sum, lanes + 4 * static_cast<size_t>(e), sizeof sum);
      sum += part;
    }
    std::memcpy(lanes + 4 * static_cast<size_t>(e), &sum, sizeof sum);
  };
  int block = 0;
  for (; block + 16 <= num_sources; block += 16) {
    DoubleQuad s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int e = 0; e < num_experts; ++e) {
      const double* row = by_expert + static_cast<size_t>(e) * num_sources + block;
      DoubleQuad q0, q1, q2, q3;
      std::memcpy(&q0, row, sizeof q0);
      std::memcpy(&q1, row + 4, sizeof q1);
      std::memcpy(&q2, row + 8, sizeof q2);
      std::memcpy(&q3, row + 12, sizeof q3);
      check(q0);
      check(q1);
      check(q2);
      check(q3);
      s0 += q0;
      s1 += q1;
      s2 += q2;
      s3 += q3;
      add_lanes(block, e, (q0 + q1) + (q2 + q3));
    }
    std::memcpy(sent + block, &s0, sizeof s0);
    std::memcpy(sent + block + 4, &s1, sizeof s1);
    std::memcpy(sent + block + 8, &s2, sizeof s2);
    std::memcpy(sent + block + 12, &s3, sizeof s3);
  }
  // The last 4, 8 or 12 sources, a quad at a time.
  for (; block < num_sources; block += 4) {
    DoubleQuad sum = {};
    for (int e = 0; e < num_experts; ++e) {
      DoubleQuad quad;
      std::memcpy(&quad, by_expert + static_cast<size_t>(e) * num_sources + block, sizeof quad);
      check(quad);
      sum += quad;
      add_lanes(block, e, quad);
    }
    std::memcpy(sent + block, &sum, sizeof sum);
  }
  for (int e = 0; e < num_experts; ++e) {
    const double* lane = lanes + 4 * static_cast<size_t>(e);
    lane_totals[e] = (lane[0] + lane[1]) + (lane[2] + lane[3]);
  }
  EntryBits entries;
  entries.bits = bits[0] | bits[1] | bits[2] | bits[3];
  entries.fractional = (fractional[0] | fractional[1] | fractional[2] | fractional[3]) != 0;
  return entries;
}

// ScanCounts's sums in progress: each expert's sum over the sources so far (eight lanes), and for
// the single-rank experts what each source sends to its node's, what each rank's receive from
// their node (eight lanes) and what they receive from their own rank. Unsigned 32-bit lanes: a
// sum past the range wraps, where a signed one would overflow (CountSumsExact then rules the sums
// out).
struct CountLanes {
  std::uint32_t* expert;     // [8 * num_experts]
  std::uint32_t* to_node;    // [num_sources]
  std::uint32_t* from_node;  // [8 * num_sources]
  std::uint32_t* kept;       // [num_sources]
};

// ScanCounts on the sources [block, block + 8 * kOcts) of every expert, in ascending order. The
// sums over the experts stay in kOcts vector registers until `sent` takes them; a node of eight
// ranks that starts at a multiple of eight adds to its link sums as one vector, any other rank by
// rank. ORs the entries into `bits`, lane by lane. (Vectors pass by reference: by value, the
// baseline clone's calling convention would differ from the AVX2 one's.)
template <int kOcts>
KEEL_INLINE inline void CountBlock(const std::int32_t* counts, int num_experts, int num_sources,
                                   int block, const SingleExpert* experts, const CountLanes& lanes,
                                   double* sent, UintOct& bits) {
  constexpr int kWidth = 8 * kOcts;
  UintOct sums[kOcts] = {};
  auto load = [](const void* from, UintOct& oct)
                  KEEL_INLINE { std::memcpy(&oct, from, sizeof oct); };
  auto add_to = [&](std::uint32_t* to, const UintOct& oct) KEEL_INLINE {
    UintOct sum;
    load(to, sum);
    sum += oct;
    std::memcpy(to, &sum, sizeof sum);
  };
  for (int e = 0; e < num_experts; ++e) {
    const std::int32_t* column = counts + static_cast<size_t>(e) * num_sources;
    UintOct octs[kOcts];
#pragma GCC unroll 8
    for (int k = 0; k < kOcts; ++k) {
      load(column + block + 8 * k, octs[k]);
      sums[k] += octs[k];
      bits |= octs[k];
    }
    const SingleExpert& single = experts[e];
    if (single.rank >= 0) {
      const int first = single.first;
      const int rank = single.rank;
      if (first % 8 == 0 && single.last - first == 8) {
        if (first >= block && first < block + kWidth) {
          // Read again (from L1): indexing `octs` here would keep it in memory.
          UintOct part;
          load(column + first, part);
          add_to(lanes.to_node + first, part);
          add_to(lanes.from_node + 8 * static_cast<size_t>(rank), part);
        }
      } else {
        const int high = std::min(single.last, block + kWidth);
        for (int s = std::max(first, block); s < high; ++s) {
          lanes.to_node[s] += column[s];
          lanes.from_node[8 * static_cast<size_t>(rank)] += column[s];
        }
      }
      if (rank >= block && rank < block + kWidth) lanes.kept[rank] += column[rank];
    }
#pragma GCC unroll 8
    for (int width = 1; width < kOcts; width *= 2) {
#pragma GCC unroll 8
      for (int k = 0; k + width < kOcts; k += 2 * width) octs[k] += octs[k + width];
    }
    std::uint32_t* lane = lanes.expert + 8 * static_cast<size_t>(e);
    if (block > 0) {
      add_to(lane, octs[0]);
    } else {
      std::memcpy(lane, &octs[0], sizeof octs[0]);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < kOcts; ++k) {
    for (int l = 0; l < 8; ++l) sent[block + 8 * k + l] = sums[k][l];
  }
}

// Writes the sum of each of lanes[8 * i, 8 * i + 8), i < count, to out[i] (added with kAdd),
// eight at a time, and to whole[i] as it is, when `whole` is given.
template <bool kAdd>
KEEL_INLINE inline void AddLaneSums(const std::uint32_t* lanes, int count, double* out,
                                    long long* whole = nullptr) {
  // `sum`: adjacent lanes of a and b added, a's four sums, then b's.
  auto pairs = [](const UintOct& a, const UintOct& b, UintOct& sum) KEEL_INLINE {
    sum = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
          __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
  };
  auto put = [&](int i, std::int64_t sum) KEEL_INLINE {
    out[i] = kAdd ? out[i] + static_cast<double>(sum) : static_cast<double>(sum);
    if (whole != nullptr) whole[i] = sum;
  };
  int i = 0;
  for (; i + 8 <= count; i += 8) {
    // Three rounds of pairs leave eight sums.
    UintOct lane[8], half[4], quarter[2], sums;
    std::memcpy(lane, lanes + 8 * static_cast<size_t>(i), sizeof lane);
    for (int k = 0; k < 4; ++k) pairs(lane[2 * k], lane[2 * k + 1], half[k]);
    for (int k = 0; k < 2; ++k) pairs(half[2 * k], half[2 * k + 1], quarter[k]);
    pairs(quarter[0], quarter[1], sums);
    for (int l = 0; l < 8; ++l) put(i + l, sums[l]);
  }
  for (; i < count; ++i) {
    std::int64_t sum = 0;
    for (int l = 0; l < 8; ++l) sum += lanes[8 * static_cast<size_t>(i) + l];
    put(i, sum);
  }
}

}  // namespace

KEEL_AVX2_CLONES EntryBits ScanEntries(const double* values, size_t n) {
  constexpr double kWhole = 4503599627370496.0;  // 2^52
  BitsQuad bits = {};
  BitsQuad fractional = {};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    DoubleQuad quad;
    std::memcpy(&quad, values + i, sizeof quad);
    bits |= (BitsQuad)quad;
    fractional |= (BitsQuad)((quad + kWhole) - kWhole != quad);
  }
  EntryBits entries;
  entries.bits = bits[0] | bits[1] | bits[2] | bits[3];
  entries.fractional = (fractional[0] | fractional[1] | fractional[2] | fractional[3]) != 0;
  for (; i < n; ++i) {
    entries.bits |= std::bit_cast<std::uint64_t>(values[i]);
    entries.fractional |= (values[i] + kWhole) - kWhole != values[i];
  }
  return entries;
}

namespace {

// ScanCounts in blocks of 8 * kOcts sources (the last ones eight at a time), then the sums from
// their lanes.
template <int kOcts>
KEEL_INLINE inline std::uint32_t ScanCountsBody(const std::int32_t* counts, int num_experts,
                                                int num_sources, const SingleExpert* experts,
                                                std::uint32_t* scratch, const CountSums& sums) {
  const size_t num_ranks = static_cast<size_t>(num_sources);
  const CountLanes lanes{.expert = scratch,
                         .to_node = scratch + 8 * static_cast<size_t>(num_experts),
                         .from_node = scratch + 8 * static_cast<size_t>(num_experts) + num_ranks,
                         .kept = scratch + 8 * static_cast<size_t>(num_experts) + 9 * num_ranks};
  std::fill(lanes.to_node, lanes.to_node + 10 * num_ranks, 0);
  UintOct bits = {};
  int block = 0;
  for (; block + 8 * kOcts <= num_sources; block += 8 * kOcts) {
    CountBlock<kOcts>(counts, num_experts, num_sources, block, experts, lanes, sums.sent, bits);
  }
  for (; block < num_sources; block += 8) {
    CountBlock<1>(counts, num_experts, num_sources, block, experts, lanes, sums.sent, bits);
  }
  AddLaneSums<false>(lanes.expert, num_experts, sums.totals, sums.whole_totals);
  AddLaneSums<true>(lanes.from_node, num_sources, sums.from_node);
  for (int s = 0; s < num_sources; ++s) {
    sums.to_node[s] += lanes.to_node[s];
    sums.kept[s] += lanes.kept[s];
  }
  std::uint32_t all = 0;
  for (int l = 0; l < 8; ++l) all |= static_cast<std::uint32_t>(bits[l]);
  return all;
}

// Four vectors of sources at a time: the AVX2 clone has 16 vector registers.
KEEL_AVX2_CLONES std::uint32_t ScanCountsPortable(const std::int32_t* counts, int num_experts,
                                                  int num_sources, const SingleExpert* experts,
                                                  std::uint32_t* scratch, const CountSums& sums) {
  return ScanCountsBody<4>(counts, num_experts, num_sources, experts, scratch, sums);
}

}  // namespace

std::uint32_t ScanCounts(const std::int32_t* counts, int num_experts, int num_sources,
                         const SingleExpert* experts, std::uint32_t* scratch,
                         const CountSums& sums) {
  return ScanCountsPortable(counts, num_experts, num_sources, experts, scratch, sums);
}

EntryBits ScanByExpert(const double* by_expert, int num_experts, int num_sources, double* sent,
                       double* lanes, double* lane_totals) {
  return ScanByExpertPortable(by_expert, num_experts, num_sources, sent, lanes, lane_totals);
}

}  // namespace keel
