// ExpertStore::Wrap: a store over buffers the trainer owns (the engine's registered slots).
#include "migration/expert_store.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace keel {
namespace {

struct Owned {
  std::vector<std::vector<std::byte>> weights;
  std::vector<std::vector<std::byte>> optimizer;
  std::vector<std::span<std::byte>> WeightSpans() { return {weights.begin(), weights.end()}; }
  std::vector<std::span<std::byte>> OptimizerSpans() {
    return {optimizer.begin(), optimizer.end()};
  }
};

Owned MakeOwned(int regions, size_t weight_bytes, size_t optimizer_bytes) {
  Owned owned;
  for (int i = 0; i < regions; ++i) {
    owned.weights.emplace_back(weight_bytes, std::byte{static_cast<unsigned char>(i)});
    owned.optimizer.emplace_back(optimizer_bytes, std::byte{static_cast<unsigned char>(100 + i)});
  }
  return owned;
}

TEST(ExpertStoreWrapTest, CommitCopiesIntoTheOwnersBuffersAndDiscardLeavesThem) {
  const ExpertLayout layout{16, 32};
  Owned owned = MakeOwned(2 * 3, layout.weight_bytes, layout.optimizer_bytes);
  auto store = ExpertStore::Wrap(1, 2, 3, layout, owned.WeightSpans(), owned.OptimizerSpans());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  // Rank 1's slots are 3, 4, 5; layer 1 local slot 2 is region 5.
  EXPECT_EQ(store->Live(1, 5, SlotRegion::kWeights).data(), owned.weights[5].data());
  EXPECT_EQ(store->Live(1, 5, SlotRegion::kOptimizer).data(), owned.optimizer[5].data());

  auto staged = store->Stage(1, 5, SlotRegion::kWeights);
  std::fill(staged.begin(), staged.end(), std::byte{0xAB});
  store->Discard();
  EXPECT_EQ(owned.weights[5][0], std::byte{5}) << "a discarded stage must not reach the owner";

  staged = store->Stage(1, 5, SlotRegion::kWeights);
  std::fill(staged.begin(), staged.end(), std::byte{0xCD});
  auto opt = store->Stage(0, 3, SlotRegion::kOptimizer);
  std::fill(opt.begin(), opt.end(), std::byte{0xEF});
  auto placement = Placement::Create(2, 2, {0, 1, 0, 1, 0, 1});
  ASSERT_TRUE(placement.ok());
  std::vector<Placement> placements(2, *placement);
  ASSERT_TRUE(store->Commit(placements).ok());
  EXPECT_TRUE(std::all_of(owned.weights[5].begin(), owned.weights[5].end(),
                          [](std::byte b) { return b == std::byte{0xCD}; }));
  EXPECT_TRUE(std::all_of(owned.optimizer[0].begin(), owned.optimizer[0].end(),
                          [](std::byte b) { return b == std::byte{0xEF}; }));
  // Nothing is released: the owner keeps every optimizer region, home or not.
  EXPECT_EQ(store->Live(1, 4, SlotRegion::kOptimizer).size(), layout.optimizer_bytes);
  EXPECT_EQ(owned.weights[4][0], std::byte{4});
}

TEST(ExpertStoreWrapTest, RejectsMissingOrMissizedRegions) {
  const ExpertLayout layout{16, 32};
  Owned owned = MakeOwned(4, layout.weight_bytes, layout.optimizer_bytes);
  auto too_few = ExpertStore::Wrap(0, 2, 3, layout, owned.WeightSpans(), owned.OptimizerSpans());
  ASSERT_FALSE(too_few.ok());
  EXPECT_NE(too_few.status().ToString().find("needs 6"), std::string::npos);

  owned.weights[3].resize(8);
  auto small = ExpertStore::Wrap(0, 2, 2, layout, owned.WeightSpans(), owned.OptimizerSpans());
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().ToString().find("layer 1 local slot 1: weights region has 8 bytes"),
            std::string::npos)
      << small.status().ToString();
}

}  // namespace
}  // namespace keel
