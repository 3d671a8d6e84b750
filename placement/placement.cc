// Placement: construction, validation and the derived EPLB-shaped maps.
#include "placement/placement.h"

#include <algorithm>
#include <string>

namespace keel {

Result<Placement> Placement::Create(int num_experts, int num_ranks, std::vector<int> phy2log,
                                    std::vector<int> home) {
  if (num_experts < 1) {
    return InvalidArgument("num_experts must be >= 1, got " + std::to_string(num_experts));
  }
  if (num_ranks < 1) {
    return InvalidArgument("num_ranks must be >= 1, got " + std::to_string(num_ranks));
  }
  const int num_slots = static_cast<int>(phy2log.size());
  if (num_slots == 0 || num_slots % num_ranks != 0) {
    return InvalidArgument("phy2log has " + std::to_string(num_slots) +
                           " slots, not a positive multiple of num_ranks " +
                           std::to_string(num_ranks));
  }
  Placement p;
  p.num_experts_ = num_experts;
  p.num_ranks_ = num_ranks;
  p.slots_per_rank_ = num_slots / num_ranks;
  for (int s = 0; s < num_slots; ++s) {
    const int e = phy2log[s];
    if (e != kEmptySlot && (e < 0 || e >= num_experts)) {
      return InvalidArgument("phy2log[" + std::to_string(s) + "] = " + std::to_string(e) +
                             " is not an expert in [0, " + std::to_string(num_experts) + ")");
    }
  }
  p.phy2log_ = std::move(phy2log);
  p.BuildIndex();
  for (int e = 0; e < num_experts; ++e) {
    if (p.logcnt_[e] == 0) {
      return InvalidArgument("expert " + std::to_string(e) + " has no copy in phy2log");
    }
  }
  if (home.empty()) {
    home.resize(num_experts);
    for (int e = 0; e < num_experts; ++e) home[e] = p.rank_of_slot(p.copies(e)[0]);
  } else if (static_cast<int>(home.size()) != num_experts) {
    return InvalidArgument("home has " + std::to_string(home.size()) + " entries, expected " +
                           std::to_string(num_experts));
  }
  for (int e = 0; e < num_experts; ++e) {
    if (home[e] < 0 || home[e] >= num_ranks || !p.holds(home[e], e)) {
      return InvalidArgument("home[" + std::to_string(e) + "] = " + std::to_string(home[e]) +
                             " is not a rank holding a copy of expert " + std::to_string(e));
    }
  }
  p.home_ = std::move(home);
  return p;
}

Result<Placement> Placement::CreateKeepingHomes(const Placement& previous,
                                                std::vector<int> phy2log) {
  KEEL_ASSIGN_OR_RETURN(Placement p,
                        Create(previous.num_experts(), previous.num_ranks(), std::move(phy2log)));
  for (int e = 0; e < p.num_experts(); ++e) {
    if (p.holds(previous.home(e), e)) p.home_[e] = previous.home(e);
  }
  return p;
}

Result<Placement> Placement::Contiguous(int num_experts, int num_ranks, int slots_per_rank) {
  if (num_ranks < 1 || slots_per_rank < 1) {
    return InvalidArgument("num_ranks and slots_per_rank must be >= 1, got " +
                           std::to_string(num_ranks) + " and " + std::to_string(slots_per_rank));
  }
  const int per_rank = num_experts / num_ranks;
  const int extra = num_experts % num_ranks;
  const int needed = per_rank + (extra > 0 ? 1 : 0);
  if (needed > slots_per_rank) {
    return InvalidArgument("static placement of " + std::to_string(num_experts) + " experts on " +
                           std::to_string(num_ranks) + " ranks needs " + std::to_string(needed) +
                           " slots per rank, have " + std::to_string(slots_per_rank));
  }
  std::vector<int> phy2log(static_cast<size_t>(num_ranks) * slots_per_rank, kEmptySlot);
  int expert = 0;
  for (int g = 0; g < num_ranks; ++g) {
    const int count = per_rank + (g < extra ? 1 : 0);
    for (int i = 0; i < count; ++i) phy2log[g * slots_per_rank + i] = expert++;
  }
  return Create(num_experts, num_ranks, std::move(phy2log));
}

void Placement::BuildIndex() {
  // Locals and raw pointers: through the members, every int store could change slots_per_rank_
  // or num_experts_ as far as the compiler knows, and each loop would reload them.
  const int num_experts = num_experts_;
  const int num_slots = static_cast<int>(phy2log_.size());
  const int slots_per_rank = slots_per_rank_;
  const int* phy2log = phy2log_.data();
  logcnt_.assign(num_experts, 0);
  int* logcnt = logcnt_.data();
  for (int s = 0; s < num_slots; ++s) {
    if (phy2log[s] != kEmptySlot) ++logcnt[phy2log[s]];
  }
  copy_begin_.resize(num_experts + 1);
  int* copy_begin = copy_begin_.data();
  copy_begin[0] = 0;
  for (int e = 0; e < num_experts; ++e) copy_begin[e + 1] = copy_begin[e] + logcnt[e];
  copy_slots_.resize(copy_begin[num_experts]);
  copy_ranks_.resize(copy_begin[num_experts]);
  int* copy_slots = copy_slots_.data();
  int* copy_ranks = copy_ranks_.data();
  std::vector<int> fill(copy_begin, copy_begin + num_experts);
  for (int s = 0, rank = 0, on_rank = 0; s < num_slots; ++s) {
    const int e = phy2log[s];
    if (e != kEmptySlot) {
      copy_ranks[fill[e]] = rank;
      copy_slots[fill[e]++] = s;
    }
    if (++on_rank == slots_per_rank) {  // the next slot starts the next rank
      on_rank = 0;
      ++rank;
    }
  }
}

int Placement::max_copies() const {
  return logcnt_.empty() ? 0 : *std::max_element(logcnt_.begin(), logcnt_.end());
}

std::vector<int> Placement::Log2Phy(int width) const {
  std::vector<int> out(static_cast<size_t>(num_experts_) * width, -1);
  for (int e = 0; e < num_experts_; ++e) {
    auto slots = copies(e);
    for (int r = 0; r < static_cast<int>(slots.size()) && r < width; ++r) {
      out[e * width + r] = slots[r];
    }
  }
  return out;
}

PlacementChange DiffPlacements(const Placement& from, const Placement& to) {
  PlacementChange change;
  for (int s = 0; s < to.num_slots() && s < from.num_slots(); ++s) {
    if (from.expert_at(s) != to.expert_at(s) && to.expert_at(s) != kEmptySlot) {
      ++change.changed_slots;
    }
  }
  for (int e = 0; e < to.num_experts() && e < from.num_experts(); ++e) {
    if (from.home(e) != to.home(e)) ++change.moved_homes;
  }
  return change;
}

int Placement::home_slot(int expert) const {
  for (int slot : copies(expert)) {
    if (rank_of_slot(slot) == home(expert)) return slot;
  }
  return -1;  // unreachable: Create checks that the home holds a copy
}

}  // namespace keel
