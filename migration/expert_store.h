// One rank's expert state for every layer: the live slot buffers of the placement in force and a
// staging area that an epoch's incoming transfers fill. Commit swaps staged buffers in; Discard
// drops them, so an aborted epoch leaves the live state untouched. The store either owns its
// host buffers (Create) or works over buffers the trainer registered with the engine (Wrap).
#pragma once

#include <cstddef>
#include <map>
#include <span>
#include <tuple>
#include <vector>

#include "keel/device_memory.hpp"
#include "keel/status.hpp"
#include "migration/transfer_plan.h"
#include "placement/placement.h"

namespace keel {

// The two parts of a slot's state: every copy has weights, the home slot also optimizer state.
enum class SlotRegion { kWeights, kOptimizer };

class ExpertStore {
 public:
  // Weights for every slot of `rank` in every layer, optimizer state for the slots that are home
  // slots (HomeSlot) of an expert homed on `rank`. Buffers start zeroed.
  static Result<ExpertStore> Create(int rank, std::span<const Placement> placements,
                                    const ExpertLayout& layout);

  // A store over buffers someone else owns: weights[i] and optimizer[i], i = layer *
  // slots_per_rank + local slot, are regions of layout.weight_bytes and layout.optimizer_bytes
  // (every slot has an optimizer region, since any slot may become a home). Commit copies staged
  // regions into them and releases nothing; regions that `device` says are device memory are
  // written through it (the migrating transport's device_memory()), never by the CPU. Fails when
  // a region is missing or has another size.
  static Result<ExpertStore> Wrap(int rank, int num_layers, int slots_per_rank,
                                  const ExpertLayout& layout,
                                  std::vector<std::span<std::byte>> weights,
                                  std::vector<std::span<std::byte>> optimizer,
                                  DeviceMemory* device = nullptr);

  int rank() const { return rank_; }
  int num_layers() const { return num_layers_; }
  int slots_per_rank() const { return slots_per_rank_; }
  const ExpertLayout& layout() const { return layout_; }
  bool owns(int slot) const { return slot / slots_per_rank_ == rank_; }

  // The live region of physical slot `slot` (a slot of this rank) in `layer`. The optimizer
  // region is empty unless the slot is a home slot.
  std::span<std::byte> Live(int layer, int slot, SlotRegion region);
  std::span<const std::byte> Live(int layer, int slot, SlotRegion region) const;

  // A staging buffer for that region (allocated on first use), invisible until Commit.
  std::span<std::byte> Stage(int layer, int slot, SlotRegion region);
  bool has_staged() const { return !staged_.empty(); }

  // Staged regions replace the live ones; optimizer state of slots that are no longer home slots
  // under `placements` (the new placement, one per layer) is released.
  Status Commit(std::span<const Placement> placements);
  // Drops every staged region; the live state is unchanged.
  void Discard() { staged_.clear(); }

 private:
  using Key = std::tuple<int, int, SlotRegion>;  // layer, local slot, region
  ExpertStore(int rank, int num_layers, int slots_per_rank, const ExpertLayout& layout);
  std::vector<std::byte>& Region(int layer, int slot, SlotRegion region);
  std::span<std::byte> LiveRegion(int layer, int slot, SlotRegion region);
  bool IsHomeSlot(const Placement& placement, int slot) const;

  int rank_ = 0;
  int num_layers_ = 0;
  int slots_per_rank_ = 0;
  ExpertLayout layout_;
  std::vector<std::vector<std::byte>> weights_;    // [layer * slots_per_rank + local slot]
  std::vector<std::vector<std::byte>> optimizer_;  // same index; empty unless a home slot
  std::map<Key, std::vector<std::byte>> staged_;
  // Wrap: the registered regions, same index as weights_; weights_ and optimizer_ stay empty.
  bool wrapped_ = false;
  std::vector<std::span<std::byte>> wrapped_weights_;
  std::vector<std::span<std::byte>> wrapped_optimizer_;
  DeviceMemory* device_ = nullptr;
};

}  // namespace keel
