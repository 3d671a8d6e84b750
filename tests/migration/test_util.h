// Helpers shared by the migration tests: random placements, patterned expert state and checks.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/checksum.h"
#include "migration/expert_store.h"
#include "migration/transfer_plan.h"
#include "placement/placement.h"
#include "tests/common/test_util.h"

namespace keel::testing {

// A random placement: every expert at least once, the other slots random experts or empty, each
// home a random holder.
inline Placement RandomPlacement(std::mt19937_64& rng, int num_experts, int num_ranks,
                                 int slots_per_rank) {
  const int num_slots = num_ranks * slots_per_rank;
  std::vector<int> phy2log(num_slots, kEmptySlot);
  std::vector<int> order(num_slots);
  for (int i = 0; i < num_slots; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (int e = 0; e < num_experts; ++e) phy2log[order[e]] = e;
  std::uniform_int_distribution<int> expert(-1, num_experts - 1);
  for (int i = num_experts; i < num_slots; ++i) phy2log[order[i]] = expert(rng);
  Placement base = ValueOrDie(Placement::Create(num_experts, num_ranks, phy2log));
  std::vector<int> home(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    auto copies = base.copies(e);
    std::uniform_int_distribution<size_t> pick(0, copies.size() - 1);
    home[e] = base.rank_of_slot(copies[pick(rng)]);
  }
  return ValueOrDie(Placement::Create(num_experts, num_ranks, phy2log, home));
}

// The byte at `i` of (layer, expert)'s weights (region 0) or optimizer state (region 1): every
// copy of an expert holds the same weights, so a destination can be checked byte by byte.
inline std::byte PatternByte(int layer, int expert, int region, size_t i) {
  uint64_t x = (static_cast<uint64_t>(layer) << 40) ^ (static_cast<uint64_t>(expert) << 20) ^
               (static_cast<uint64_t>(region) << 60) ^ (i / 8);
  x = (x ^ (x >> 31)) * 0x7fb5d329728ea185ull;
  x ^= x >> 27;
  return static_cast<std::byte>(x >> (8 * (i % 8)));
}

inline void FillPattern(std::span<std::byte> bytes, int layer, int expert, int region) {
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = PatternByte(layer, expert, region, i);
}

// Fills `store`'s live slots as `placements` says they should be.
inline void FillStore(ExpertStore& store, std::span<const Placement> placements) {
  for (int l = 0; l < store.num_layers(); ++l) {
    for (int i = 0; i < store.slots_per_rank(); ++i) {
      const int slot = store.rank() * store.slots_per_rank() + i;
      const int e = placements[l].expert_at(slot);
      if (e == kEmptySlot) continue;
      FillPattern(store.Live(l, slot, SlotRegion::kWeights), l, e, 0);
      FillPattern(store.Live(l, slot, SlotRegion::kOptimizer), l, e, 1);
    }
  }
}

// "" when every slot of `store` holds what `placements` says, byte for byte (weights in every
// copy, optimizer state exactly in home slots); else the first difference.
inline std::string CheckStore(const ExpertStore& store, std::span<const Placement> placements) {
  for (int l = 0; l < store.num_layers(); ++l) {
    for (int i = 0; i < store.slots_per_rank(); ++i) {
      const int slot = store.rank() * store.slots_per_rank() + i;
      const int e = placements[l].expert_at(slot);
      if (e == kEmptySlot) continue;
      const std::string where = "rank " + std::to_string(store.rank()) + " layer " +
                                std::to_string(l) + " slot " + std::to_string(slot) + " expert " +
                                std::to_string(e);
      auto weights = store.Live(l, slot, SlotRegion::kWeights);
      if (weights.size() != store.layout().weight_bytes) return where + ": weights missing";
      for (size_t b = 0; b < weights.size(); ++b) {
        if (weights[b] != PatternByte(l, e, 0, b)) {
          return where + ": weights differ at byte " + std::to_string(b);
        }
      }
      auto optimizer = store.Live(l, slot, SlotRegion::kOptimizer);
      const bool home_slot =
          placements[l].home(e) == store.rank() && HomeSlot(placements[l], e) == slot;
      const size_t expected = home_slot ? store.layout().optimizer_bytes : 0;
      if (optimizer.size() != expected) {
        return where + ": optimizer state has " + std::to_string(optimizer.size()) +
               " bytes, expected " + std::to_string(expected);
      }
      for (size_t b = 0; b < optimizer.size(); ++b) {
        if (optimizer[b] != PatternByte(l, e, 1, b)) {
          return where + ": optimizer state differs at byte " + std::to_string(b);
        }
      }
    }
  }
  return "";
}

// One hash over every live slot of `store`: equal before and after an aborted epoch.
inline uint64_t LiveChecksum(const ExpertStore& store) {
  uint64_t h = 0;
  for (int l = 0; l < store.num_layers(); ++l) {
    for (int i = 0; i < store.slots_per_rank(); ++i) {
      const int slot = store.rank() * store.slots_per_rank() + i;
      h = kernels::cpu::Checksum64(store.Live(l, slot, SlotRegion::kWeights), h);
      h = kernels::cpu::Checksum64(store.Live(l, slot, SlotRegion::kOptimizer), h);
    }
  }
  return h;
}

}  // namespace keel::testing
