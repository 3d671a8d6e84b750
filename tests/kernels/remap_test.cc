// CPU reference of the quota remap: a hand-checked case, and on random quota tables the rule of
// remap.h checked entry by entry (fill copies in order, dust to the last copy, stable order).
#include "kernels/remap.h"

#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace keel::kernels {
namespace {

// A quota table and the vectors behind it.
struct Table {
  std::vector<int32_t> copy_begin, copy_slot, copy_quota, slot_rank;
  QuotaTable view(int num_ranks) const {
    return MakeQuotaTable(copy_begin, copy_slot, copy_quota, slot_rank, num_ranks);
  }
};

TEST(RemapTest, FillsCopiesInOrderAndSendsDustToTheLastCopy) {
  // 4 slots on 2 ranks. Expert 0: slot 0 takes 2, slot 3 takes 1. Expert 1: slot 1 (quota 0,
  // skipped) then slot 2 takes 1; its third entry is dust. Expert 2 has no copy.
  Table t{{0, 2, 4, 4}, {0, 3, 1, 2}, {2, 1, 0, 1}, {0, 0, 1, 1}};
  const std::vector<int32_t> ids{0, 1, 0, -1, 0, 1, 2, 0, 1};
  std::vector<int32_t> slot(ids.size(), 77), send(2, 77);
  int32_t invalid = 77;
  ASSERT_TRUE(
      cpu::RemapWithQuotas(ids.data(), 9, t.view(2), slot.data(), send.data(), &invalid).ok());
  EXPECT_EQ(slot, (std::vector<int32_t>{0, 2, 0, -1, 3, 2, -1, 3, 2}));
  EXPECT_EQ(send, (std::vector<int32_t>{2, 5}));
  EXPECT_EQ(invalid, 1);
}

TEST(RemapTest, RandomTablesFollowTheRule) {
  std::mt19937 rng(3);
  for (int round = 0; round < 50; ++round) {
    const int experts = 1 + static_cast<int>(rng() % 40);
    const int ranks = 1 + static_cast<int>(rng() % 8);
    const int slots = ranks * 4;
    Table t;
    for (int s = 0; s < slots; ++s) t.slot_rank.push_back(s / 4);
    t.copy_begin.push_back(0);
    for (int e = 0; e < experts; ++e) {
      const int copies = static_cast<int>(rng() % 4);  // 0..3 copies; 0 => entries invalid
      for (int c = 0; c < copies; ++c) {
        t.copy_slot.push_back(static_cast<int32_t>(rng() % slots));
        t.copy_quota.push_back(static_cast<int32_t>(rng() % 30));
      }
      t.copy_begin.push_back(static_cast<int32_t>(t.copy_slot.size()));
    }
    const int64_t n = static_cast<int64_t>(rng() % 2000);
    std::vector<int64_t> ids(n);
    for (int64_t& id : ids) id = static_cast<int64_t>(rng() % (experts + 1)) - 1;
    std::vector<int32_t> slot(n), send(ranks);
    int32_t invalid = 0;
    ASSERT_TRUE(
        cpu::RemapWithQuotas(ids.data(), n, t.view(ranks), slot.data(), send.data(), &invalid)
            .ok());
    // Re-derive every entry's copy from its occurrence index among its expert's entries.
    std::vector<int64_t> seen(experts, 0);
    std::vector<int32_t> want_send(ranks, 0);
    int32_t want_invalid = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = ids[i];
      if (e < 0) {
        EXPECT_EQ(slot[i], -1);
        continue;
      }
      const int begin = t.copy_begin[e], end = t.copy_begin[e + 1];
      if (begin == end) {
        EXPECT_EQ(slot[i], -1);
        ++want_invalid;
        continue;
      }
      const int64_t j = seen[e]++;
      int copy = end - 1;
      int64_t filled = 0;
      for (int c = begin; c < end; ++c) {
        filled += t.copy_quota[c];
        if (filled > j) {
          copy = c;
          break;
        }
      }
      ASSERT_EQ(slot[i], t.copy_slot[copy]) << "round " << round << " entry " << i;
      ++want_send[t.slot_rank[slot[i]]];
    }
    EXPECT_EQ(send, want_send);
    EXPECT_EQ(invalid, want_invalid);
  }
}

TEST(RemapTest, RejectsAMalformedTableNamingTheField) {
  Table t{{0, 1}, {5}, {1}, {0, 0}};  // copy_slot 5 is not one of 2 slots
  const int32_t ids[1] = {0};
  int32_t slot[1], send[1], invalid;
  Status status = cpu::RemapWithQuotas(ids, 1, t.view(1), slot, send, &invalid);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("quotas.copy_slot[0] = 5"), std::string::npos)
      << status.message();
  t = Table{{0, 1}, {1}, {-2}, {0, 0}};
  status = cpu::RemapWithQuotas(ids, 1, t.view(1), slot, send, &invalid);
  EXPECT_NE(status.message().find("quotas.copy_quota[0] = -2"), std::string::npos)
      << status.message();
  t = Table{{0, 2}, {1}, {1}, {0, 0}};
  status = cpu::RemapWithQuotas(ids, 1, t.view(1), slot, send, &invalid);
  EXPECT_NE(status.message().find("num_copies = 1"), std::string::npos) << status.message();
  t = Table{{0, 1}, {1}, {1}, {0, 3}};
  status = cpu::RemapWithQuotas(ids, 1, t.view(1), slot, send, &invalid);
  EXPECT_NE(status.message().find("quotas.slot_rank[1] = 3"), std::string::npos)
      << status.message();
}

}  // namespace
}  // namespace keel::kernels
