// The kernels' CPU references at a DeepSeek-V3-like size (8k tokens per rank x top-8,
// 256 experts, hidden 7168): what the engine pays per layer without a GPU (histogram + remap),
// and, for scale, what the row kernels cost on one core (1k tokens, so a run stays short).
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/checksum.h"
#include "kernels/histogram.h"
#include "kernels/host_device.h"
#include "kernels/permute.h"
#include "kernels/remap.h"

namespace keel::kernels {
namespace {

constexpr int kTopK = 8;
constexpr int kExperts = 256;
constexpr int kRanks = 64;
constexpr int kSlotsPerRank = 5;  // 4 homes + 1 replica: 64 redundant copies
constexpr int64_t kHidden = 7168;

std::vector<int32_t> RouterIds(int64_t tokens) {
  std::mt19937 rng(1);
  std::vector<int32_t> ids(tokens * kTopK);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < kTopK; ++k)
      ids[t * kTopK + k] = static_cast<int32_t>((t * 37 + k * 31 + rng() % 5) % kExperts);
  }
  return ids;
}

// Every expert has its home (slot e) and the first 64 experts one replica; this rank's counts
// split evenly between copies, as the quota planner would for a balanced step.
struct Quotas {
  std::vector<int32_t> copy_begin{0}, copy_slot, copy_quota, slot_rank;
  QuotaTable table;

  explicit Quotas(const std::vector<int32_t>& counts) {
    for (int s = 0; s < kRanks * kSlotsPerRank; ++s) slot_rank.push_back(s / kSlotsPerRank);
    for (int e = 0; e < kExperts; ++e) {
      const int home = (e / 4) * kSlotsPerRank + e % 4;
      if (e < kRanks) {
        copy_slot.insert(copy_slot.end(), {home, ((e + 1) % kRanks) * kSlotsPerRank + 4});
        copy_quota.insert(copy_quota.end(), {counts[e] / 2, counts[e] - counts[e] / 2});
      } else {
        copy_slot.push_back(home);
        copy_quota.push_back(counts[e]);
      }
      copy_begin.push_back(static_cast<int32_t>(copy_slot.size()));
    }
    table = {copy_begin.data(),
             copy_slot.data(),
             copy_quota.data(),
             slot_rank.data(),
             kExperts,
             static_cast<int>(copy_slot.size()),
             static_cast<int>(slot_rank.size()),
             kRanks};
  }
};

void BM_ExpertHistogram(benchmark::State& state) {
  const std::vector<int32_t> ids = RouterIds(8192);
  std::vector<int32_t> counts(kExperts);
  int32_t invalid = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(cpu::ExpertHistogram(ids.data(), static_cast<int64_t>(ids.size()),
                                                  kExperts, counts.data(), &invalid));
  }
}
BENCHMARK(BM_ExpertHistogram)->Unit(benchmark::kMicrosecond);

void BM_HistogramAndRemap(benchmark::State& state) {
  const std::vector<int32_t> ids = RouterIds(8192);
  std::vector<int32_t> counts(kExperts), slot(ids.size()), send(kRanks);
  int32_t invalid = 0;
  (void)cpu::ExpertHistogram(ids.data(), static_cast<int64_t>(ids.size()), kExperts, counts.data(),
                             &invalid);
  const Quotas quotas(counts);
  for (auto _ : state) {
    benchmark::DoNotOptimize(cpu::ExpertHistogram(ids.data(), static_cast<int64_t>(ids.size()),
                                                  kExperts, counts.data(), &invalid));
    benchmark::DoNotOptimize(cpu::RemapWithQuotas(ids.data(), static_cast<int64_t>(ids.size()),
                                                  quotas.table, slot.data(), send.data(),
                                                  &invalid));
  }
}
BENCHMARK(BM_HistogramAndRemap)->Unit(benchmark::kMicrosecond);

void BM_PermutationIndex(benchmark::State& state) {
  const std::vector<int32_t> ids = RouterIds(8192);
  std::vector<int32_t> bucket_of_slot(kRanks * kSlotsPerRank);
  for (size_t s = 0; s < bucket_of_slot.size(); ++s) bucket_of_slot[s] = static_cast<int32_t>(s);
  std::vector<int32_t> position(ids.size()), begin(bucket_of_slot.size() + 1);
  int32_t invalid = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(cpu::PermutationIndex(
        ids.data(), static_cast<int64_t>(ids.size()), bucket_of_slot.data(), kRanks * kSlotsPerRank,
        kRanks * kSlotsPerRank, position.data(), begin.data(), &invalid));
  }
}
BENCHMARK(BM_PermutationIndex)->Unit(benchmark::kMicrosecond);

// Permute and unpermute-combine of 1k tokens x top-8 bf16 rows; bytes = rows read + written.
struct Rows {
  int64_t tokens = 1024;
  std::vector<int32_t> position;
  std::vector<uint16_t> in, permuted, out;
  std::vector<float> weights;
  Rows()
      : position(tokens * kTopK),
        in(tokens * kHidden),
        permuted(tokens * kTopK * kHidden),
        out(tokens * kHidden),
        weights(tokens * kTopK, 0.125f) {
    for (int64_t i = 0; i < tokens * kTopK; ++i)
      position[i] = static_cast<int32_t>((i * 7919) % (tokens * kTopK));
    for (size_t i = 0; i < in.size(); ++i)
      in[i] = FloatToBf16(static_cast<float>(i % 97) * 0.01f + 0.5f);
  }
  int64_t bytes() const { return 2 * tokens * kTopK * kHidden * 2; }
};

void BM_PermuteBf16(benchmark::State& state) {
  Rows rows;
  for (auto _ : state) {
    benchmark::DoNotOptimize(cpu::Permute(rows.in.data(), rows.tokens, kTopK, kHidden,
                                          DType::kBFloat16, rows.position.data(),
                                          rows.permuted.data(), rows.tokens * kTopK));
  }
  state.SetBytesProcessed(state.iterations() * rows.bytes());
}
BENCHMARK(BM_PermuteBf16)->Unit(benchmark::kMillisecond);

void BM_UnpermuteCombineBf16(benchmark::State& state) {
  Rows rows;
  for (auto _ : state) {
    benchmark::DoNotOptimize(cpu::UnpermuteCombine(
        rows.permuted.data(), rows.tokens * kTopK, rows.position.data(), rows.weights.data(),
        rows.tokens, kTopK, kHidden, DType::kBFloat16, rows.out.data()));
  }
  state.SetBytesProcessed(state.iterations() * rows.bytes());
}
BENCHMARK(BM_UnpermuteCombineBf16)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace keel::kernels
BENCHMARK_MAIN();
