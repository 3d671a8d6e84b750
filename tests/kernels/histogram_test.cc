// CPU reference of the expert and per-rank histograms: hand-checked cases, invariants on random
// router output, int32 and int64 ids alike, and argument errors that name the parameter.
#include "kernels/histogram.h"

#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace keel::kernels {
namespace {

TEST(ExpertHistogramTest, CountsEachIdAndSkipsDroppedAndInvalid) {
  const std::vector<int32_t> ids{0, 2, 2, -1, 3, 7, -5, 2};  // 7 and -5 are invalid for 4 experts
  std::vector<int32_t> counts(4, 99);
  int32_t invalid = 99;
  ASSERT_TRUE(cpu::ExpertHistogram(ids.data(), 8, 4, counts.data(), &invalid).ok());
  EXPECT_EQ(counts, (std::vector<int32_t>{1, 0, 3, 1}));
  EXPECT_EQ(invalid, 2);
}

TEST(ExpertHistogramTest, Int64IdsAgreeWithInt32AndCountsAddUp) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> pick(-1, 40);  // some -1, some ids past 32 experts
  std::vector<int32_t> ids32(4099);
  for (int32_t& id : ids32) id = pick(rng);
  const std::vector<int64_t> ids64(ids32.begin(), ids32.end());
  std::vector<int32_t> counts32(32), counts64(32);
  int32_t invalid32 = 0, invalid64 = 0;
  ASSERT_TRUE(cpu::ExpertHistogram(ids32.data(), 4099, 32, counts32.data(), &invalid32).ok());
  ASSERT_TRUE(cpu::ExpertHistogram(ids64.data(), 4099, 32, counts64.data(), &invalid64).ok());
  EXPECT_EQ(counts32, counts64);
  EXPECT_EQ(invalid32, invalid64);
  int64_t dropped = 0, total = invalid32;
  for (int32_t id : ids32) dropped += id == -1;
  for (int32_t c : counts32) total += c;
  EXPECT_GT(invalid32, 0);
  EXPECT_EQ(total + dropped, 4099);
}

TEST(ExpertHistogramTest, RejectsBadArgumentsNamingThem) {
  int32_t counts[2], invalid;
  const int32_t ids[2] = {0, 1};
  Status status = cpu::ExpertHistogram(ids, -3, 2, counts, &invalid);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("num_entries = -3"), std::string::npos) << status.message();
  status = cpu::ExpertHistogram(static_cast<const int32_t*>(nullptr), 2, 2, counts, &invalid);
  EXPECT_NE(status.message().find("ids is null"), std::string::npos) << status.message();
  status = cpu::ExpertHistogram(ids, 2, 2, nullptr, &invalid);
  EXPECT_NE(status.message().find("counts is null"), std::string::npos) << status.message();
  // Nothing to count: null pointers are fine, counts are zeroed.
  counts[0] = counts[1] = 5;
  EXPECT_TRUE(
      cpu::ExpertHistogram(static_cast<const int32_t*>(nullptr), 0, 2, counts, &invalid).ok());
  EXPECT_EQ(counts[0] + counts[1] + invalid, 0);
}

TEST(RankHistogramTest, CountsEntriesAndDistinctTokensPerRank) {
  // 3 tokens x top-3; experts 0,1 on rank 0, experts 2,3 on rank 1, expert 4 on rank 2.
  const std::vector<int64_t> ids{0, 1,  2,   // token 0: twice on rank 0, once on rank 1
                                 4, -1, 4,   // token 1: twice on rank 2 (one entry dropped)
                                 3, 9,  2};  // token 2: rank 1 twice; 9 is invalid
  const std::vector<int32_t> rank_of{0, 0, 1, 1, 2};
  std::vector<int32_t> entries(3), tokens(3);
  int32_t invalid = 0;
  ASSERT_TRUE(cpu::RankHistogram(ids.data(), 3, 3, rank_of.data(), 5, 3, entries.data(),
                                 tokens.data(), &invalid)
                  .ok());
  EXPECT_EQ(entries, (std::vector<int32_t>{2, 3, 2}));
  EXPECT_EQ(tokens, (std::vector<int32_t>{1, 2, 1}));
  EXPECT_EQ(invalid, 1);
}

TEST(RankHistogramTest, RandomInputsMatchAPerTokenSetCount) {
  std::mt19937 rng(11);
  const int num_ids = 64, num_ranks = 8, top_k = 6, num_tokens = 777;
  std::vector<int32_t> rank_of(num_ids);
  for (int& r : rank_of) r = static_cast<int>(rng() % num_ranks);
  std::vector<int32_t> ids(num_tokens * top_k);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % (num_ids + 1)) - 1;
  std::vector<int32_t> entries(num_ranks), tokens(num_ranks);
  int32_t invalid = 0;
  ASSERT_TRUE(cpu::RankHistogram(ids.data(), num_tokens, top_k, rank_of.data(), num_ids, num_ranks,
                                 entries.data(), tokens.data(), &invalid)
                  .ok());
  std::vector<int32_t> want_entries(num_ranks, 0), want_tokens(num_ranks, 0);
  for (int t = 0; t < num_tokens; ++t) {
    std::vector<bool> seen(num_ranks, false);
    for (int k = 0; k < top_k; ++k) {
      const int id = ids[t * top_k + k];
      if (id < 0) continue;
      ++want_entries[rank_of[id]];
      seen[rank_of[id]] = true;
    }
    for (int r = 0; r < num_ranks; ++r) want_tokens[r] += seen[r];
  }
  EXPECT_EQ(entries, want_entries);
  EXPECT_EQ(tokens, want_tokens);
  EXPECT_EQ(invalid, 0);
}

TEST(RankHistogramTest, RejectsARankOutsideTheRange) {
  const int32_t ids[2] = {0, 1};
  const int32_t rank_of[2] = {0, 4};
  int32_t entries[2], tokens[2], invalid;
  const Status status = cpu::RankHistogram(ids, 1, 2, rank_of, 2, 2, entries, tokens, &invalid);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("rank_of[1] = 4"), std::string::npos) << status.message();
  EXPECT_NE(cpu::RankHistogram(ids, 1, 0, rank_of, 2, 2, entries, tokens, &invalid)
                .message()
                .find("top_k = 0"),
            std::string::npos);
}

}  // namespace
}  // namespace keel::kernels
