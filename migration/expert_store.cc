// ExpertStore: live slot buffers plus a staging map keyed by (layer, slot, region).
#include "migration/expert_store.h"

#include <algorithm>
#include <string>

#include "keel/device_memory.hpp"

namespace keel {

ExpertStore::ExpertStore(int rank, int num_layers, int slots_per_rank, const ExpertLayout& layout)
    : rank_(rank),
      num_layers_(num_layers),
      slots_per_rank_(slots_per_rank),
      layout_(layout),
      weights_(static_cast<size_t>(num_layers) * slots_per_rank),
      optimizer_(static_cast<size_t>(num_layers) * slots_per_rank) {}

bool ExpertStore::IsHomeSlot(const Placement& placement, int slot) const {
  const int expert = placement.expert_at(slot);
  return expert != kEmptySlot && placement.home(expert) == rank_ &&
         placement.home_slot(expert) == slot;
}

Result<ExpertStore> ExpertStore::Create(int rank, std::span<const Placement> placements,
                                        const ExpertLayout& layout) {
  if (placements.empty()) return InvalidArgument("expert store needs at least one layer");
  const int slots_per_rank = placements[0].slots_per_rank();
  if (rank < 0 || rank >= placements[0].num_ranks()) {
    return InvalidArgument("rank " + std::to_string(rank) + " is not in [0, " +
                           std::to_string(placements[0].num_ranks()) + ")");
  }
  ExpertStore store(rank, static_cast<int>(placements.size()), slots_per_rank, layout);
  for (int l = 0; l < store.num_layers_; ++l) {
    const Placement& p = placements[l];
    if (p.slots_per_rank() != slots_per_rank || p.num_ranks() != placements[0].num_ranks()) {
      return InvalidArgument("layer " + std::to_string(l) + " has a different shape than layer 0");
    }
    for (int i = 0; i < slots_per_rank; ++i) {
      const int slot = rank * slots_per_rank + i;
      const size_t index = static_cast<size_t>(l) * slots_per_rank + i;
      store.weights_[index].resize(layout.weight_bytes);
      if (store.IsHomeSlot(p, slot)) store.optimizer_[index].resize(layout.optimizer_bytes);
    }
  }
  return store;
}

std::vector<std::byte>& ExpertStore::Region(int layer, int slot, SlotRegion region) {
  const size_t index =
      static_cast<size_t>(layer) * slots_per_rank_ + (slot - rank_ * slots_per_rank_);
  return region == SlotRegion::kWeights ? weights_[index] : optimizer_[index];
}

Result<ExpertStore> ExpertStore::Wrap(int rank, int num_layers, int slots_per_rank,
                                      const ExpertLayout& layout,
                                      std::vector<std::span<std::byte>> weights,
                                      std::vector<std::span<std::byte>> optimizer,
                                      DeviceMemory* device) {
  if (num_layers <= 0 || slots_per_rank <= 0 || rank < 0) {
    return InvalidArgument("expert store needs a rank >= 0, layers > 0 and slots > 0 (rank " +
                           std::to_string(rank) + ", layers " + std::to_string(num_layers) +
                           ", slots " + std::to_string(slots_per_rank) + ")");
  }
  const size_t regions = static_cast<size_t>(num_layers) * slots_per_rank;
  if (weights.size() != regions || optimizer.size() != regions) {
    return InvalidArgument("expert store needs " + std::to_string(regions) +
                           " weight and optimizer regions, got " + std::to_string(weights.size()) +
                           " and " + std::to_string(optimizer.size()));
  }
  for (size_t i = 0; i < regions; ++i) {
    const std::string where = "layer " + std::to_string(i / slots_per_rank) + " local slot " +
                              std::to_string(i % slots_per_rank);
    if (weights[i].size() != layout.weight_bytes || weights[i].data() == nullptr) {
      return InvalidArgument(where + ": weights region has " + std::to_string(weights[i].size()) +
                             " bytes, expected " + std::to_string(layout.weight_bytes));
    }
    if (optimizer[i].size() != layout.optimizer_bytes ||
        (layout.optimizer_bytes > 0 && optimizer[i].data() == nullptr)) {
      return InvalidArgument(where + ": optimizer region has " +
                             std::to_string(optimizer[i].size()) + " bytes, expected " +
                             std::to_string(layout.optimizer_bytes));
    }
  }
  ExpertStore store(rank, num_layers, slots_per_rank, layout);
  store.wrapped_ = true;
  store.wrapped_weights_ = std::move(weights);
  store.wrapped_optimizer_ = std::move(optimizer);
  store.device_ = device;
  return store;
}

std::span<std::byte> ExpertStore::LiveRegion(int layer, int slot, SlotRegion region) {
  if (!wrapped_) return Region(layer, slot, region);
  const size_t index =
      static_cast<size_t>(layer) * slots_per_rank_ + (slot - rank_ * slots_per_rank_);
  return region == SlotRegion::kWeights ? wrapped_weights_[index] : wrapped_optimizer_[index];
}

std::span<std::byte> ExpertStore::Live(int layer, int slot, SlotRegion region) {
  return LiveRegion(layer, slot, region);
}

std::span<const std::byte> ExpertStore::Live(int layer, int slot, SlotRegion region) const {
  return const_cast<ExpertStore*>(this)->LiveRegion(layer, slot, region);
}

std::span<std::byte> ExpertStore::Stage(int layer, int slot, SlotRegion region) {
  std::vector<std::byte>& buffer = staged_[Key{layer, slot - rank_ * slots_per_rank_, region}];
  buffer.resize(region == SlotRegion::kWeights ? layout_.weight_bytes : layout_.optimizer_bytes);
  return buffer;
}

Status ExpertStore::Commit(std::span<const Placement> placements) {
  if (static_cast<int>(placements.size()) != num_layers_) {
    return InvalidArgument("commit got " + std::to_string(placements.size()) +
                           " layers, the store has " + std::to_string(num_layers_));
  }
  for (auto& [key, buffer] : staged_) {
    const auto [layer, local_slot, region] = key;
    const int slot = rank_ * slots_per_rank_ + local_slot;
    if (wrapped_) {
      std::span<std::byte> live = LiveRegion(layer, slot, region);
      if (device_ != nullptr && device_->IsDeviceMemory(live.data())) {
        const Status copied = device_->Copy(live.data(), buffer.data(), buffer.size());
        if (!copied.ok()) {
          return Status(copied.code(), "commit of layer " + std::to_string(layer) + " slot " +
                                           std::to_string(slot) +
                                           " to the device: " + copied.message());
        }
      } else {
        std::copy(buffer.begin(), buffer.end(), live.begin());
      }
    } else {
      Region(layer, slot, region).swap(buffer);
    }
  }
  staged_.clear();
  if (wrapped_) return Status::Ok();  // the owner keeps every region
  for (int l = 0; l < num_layers_; ++l) {
    for (int i = 0; i < slots_per_rank_; ++i) {
      const int slot = rank_ * slots_per_rank_ + i;
      if (!IsHomeSlot(placements[l], slot)) Region(l, slot, SlotRegion::kOptimizer) = {};
    }
  }
  return Status::Ok();
}

}  // namespace keel
