// ScanByExpert, the per-step planner's pass over the traffic: it gives the exact totals and what
// each source sends, and flags every entry that sends the planner to its exact checks, wherever in
// the rows it sits. ScanCounts, the same pass over integer counts: it gives the exact sums, the
// single-rank experts' link sums included, for nodes of every shape and any number of blocks.
#include "placement/traffic_scan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace keel {
namespace {

constexpr std::uint64_t kSignBit = std::uint64_t{1} << 63;

struct Scanned {
  EntryBits entries;
  std::vector<double> sent;
  std::vector<double> totals;
};

Scanned Scan(const std::vector<double>& by_expert, int num_experts, int num_sources) {
  Scanned out;
  // Leftovers of an earlier scan must not leak into this one.
  out.sent.assign(num_sources, -7.0);
  out.totals.assign(num_experts, -7.0);
  std::vector<double> lanes(4 * static_cast<size_t>(num_experts), -7.0);
  out.entries = ScanByExpert(by_expert.data(), num_experts, num_sources, out.sent.data(),
                             lanes.data(), out.totals.data());
  return out;
}

// Whole entries below 2^52 in all, so every sum is exact in any order: the pass must give the
// sums in source and expert order, bit for bit.
TEST(TrafficScanTest, GivesTheExactSums) {
  std::mt19937 rng(7);
  int cases = 0;
  for (int num_sources : {4, 8, 12, 16, 28, 32, 36, 44, 60, 64, 68, 96, 100, 128}) {
    for (int num_experts : {1, 3, 17, 64}) {
      std::vector<double> by_expert(static_cast<size_t>(num_experts) * num_sources);
      for (double& x : by_expert) x = rng() % 5 == 0 ? 0.0 : static_cast<double>(rng() % 100000);
      std::vector<double> sent(num_sources, 0.0);
      std::vector<double> totals(num_experts, 0.0);
      for (int e = 0; e < num_experts; ++e) {
        for (int s = 0; s < num_sources; ++s) {
          sent[s] += by_expert[static_cast<size_t>(e) * num_sources + s];
          totals[e] += by_expert[static_cast<size_t>(e) * num_sources + s];
        }
      }
      {
        SCOPED_TRACE(std::to_string(num_experts) + " experts x " + std::to_string(num_sources) +
                     " sources");
        const Scanned scanned = Scan(by_expert, num_experts, num_sources);
        EXPECT_EQ(scanned.entries.bits & kSignBit, 0u);
        EXPECT_FALSE(scanned.entries.fractional);
        EXPECT_EQ(std::memcmp(scanned.sent.data(), sent.data(), sizeof(double) * num_sources), 0);
        EXPECT_EQ(std::memcmp(scanned.totals.data(), totals.data(), sizeof(double) * num_experts),
                  0);
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 14 * 4);
}

// One entry that the fast path must not take, put first, last, in a block of 32 sources and in
// the quads after it: the pass flags it, as ScanEntries does.
TEST(TrafficScanTest, FlagsWhatNeedsTheExactChecks) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // A negative entry goes to the exact checks whatever its fraction, so its fraction flag is not
  // checked.
  enum Fraction { kWhole, kFractional, kEither };
  struct Bad {
    double value;
    bool negative;        // the sign bit of EntryBits::bits
    Fraction fractional;  // EntryBits::fractional
  };
  const std::vector<Bad> bads = {
      {0.5, false, kFractional},    {3.25, false, kFractional},
      {1e-300, false, kFractional}, {4503599627370495.5, false, kFractional},  // 2^52 - 0.5
      {-3.0, true, kEither},        {-0.0, true, kEither},
      {-2.5, true, kEither},        {nan, false, kFractional},
      {-nan, true, kFractional},
  };
  std::mt19937 rng(8);
  const int num_experts = 5;
  for (int num_sources : {4, 12, 32, 36, 64, 72}) {
    std::vector<double> whole(static_cast<size_t>(num_experts) * num_sources);
    for (double& x : whole) x = static_cast<double>(rng() % 1000);
    const std::vector<size_t> spots = {0, whole.size() - 1, static_cast<size_t>(num_sources / 2),
                                       static_cast<size_t>(3 * num_sources - 3)};
    for (const Bad& bad : bads) {
      for (size_t spot : spots) {
        std::vector<double> by_expert = whole;
        by_expert[spot] = bad.value;
        const EntryBits reference = ScanEntries(by_expert.data(), by_expert.size());
        {
          SCOPED_TRACE(std::to_string(bad.value) + " at " + std::to_string(spot) + " of " +
                       std::to_string(num_sources) + " sources");
          const EntryBits entries = Scan(by_expert, num_experts, num_sources).entries;
          EXPECT_EQ((entries.bits & kSignBit) != 0, bad.negative);
          EXPECT_EQ(entries.bits & kSignBit, reference.bits & kSignBit);
          if (bad.fractional != kEither) {
            EXPECT_EQ(entries.fractional, bad.fractional == kFractional);
            EXPECT_EQ(entries.fractional, reference.fractional);
          }
        }
      }
    }
  }
}

// Counts in 32-bit lanes add up to what 64-bit sums in expert and source order give: ranks from 8
// to 136 (one block of 64 or more, and blocks of 8 after them), nodes of 8 (one vector each), of 4,
// 6 and 12 (rank by rank, some across two blocks), experts on one rank or spread, expert counts
// that are and are not multiples of 8. Sums added to are added to.
TEST(TrafficScanTest, CountsGiveTheExactSums) {
  std::mt19937 rng(23);
  const std::pair<int, int> shapes[] = {{1, 8}, {2, 4},  {2, 8},  {4, 6}, {2, 12},
                                        {9, 8}, {6, 12}, {17, 8}, {3, 8}};
  for (const auto& [num_nodes, per_node] : shapes) {
    const int num_ranks = num_nodes * per_node;
    for (const int num_experts : {1, 8, 13, 64}) {
      std::vector<std::int32_t> counts(static_cast<size_t>(num_experts) * num_ranks);
      for (std::int32_t& c : counts) c = rng() % 5 == 0 ? 0 : static_cast<int>(rng() % 5000);
      std::vector<SingleExpert> experts(num_experts);
      for (int e = 0; e < num_experts; ++e) {
        const int rank = rng() % 4 == 0 ? -1 : static_cast<int>(rng() % num_ranks);
        const int first = rank >= 0 ? rank / per_node * per_node : 0;
        experts[e] = {e, rank, first, rank >= 0 ? first + per_node : 0};
      }
      // The sums in order, in 64 bits.
      std::vector<std::int64_t> totals(num_experts, 0), sent(num_ranks, 0), to_node(num_ranks, 0),
          from_node(num_ranks, 0), kept(num_ranks, 0);
      std::uint32_t bits = 0;
      for (int e = 0; e < num_experts; ++e) {
        const std::int32_t* column = counts.data() + static_cast<size_t>(e) * num_ranks;
        for (int s = 0; s < num_ranks; ++s) {
          totals[e] += column[s];
          sent[s] += column[s];
          bits |= static_cast<std::uint32_t>(column[s]);
        }
        const SingleExpert& single = experts[e];
        if (single.rank < 0) continue;
        for (int s = single.first; s < single.last; ++s) {
          to_node[s] += column[s];
          from_node[single.rank] += column[s];
        }
        kept[single.rank] += column[single.rank];
      }
      ASSERT_TRUE(CountSumsExact(bits, counts.size()));
      {
        SCOPED_TRACE(std::to_string(num_nodes) + " nodes of " + std::to_string(per_node) + ", " +
                     std::to_string(num_experts) + " experts");
        std::vector<double> out_totals(num_experts, -7.0), out_sent(num_ranks, -7.0);
        std::vector<double> out_to_node(num_ranks, 3.0), out_from_node(num_ranks, 3.0),
            out_kept(num_ranks, 3.0);
        std::vector<long long> out_whole(num_experts, -7);
        std::vector<std::uint32_t> scratch(ScanCountsScratch(num_experts, num_ranks), 7);
        const CountSums sums{out_totals.data(),    out_sent.data(), out_to_node.data(),
                             out_from_node.data(), out_kept.data(), out_whole.data()};
        EXPECT_EQ(
            ScanCounts(counts.data(), num_experts, num_ranks, experts.data(), scratch.data(), sums),
            bits);
        for (int e = 0; e < num_experts; ++e) {
          EXPECT_EQ(out_totals[e], static_cast<double>(totals[e])) << "expert " << e;
          EXPECT_EQ(out_whole[e], totals[e]) << "expert " << e;
        }
        for (int r = 0; r < num_ranks; ++r) {
          EXPECT_EQ(out_sent[r], static_cast<double>(sent[r])) << "rank " << r;
          EXPECT_EQ(out_to_node[r], 3.0 + static_cast<double>(to_node[r])) << "rank " << r;
          EXPECT_EQ(out_from_node[r], 3.0 + static_cast<double>(from_node[r])) << "rank " << r;
          EXPECT_EQ(out_kept[r], 3.0 + static_cast<double>(kept[r])) << "rank " << r;
        }
      }
    }
  }
}

// The sums are exact where every partial sum stays below 2^31: a count with the sign bit, or
// counts as large as their OR that could add up to 2^31, are not.
TEST(TrafficScanTest, CountSumsExactBoundsTheLanes) {
  EXPECT_TRUE(CountSumsExact(0, 16384));
  EXPECT_TRUE(CountSumsExact((1u << 17) - 1, 16384));  // 16384 * (2^17 - 1) < 2^31
  EXPECT_FALSE(CountSumsExact(1u << 17, 16384));       // 16384 * 2^17 = 2^31
  EXPECT_FALSE(CountSumsExact(0xFFFFFFFFu, 1));        // -1
  EXPECT_FALSE(CountSumsExact(1u << 31, 1));
  EXPECT_TRUE(CountSumsExact((1u << 31) - 1, 1));
}

}  // namespace
}  // namespace keel
