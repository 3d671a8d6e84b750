// Placement maps: construction, validation errors and the derived EPLB-shaped maps.
#include "placement/placement.h"

#include <gtest/gtest.h>

namespace keel {
namespace {

TEST(PlacementTest, ContiguousSpreadsExpertsInOrder) {
  auto p = Placement::Contiguous(/*num_experts=*/5, /*num_ranks=*/2, /*slots_per_rank=*/3);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->phy2log(), (std::vector<int>{0, 1, 2, 3, 4, kEmptySlot}));
  EXPECT_EQ(p->home(), (std::vector<int>{0, 0, 0, 1, 1}));
  EXPECT_EQ(p->logcnt(), (std::vector<int>{1, 1, 1, 1, 1}));
}

TEST(PlacementTest, ContiguousFailsWhenSlotsTooFew) {
  auto p = Placement::Contiguous(7, 2, 3);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("needs 4 slots per rank"), std::string::npos);
}

TEST(PlacementTest, Log2PhyIsPaddedWithMinusOne) {
  auto p = Placement::Create(3, 2, {0, 1, 2, 0});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->Log2Phy(2), (std::vector<int>{0, 3, 1, -1, 2, -1}));
  EXPECT_EQ(p->max_copies(), 2);
  EXPECT_TRUE(p->holds(1, 0));
  EXPECT_FALSE(p->holds(1, 1));
}

TEST(PlacementTest, CopyRanksFollowCopies) {
  auto p = Placement::Create(3, 3, {0, 1, kEmptySlot, 0, 2, 0});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (int e = 0; e < 3; ++e) {
    const auto slots = p->copies(e);
    const auto ranks = p->copy_ranks(e);
    ASSERT_EQ(ranks.size(), slots.size());
    for (size_t i = 0; i < slots.size(); ++i) EXPECT_EQ(ranks[i], p->rank_of_slot(slots[i]));
  }
  EXPECT_EQ(std::vector<int>(p->copy_ranks(0).begin(), p->copy_ranks(0).end()),
            (std::vector<int>{0, 1, 2}));
}

TEST(PlacementTest, RejectsMissingExpertAndBadHome) {
  auto missing = Placement::Create(3, 2, {0, 1, 1, 0});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("expert 2 has no copy"), std::string::npos);
  auto bad_home = Placement::Create(2, 2, {0, 1}, {1, 1});
  ASSERT_FALSE(bad_home.ok());
  EXPECT_NE(bad_home.status().message().find("home[0] = 1"), std::string::npos);
  auto out_of_range = Placement::Create(2, 2, {0, 5});
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_NE(out_of_range.status().message().find("phy2log[1] = 5"), std::string::npos);
}

TEST(PlacementTest, KeepingHomesMovesOnlyLostHomes) {
  auto before = Placement::Create(2, 2, {0, 1, 1, 0}, {1, 0});
  ASSERT_TRUE(before.ok());
  auto after = Placement::CreateKeepingHomes(*before, {1, 0, 1, 1});
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(after->home(0), 0);  // expert 0 left rank 1: home moves to its first slot's rank
  EXPECT_EQ(after->home(1), 0);  // expert 1 still on rank 0: home kept
  PlacementChange change = DiffPlacements(*before, *after);
  EXPECT_EQ(change.changed_slots, 3);
  EXPECT_EQ(change.moved_homes, 1);
}

}  // namespace
}  // namespace keel
