// Helpers shared by the migration tests: random placements, patterned expert state and checks.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/device_memory.hpp"
#include "keel/status.hpp"
#include "kernels/checksum.h"
#include "migration/exchange.h"
#include "migration/expert_store.h"
#include "migration/transfer_plan.h"
#include "placement/placement.h"
#include "tests/common/test_util.h"
#include "tests/migration/fake_device_memory.h"

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
          placements[l].home(e) == store.rank() && placements[l].home_slot(e) == slot;
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

// One rank's expert slots in device memory (a GPU's, or fake), as a trainer with its experts on
// the GPU registers them: every slot has a weights and an optimizer region. Filled and checked
// through the memory's copies, since the CPU may not touch them.
class DeviceSlots {
 public:
  DeviceSlots(DeviceMemory& memory, int rank, int num_layers, int slots_per_rank,
              const ExpertLayout& layout)
      : memory_(memory),
        rank_(rank),
        num_layers_(num_layers),
        slots_per_rank_(slots_per_rank),
        layout_(layout) {
    for (int i = 0; i < num_layers * slots_per_rank; ++i) {
      weights_.emplace_back(ValueOrDie(memory.AllocateDevice(layout.weight_bytes)),
                            layout.weight_bytes);
      optimizer_.emplace_back(ValueOrDie(memory.AllocateDevice(layout.optimizer_bytes)),
                              layout.optimizer_bytes);
    }
  }

  ~DeviceSlots() {
    for (std::span<std::byte> region : weights_) memory_.FreeDevice(region.data());
    for (std::span<std::byte> region : optimizer_) memory_.FreeDevice(region.data());
  }
  DeviceSlots(const DeviceSlots&) = delete;
  DeviceSlots& operator=(const DeviceSlots&) = delete;

  // A store over these slots that commits through `device` (the transport's device memory).
  ExpertStore Wrap(DeviceMemory* device) const {
    return ValueOrDie(ExpertStore::Wrap(rank_, num_layers_, slots_per_rank_, layout_, weights_,
                                        optimizer_, device));
  }

  // Every slot as `placements` says: weights in every copy, optimizer state in every slot (only
  // home slots' is checked).
  void Fill(std::span<const Placement> placements) {
    ForEachSlot(placements, [&](int l, int e, size_t index, bool) {
      for (int region = 0; region < 2; ++region) {
        std::span<std::byte> where = region == 0 ? weights_[index] : optimizer_[index];
        std::vector<std::byte> bytes(where.size());
        FillPattern(bytes, l, e, region);
        CheckOk(memory_.Copy(where.data(), bytes.data(), bytes.size()));
      }
      return std::string();
    });
  }

  // "" when the slots hold what `placements` says (weights in every copy, optimizer state in
  // home slots); else the first difference.
  std::string Check(std::span<const Placement> placements) {
    return ForEachSlot(placements, [&](int l, int e, size_t index, bool home) {
      const int regions = home ? 2 : 1;
      for (int region = 0; region < regions; ++region) {
        std::span<std::byte> where = region == 0 ? weights_[index] : optimizer_[index];
        std::vector<std::byte> got(where.size());
        CheckOk(memory_.Copy(got.data(), where.data(), where.size()));
        for (size_t b = 0; b < got.size(); ++b) {
          if (got[b] != PatternByte(l, e, region, b)) {
            return "rank " + std::to_string(rank_) + " layer " + std::to_string(l) +
                   " local slot " + std::to_string(index % slots_per_rank_) + " expert " +
                   std::to_string(e) + ": region " + std::to_string(region) + " differs at byte " +
                   std::to_string(b);
          }
        }
      }
      return std::string();
    });
  }

 private:
  // Calls visit(layer, expert, region index, home slot) for every occupied slot of this rank;
  // stops at the first non-empty answer.
  template <typename Visit>
  std::string ForEachSlot(std::span<const Placement> placements, Visit&& visit) {
    for (int l = 0; l < num_layers_; ++l) {
      for (int i = 0; i < slots_per_rank_; ++i) {
        const int slot = rank_ * slots_per_rank_ + i;
        const int e = placements[l].expert_at(slot);
        if (e == kEmptySlot) continue;
        const bool home = placements[l].home(e) == rank_ && placements[l].home_slot(e) == slot;
        std::string problem = visit(l, e, static_cast<size_t>(l) * slots_per_rank_ + i, home);
        if (!problem.empty()) return problem;
      }
    }
    return "";
  }

  DeviceMemory& memory_;
  int rank_;
  int num_layers_;
  int slots_per_rank_;
  ExpertLayout layout_;
  std::vector<std::span<std::byte>> weights_;
  std::vector<std::span<std::byte>> optimizer_;
};

// An exchange between two ranks: `moved_bytes` from a buffer of rank 0 to one of rank 1, and a
// local move of `local_bytes` on rank 1.
struct TwoRankExchange {
  const std::byte* moved_source = nullptr;
  std::byte* moved_destination = nullptr;
  size_t moved_bytes = 0;
  const std::byte* local_source = nullptr;
  std::byte* local_destination = nullptr;
  size_t local_bytes = 0;
};

// Runs `exchange` (epoch 1) on `rank0` and `rank1`, each in a thread of its own; each
// rank's status.
inline std::vector<Status> RunTwoRankExchange(Transport& rank0, Transport& rank1,
                                              const TwoRankExchange& exchange, size_t chunk_bytes) {
  std::vector<ExchangeItem> items(2);
  items[0] = {.src_rank = 0, .dst_rank = 1, .label = "moved", .num_regions = 1};
  items[0].region_bytes[0] = exchange.moved_bytes;
  items[1] = {.src_rank = 1, .dst_rank = 1, .label = "local", .num_regions = 1};
  items[1].region_bytes[0] = exchange.local_bytes;
  std::vector<std::vector<ExchangeItem>> per_rank(2, items);
  per_rank[0][0].source[0] = exchange.moved_source;
  per_rank[1][0].destination[0] = exchange.moved_destination;
  per_rank[1][1].source[0] = exchange.local_source;
  per_rank[1][1].destination[0] = exchange.local_destination;
  ExchangeOptions options;
  options.chunk_bytes = chunk_bytes;
  options.deadline = std::chrono::seconds(30);
  Transport* transports[2] = {&rank0, &rank1};
  std::vector<Status> results(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ExchangeRun run;
      run.epoch = 1;
      run.what = "exchange";
      results[r] = RunExchange(*transports[r], per_rank[r], options, run, nullptr, nullptr);
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

}  // namespace keel::testing
