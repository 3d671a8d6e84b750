// One MoE layer's placement: which logical expert each physical slot holds, and which rank is
// each expert's home. Shapes and meaning follow DeepSeek EPLB / vLLM / SGLang so policies can be
// swapped in and out: phy2log[slot], log2phy[e][r] padded with -1, logcnt[e]; plus home[e].
#pragma once

#include <span>
#include <vector>

#include "keel/status.hpp"

namespace keel {

// A slot that holds no expert.
inline constexpr int kEmptySlot = -1;

class Placement {
 public:
  // phy2log: [num_ranks * slots_per_rank] expert id per slot (or kEmptySlot); slot s lives on rank
  // s / slots_per_rank. Every expert in [0, num_experts) must have at least one copy.
  // home: [num_experts] rank that owns each expert's master weights and optimizer state; it must
  // hold a copy. Empty: each expert's home is the rank of its first (lowest) slot.
  static Result<Placement> Create(int num_experts, int num_ranks, std::vector<int> phy2log,
                                  std::vector<int> home = {});

  // Like Create, but every expert keeps its home from `previous` when it still has a copy there;
  // otherwise the home moves to the rank of its first slot (a home move the cost model charges).
  static Result<Placement> CreateKeepingHomes(const Placement& previous, std::vector<int> phy2log);

  // The static baseline: rank g holds experts [g*E/G, (g+1)*E/G) in its first slots (the first
  // E % G ranks take one more), remaining slots empty. Fails when ceil(E/G) > slots_per_rank.
  static Result<Placement> Contiguous(int num_experts, int num_ranks, int slots_per_rank);

  int num_experts() const { return num_experts_; }
  int num_ranks() const { return num_ranks_; }
  int slots_per_rank() const { return slots_per_rank_; }
  int num_slots() const { return static_cast<int>(phy2log_.size()); }
  int rank_of_slot(int slot) const { return slot / slots_per_rank_; }

  // [num_slots] int: expert per slot, kEmptySlot for an unused slot.
  const std::vector<int>& phy2log() const { return phy2log_; }
  int expert_at(int slot) const { return phy2log_[slot]; }
  // [num_experts] int: copies per expert.
  const std::vector<int>& logcnt() const { return logcnt_; }
  // [num_experts] int: home rank per expert.
  const std::vector<int>& home() const { return home_; }
  int home(int expert) const { return home_[expert]; }
  // The slot on `expert`'s home rank that keeps its optimizer state: the lowest slot of the
  // expert on that rank (Create guarantees one exists).
  int home_slot(int expert) const;

  // Slots holding `expert`, ascending.
  std::span<const int> copies(int expert) const {
    return {copy_slots_.data() + copy_begin_[expert],
            static_cast<size_t>(copy_begin_[expert + 1] - copy_begin_[expert])};
  }
  // Ranks of copies(expert), in the same order.
  std::span<const int> copy_ranks(int expert) const {
    return {copy_ranks_.data() + copy_begin_[expert],
            static_cast<size_t>(copy_begin_[expert + 1] - copy_begin_[expert])};
  }
  // Every expert's copies back to back, by expert: copies(e) and copy_ranks(e) are the entries
  // [copy_begin()[e], copy_begin()[e + 1]) of all_copy_slots() and all_copy_ranks(), which lets a
  // planner take over the whole index with two copies instead of one span per expert.
  const std::vector<int>& copy_begin() const { return copy_begin_; }  // [num_experts + 1]
  const std::vector<int>& all_copy_slots() const { return copy_slots_; }
  const std::vector<int>& all_copy_ranks() const { return copy_ranks_; }
  // True when some slot of `rank` holds `expert`. Inline: validation and the cost model ask it
  // once per expert or slot.
  bool holds(int rank, int expert) const {
    for (int r : copy_ranks(expert)) {
      if (r == rank) return true;
    }
    return false;
  }
  // Largest logcnt over experts.
  int max_copies() const;

  // [num_experts * width] int: log2phy padded with -1; width must be >= max_copies().
  std::vector<int> Log2Phy(int width) const;

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.num_experts_ == b.num_experts_ && a.num_ranks_ == b.num_ranks_ &&
           a.phy2log_ == b.phy2log_ && a.home_ == b.home_;
  }

 private:
  Placement() = default;
  void BuildIndex();

  int num_experts_ = 0;
  int num_ranks_ = 0;
  int slots_per_rank_ = 0;
  std::vector<int> phy2log_;
  std::vector<int> home_;
  std::vector<int> logcnt_;
  std::vector<int> copy_begin_;  // [num_experts + 1] offsets into copy_slots_
  std::vector<int> copy_slots_;
  std::vector<int> copy_ranks_;  // rank of each entry of copy_slots_, so callers need not divide
};

// What turning `from` into `to` costs in persistent state (same shape required).
struct PlacementChange {
  int changed_slots = 0;  // slots whose expert differs
  int moved_homes = 0;    // experts whose home rank differs
};
PlacementChange DiffPlacements(const Placement& from, const Placement& to);

}  // namespace keel
