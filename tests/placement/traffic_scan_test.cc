// ScanByExpert, the per-step planner's pass over the traffic: each version (the portable one, and
// the AVX-512 one where the CPU has it) gives the exact totals and what each source sends, and
// flags every entry that sends the planner to its exact checks, wherever in the rows it sits.
#include "placement/traffic_scan.h"

#include <gtest/gtest.h>

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

// The paths this CPU runs as named.
std::vector<ScanPath> Paths() {
  std::vector<ScanPath> paths = {ScanPath::kBest, ScanPath::kPortable};
  if (ScanPathAvailable(ScanPath::kAvx512)) paths.push_back(ScanPath::kAvx512);
  return paths;
}

std::string Name(ScanPath path) {
  switch (path) {
    case ScanPath::kBest:
      return "best";
    case ScanPath::kPortable:
      return "portable";
    case ScanPath::kAvx512:
      return "avx512";
  }
  return "?";
}

struct Scanned {
  EntryBits entries;
  std::vector<double> sent;
  std::vector<double> totals;
};

Scanned Scan(const std::vector<double>& by_expert, int num_experts, int num_sources,
             ScanPath path) {
  Scanned out;
  // Leftovers of an earlier scan must not leak into this one.
  out.sent.assign(num_sources, -7.0);
  out.totals.assign(num_experts, -7.0);
  std::vector<double> lanes(4 * static_cast<size_t>(num_experts), -7.0);
  out.entries = ScanByExpert(by_expert.data(), num_experts, num_sources, out.sent.data(),
                             lanes.data(), out.totals.data(), path);
  return out;
}

// Whole entries below 2^52 in all, so every sum is exact in any order: each path must give the
// sums in source and expert order, bit for bit.
TEST(TrafficScanTest, EveryPathGivesTheExactSums) {
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
      for (ScanPath path : Paths()) {
        SCOPED_TRACE(Name(path) + ": " + std::to_string(num_experts) + " experts x " +
                     std::to_string(num_sources) + " sources");
        const Scanned scanned = Scan(by_expert, num_experts, num_sources, path);
        EXPECT_EQ(scanned.entries.bits & kSignBit, 0u);
        EXPECT_FALSE(scanned.entries.fractional);
        EXPECT_EQ(std::memcmp(scanned.sent.data(), sent.data(), sizeof(double) * num_sources), 0);
        EXPECT_EQ(std::memcmp(scanned.totals.data(), totals.data(), sizeof(double) * num_experts),
                  0);
        ++cases;
      }
    }
  }
  EXPECT_GE(cases, 14 * 4 * 2);
}

// One entry that the fast path must not take, put first, last, in a block of 32 sources and in
// the quads after it: every path flags it, as ScanEntries does.
TEST(TrafficScanTest, EveryPathFlagsWhatNeedsTheExactChecks) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // A negative entry goes to the exact checks whatever its fraction, so the paths may differ
  // there.
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
        for (ScanPath path : Paths()) {
          SCOPED_TRACE(Name(path) + ": " + std::to_string(bad.value) + " at " +
                       std::to_string(spot) + " of " + std::to_string(num_sources) + " sources");
          const EntryBits entries = Scan(by_expert, num_experts, num_sources, path).entries;
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

}  // namespace
}  // namespace keel
