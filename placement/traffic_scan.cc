// The planner's pass over the traffic (traffic_scan.h): one portable version, one for AVX-512.
#include "placement/traffic_scan.h"

#include <bit>
#include <cstring>

#include "common/simd.h"

#if KEEL_HAVE_AVX512
#include <immintrin.h>
#endif

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

#if KEEL_HAVE_AVX512
// What ScanByExpertAvx512 carries from block to block.
struct QuadScan {
  __m256i bits;        // OR of the entries' bit patterns
  __m256i fractional;  // OR of x - round(x)
};

// ScanByExpertAvx512 on the sources [block, block + 4 * kQuads) of every expert: kQuads vectors
// of four per expert row, whose sums over the experts stay in registers until `sent` takes them,
// and whose sum per expert adds to its four lanes (the first block sets them).
template <int kQuads>
KEEL_AVX512 void ScanQuads(const double* by_expert, int num_experts, int num_sources, int block,
                           double* sent, double* lanes, QuadScan& scan) {
  // x - round(x) to 0 fraction bits, rounding to nearest, without raising the inexact flag.
  constexpr int kFraction = 0x08;
  __m256d sums[kQuads];
#pragma GCC unroll 8
  for (int k = 0; k < kQuads; ++k) sums[k] = _mm256_setzero_pd();
  for (int e = 0; e < num_experts; ++e) {
    const double* row = by_expert + static_cast<size_t>(e) * num_sources + block;
    __m256d quads[kQuads];
#pragma GCC unroll 8
    for (int k = 0; k < kQuads; ++k) {
      quads[k] = _mm256_loadu_pd(row + 4 * k);
      scan.bits = _mm256_or_si256(scan.bits, _mm256_castpd_si256(quads[k]));
      scan.fractional = _mm256_or_si256(scan.fractional,
                                        _mm256_castpd_si256(_mm256_reduce_pd(quads[k], kFraction)));
      sums[k] = _mm256_add_pd(sums[k], quads[k]);
    }
    // A pairwise sum of the row's vectors.
#pragma GCC unroll 8
    for (int width = 1; width < kQuads; width *= 2) {
#pragma GCC unroll 8
      for (int k = 0; k + width < kQuads; k += 2 * width) {
        quads[k] = _mm256_add_pd(quads[k], quads[k + width]);
      }
    }
    double* lane = lanes + 4 * static_cast<size_t>(e);
    _mm256_storeu_pd(lane, block > 0 ? _mm256_add_pd(_mm256_loadu_pd(lane), quads[0]) : quads[0]);
  }
#pragma GCC unroll 8
  for (int k = 0; k < kQuads; ++k) _mm256_storeu_pd(sent + block + 4 * k, sums[k]);
}

// ScanByExpert for CPUs with AVX-512 DQ and VL: one instruction (VREDUCEPD: x - round(x)) in
// place of the three that test a quad for whole numbers, and 32 sources through all experts at
// once (eight vectors; AVX-512 has twice the registers), so that the rows are read in runs of
// 256 bytes. Vectors stay 256 bits wide: 512-bit arithmetic lowers the clock of some CPUs for
// what runs after it. It returns and writes what the portable pass gives, but for the entries
// EntryBits lets count either way and the rounding of inexact sums.
KEEL_AVX512 EntryBits ScanByExpertAvx512(const double* by_expert, int num_experts, int num_sources,
                                         double* sent, double* lanes, double* lane_totals) {
  QuadScan scan = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  int block = 0;
  for (; block + 32 <= num_sources; block += 32) {
    ScanQuads<8>(by_expert, num_experts, num_sources, block, sent, lanes, scan);
  }
  for (; block < num_sources; block += 4) {
    ScanQuads<1>(by_expert, num_experts, num_sources, block, sent, lanes, scan);
  }
  for (int e = 0; e < num_experts; ++e) {
    const double* lane = lanes + 4 * static_cast<size_t>(e);
    lane_totals[e] = (lane[0] + lane[1]) + (lane[2] + lane[3]);
  }
  alignas(32) std::uint64_t words[4];
  EntryBits entries;
  _mm256_store_si256(reinterpret_cast<__m256i*>(words), scan.bits);
  entries.bits = (words[0] | words[1]) | (words[2] | words[3]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(words), scan.fractional);
  entries.fractional = ((words[0] | words[1]) | (words[2] | words[3])) != 0;
  return entries;
}
#endif

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

bool ScanPathAvailable(ScanPath path) {
  switch (path) {
    case ScanPath::kBest:
    case ScanPath::kPortable:
      return true;
    case ScanPath::kAvx512:
#if KEEL_HAVE_AVX512
      return CpuHasAvx512();
#else
      return false;
#endif
  }
  return false;
}

EntryBits ScanByExpert(const double* by_expert, int num_experts, int num_sources, double* sent,
                       double* lanes, double* lane_totals, ScanPath path) {
#if KEEL_HAVE_AVX512
  if (path != ScanPath::kPortable && CpuHasAvx512()) {
    return ScanByExpertAvx512(by_expert, num_experts, num_sources, sent, lanes, lane_totals);
  }
#endif
  return ScanByExpertPortable(by_expert, num_experts, num_sources, sent, lanes, lane_totals);
}

}  // namespace keel
