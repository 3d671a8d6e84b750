// StepPlanner::Impl's routing of one expert's tokens to its copies (step_planner_impl.h): a
// source's own rank first, then each node's copies from that node's sources, levelled so that
// what crosses between nodes next is as even as it can be, then the rest in copy order.
#include <algorithm>
#include <cmath>
#include <vector>

#include "placement/step_planner_impl.h"

namespace keel {
namespace {

// What each of `count` sources (remaining[sources[k]] tokens each) gives so that min(open, all
// they have) tokens come from them and what they keep is as even as possible: the richest give
// first, down to a common level L with sum of max(0, remaining - L) = open. What a source keeps
// goes to other nodes next, over the slowest links, and the cost model prices the busiest of
// them, so the level keeps that peak as low as it can be. With whole numbers L is whole and the
// few tokens left over come one each from the sources at the level, in source order. Writes
// gives[k]; `order` is scratch.
void LevelGives(const double* remaining, const int* sources, int count, double open, bool whole,
                std::vector<int>& order, double* gives) {
  if (count == 1) {
    gives[0] = std::min(remaining[sources[0]], open);
    return;
  }
  double total = 0;
  for (int k = 0; k < count; ++k) total += remaining[sources[k]];
  if (total <= open) {
    for (int k = 0; k < count; ++k) gives[k] = remaining[sources[k]];
    return;
  }
  // Richest first (ties: listed order); an insertion sort, as a node has a handful of sources.
  order.resize(count);
  for (int k = 0; k < count; ++k) {
    int at = k;
    while (at > 0 && remaining[sources[order[at - 1]]] < remaining[sources[k]]) {
      order[at] = order[at - 1];
      --at;
    }
    order[at] = k;
  }
  // With the richest j giving, the level is (their sum - open) / j, once no other source has
  // more than that. Whole numbers compare without the division, so exactly.
  double richest = 0;
  int j = 1;
  for (;; ++j) {
    richest += remaining[sources[order[j - 1]]];
    if (j == count) break;
    const double next = remaining[sources[order[j]]];
    if (whole ? next * j <= richest - open : next <= (richest - open) / j) break;
  }
  if (!whole) {
    const double level = (richest - open) / j;
    // Sums in another order can put the level a rounding error below zero: everything goes.
    for (int k = 0; k < count; ++k) {
      gives[k] = level > 0 ? std::max(0.0, remaining[sources[k]] - level) : remaining[sources[k]];
    }
    return;
  }
  // Whole tokens: the least whole level that gives no more than `open`, the ceiling of the exact
  // one, and the tokens that this leaves over from the sources at the level.
  const long long excess = std::llround(richest - open);
  const double level = static_cast<double>(excess > 0 ? (excess + j - 1) / j : 0);
  double extra = open;
  for (int k = 0; k < count; ++k) {
    gives[k] = std::max(0.0, remaining[sources[k]] - level);
    extra -= gives[k];
  }
  for (int k = 0; k < count && extra > 0; ++k) {
    if (level > 0 && remaining[sources[k]] >= level) {
      gives[k] += 1;
      extra -= 1;
    }
  }
}

}  // namespace

void StepPlanner::Impl::AddSingleLinks(int expert, int rank, double sign, double* links) {
  const int first = node_of_[rank] * topology_.gpus_per_node();
  AddSingleLinkSums(Column(expert), rank, first,
                    std::min(first + topology_.gpus_per_node(), num_ranks_), num_ranks_, sign,
                    links);
}

void StepPlanner::Impl::ByNode(int begin, int count, const double* room,
                               std::vector<int>& by_node) const {
  by_node.clear();
  for (int i = 0; i < count; ++i) {
    if (!(room[i] > 0)) continue;
    const int node = node_of_[solver_.copy_rank(begin + i)];
    // Insertion keeps copy order among copies of one node; an expert has a handful of copies.
    auto at = by_node.end();
    while (at != by_node.begin() && node_of_[solver_.copy_rank(begin + *(at - 1))] > node) --at;
    by_node.insert(at, i);
  }
}

void StepPlanner::Impl::LevelNode(int begin, const double* room, const double* remaining,
                                  size_t& run) {
  const int node = node_of_[solver_.copy_rank(begin + copy_nodes_[run])];
  node_copies_.clear();
  for (; run < copy_nodes_.size() && node_of_[solver_.copy_rank(begin + copy_nodes_[run])] == node;
       ++run) {
    node_copies_.push_back(copy_nodes_[run]);
  }
  const int per_node = topology_.gpus_per_node();
  node_sources_.clear();
  for (int r = node * per_node; r < (node + 1) * per_node; ++r) {
    for (int s = r; s < num_sources_; s += num_ranks_) node_sources_.push_back(s);
  }
  double supply = 0;
  double demand = 0;
  for (int s : node_sources_) supply += remaining[s];
  for (int i : node_copies_) demand += room[i];
  const double flow = std::min(supply, demand);
  gives_.resize(node_sources_.size());
  takes_.resize(node_copies_.size());
  LevelGives(remaining, node_sources_.data(), static_cast<int>(node_sources_.size()), flow, whole_,
             level_order_, gives_.data());
  LevelGives(room, node_copies_.data(), static_cast<int>(node_copies_.size()), flow, whole_,
             level_order_, takes_.data());
}

void StepPlanner::Impl::AssignSpread(int expert, const QuotaSplit& split, double sign,
                                     Draft& draft) {
  const int num_slots = num_slots_;
  const int num_sources = num_sources_;
  const int num_ranks = num_ranks_;
  const QuotaSolver& solver = solver_;
  const int begin = solver.copy_begin(expert);
  const int count = CopyEnd(expert) - begin;
  const double scale = Scale(expert);
  room_.resize(count);
  for (int i = 0; i < count; ++i) {
    const int id = solver.copy_id(begin + i);
    const long long quota =
        id < num_slots ? split.slot_quota[id] : split.extra_quota[id - num_slots];
    room_[i] = static_cast<double>(quota) * scale;
  }
  if (rounded_[expert] == 0) room_[0] = totals_[expert];  // under half a token: first copy
  if (record_shares_) draft.shares.Reserve(MaxShares(count));
  // Raw pointers: the loops below store doubles, which could be any of these vectors' elements
  // as far as the compiler knows, so through the vectors it would reload every pointer.
  double* remaining = remaining_.data();
  std::memcpy(remaining, by_expert_ + static_cast<size_t>(expert) * num_sources,
              sizeof(double) * num_sources);
  double* received = draft.received.data();
  double* rank_tokens = draft.rank_tokens.data();
  double* slot_tokens = draft.slot_tokens.data();
  double* transient_tokens = draft.transient_tokens.data();
  double* copy_room = room_.data();
  const int* source_rank = source_rank_.data();

  // The copy being filled keeps its open quota and its slot's and rank's running sums in
  // registers until another copy is filled: the additions happen in the same order as one store
  // per share would make them (so the same bits), without each waiting for the previous store.
  int open_copy = -1;
  int id = 0;
  int rank = 0;
  size_t rank_row = 0;  // where the open copy's rank's row of received tokens starts
  // Source rank `column` sends the open copy's rank `tokens` more.
  auto add_received = [&](int column, double tokens) {
    received[rank_row + column] += tokens;
    draft.Wrote(rank_row + column);
  };
  double room = 0;
  double slot_sum = 0;
  double rank_sum = 0;
  auto slot_cell = [&]() -> double& {
    return id < num_slots ? slot_tokens[id] : transient_tokens[id - num_slots];
  };
  auto close = [&]() {
    if (open_copy < 0) return;
    copy_room[open_copy] = room;
    slot_cell() = slot_sum;
    rank_tokens[rank] = rank_sum;
  };
  auto switch_to = [&](int i) {
    close();
    open_copy = i;
    id = solver.copy_id(begin + i);
    rank = solver.copy_rank(begin + i);
    rank_row = static_cast<size_t>(rank) * num_ranks;
    room = copy_room[i];
    slot_sum = slot_cell();
    rank_sum = rank_tokens[rank];
  };
  // The check stays inline at every call; the rare switch is one out-of-line call.
  auto open = [&](int i) {
    if (i != open_copy) switch_to(i);
  };
  // Source s sends `tokens` to the open copy (the caller takes them off what s has left).
  auto send = [&](int s, double tokens) {
    if (record_shares_ && Recorded(source_rank[s], rank)) {
      draft.shares.Append({source_rank[s], expert, id, tokens});
    }
    // sign is 1 except where PatchTrial takes a routing out, and x * 1.0 is x.
    slot_sum += sign * tokens;
    rank_sum += sign * tokens;
    add_received(source_rank[s], sign * tokens);
  };
  auto take = [&](int s) {
    const double tokens = std::min(remaining[s], room);
    if (tokens <= 0) return;
    room -= tokens;
    remaining[s] -= tokens;
    send(s, tokens);
  };
  // Sources s to s + 3 (s a multiple of 4, source_quads_) to the open copy as far as its room
  // goes. With exact sums (whole_), when all four fit they go in one step: in any order the sums
  // are the same, and each cell of the row gets one addition either way.
  const bool quads = whole_ && source_quads_;
  auto take_quad = [&](int s) KEEL_INLINE {
    // Four scalars: this file is not compiled for AVX2, and a DoubleQuad would go through the
    // stack as two SSE halves.
    const double l0 = remaining[s], l1 = remaining[s + 1], l2 = remaining[s + 2],
                 l3 = remaining[s + 3];
    const double sum = (l0 + l1) + (l2 + l3);
    if (sum == 0) return;
    if (sum > room) {
      for (int k = s; k < s + 4; ++k) take(k);
      return;
    }
    if (record_shares_) {
      const double left[4] = {l0, l1, l2, l3};
      for (int k = 0; k < 4; ++k) {
        if (left[k] > 0 && Recorded(s + k, rank)) {
          draft.shares.Append({s + k, expert, id, left[k]});
        }
      }
    }
    room -= sum;
    remaining[s] = remaining[s + 1] = remaining[s + 2] = remaining[s + 3] = 0;
    slot_sum += sign * sum;
    rank_sum += sign * sum;
    add_received(s, sign * l0);
    add_received(s + 1, sign * l1);
    add_received(s + 2, sign * l2);
    add_received(s + 3, sign * l3);
  };
  // Local: sources on the copy's own rank. A copy without room takes nothing (quotas and what
  // sources have left are never negative), so it is not opened.
  for (int i = 0; i < count; ++i) {
    if (copy_room[i] <= 0 && i != open_copy) continue;
    open(i);
    for (int s = rank; s < num_sources; s += num_ranks) take(s);
  }
  // Same node, node by node: what the node's sources can give its copies flows so that both the
  // sources' leftovers (sent to other nodes next) and the copies' open quotas (received from
  // other nodes next) end level (LevelGives); the copies then take their share from the sources
  // in order.
  close();  // copy_room[] is read below
  ByNode(begin, count, copy_room, copy_nodes_);
  for (size_t run = 0; run < copy_nodes_.size();) {
    LevelNode(begin, copy_room, remaining, run);
    const int copies = static_cast<int>(node_copies_.size());
    const int listed = static_cast<int>(node_sources_.size());
    int k = 0;
    for (int c = 0; c < copies; ++c) {
      open(node_copies_[c]);
      double want = std::min(takes_[c], room);
      while (want > 0 && k < listed) {
        const double tokens = std::min(want, gives_[k]);
        if (tokens > 0) {
          want -= tokens;
          gives_[k] -= tokens;
          room -= tokens;
          remaining[node_sources_[k]] -= tokens;
          send(node_sources_[k], tokens);
        }
        if (gives_[k] <= 0) ++k;
      }
    }
  }
  // The rest, in source order; rounding dust goes to the copy last used. Each source comes up
  // once here, so what it has left stays in a register.
  int next = 0;
  auto rest = [&](int s) KEEL_INLINE {
    double left = remaining[s];
    if (!(left > 0)) return;
    while (left > 0 && next < count) {
      open(next);
      const double tokens = std::min(left, room);
      if (tokens > 0) {
        room -= tokens;
        left -= tokens;
        send(s, tokens);
      }
      if (room <= 0) ++next;
    }
    if (left > 0) {
      open(std::min(next, count - 1));
      send(s, left);
    }
  };
  if (quads) {
    // take_quad leaves a source nothing or runs take on it, whose leftover rest then sends.
    for (int s = 0; s < num_sources; s += 4) {
      if (next < count) {
        open(next);
        take_quad(s);
        if (room <= 0) ++next;
      }
      for (int k = s; k < s + 4; ++k) rest(k);
    }
  } else {
    for (int s = 0; s < num_sources; ++s) rest(s);
  }
  close();
}

void StepPlanner::Impl::AssignSpreadWhole(int expert, const QuotaSplit& split, double sign,
                                          Draft& draft) {
  if (keep_rows_) {
    AssignSpreadWholeRows<true>(expert, split, sign, draft);
  } else {
    AssignSpreadWholeRows<false>(expert, split, sign, draft);
  }
}

template <bool kRows>
void StepPlanner::Impl::AssignSpreadWholeRows(int expert, const QuotaSplit& split, double sign,
                                              Draft& draft) {
  const int num_slots = num_slots_;
  const int num_ranks = num_ranks_;
  const QuotaSolver& solver = solver_;
  const int begin = solver.copy_begin(expert);
  const int count = CopyEnd(expert) - begin;
  room_.resize(count);
  double* room = room_.data();
  for (int i = 0; i < count; ++i) {
    const int id = solver.copy_id(begin + i);
    const double quota = static_cast<double>(id < num_slots ? split.slot_quota[id]
                                                            : split.extra_quota[id - num_slots]);
    room[i] = quota;
    (id < num_slots ? draft.slot_tokens[id] : draft.transient_tokens[id - num_slots]) +=
        sign * quota;
    draft.rank_tokens[solver.copy_rank(begin + i)] += sign * quota;
  }
  // Raw pointers: the stores below are doubles, which could be any vector's elements as far as
  // the compiler knows.
  double* remaining = remaining_.data();
  if (by_expert_ != nullptr) {
    std::memcpy(remaining, by_expert_ + static_cast<size_t>(expert) * num_ranks,
                sizeof(double) * num_ranks);
  } else {
    CountsToDoubles(counts_ + static_cast<size_t>(expert) * num_ranks, num_ranks, remaining);
  }
  double* received = draft.received.data();
  double* from_node = draft.links.data() + static_cast<size_t>(kFromNode) * num_ranks;
  double* to_node = draft.links.data() + static_cast<size_t>(kToNode) * num_ranks;
  double* kept = draft.links.data() + static_cast<size_t>(kKept) * num_ranks;
  const bool record_shares = record_shares_;
  if (record_shares) draft.shares.Reserve(MaxShares(count));
  // One copy at a time: `rank` and `id` are the copy's, `open` its quota still open (a local, so
  // that it stays in a register), `row` where its rank's row of received tokens starts (with
  // kRows). Source (= rank) s sends it `tokens` > 0.
  int rank = 0;
  int id = 0;
  double open = 0;
  size_t row = 0;
  auto select = [&](int i) KEEL_INLINE {
    rank = solver.copy_rank(begin + i);
    id = solver.copy_id(begin + i);
    open = room[i];
    if constexpr (kRows) row = static_cast<size_t>(rank) * num_ranks;
  };
  auto add_row = [&](int s, double tokens) KEEL_INLINE {
    if constexpr (kRows) {
      received[row + s] += sign * tokens;
      draft.Wrote(row + s);
    }
  };
  auto share = [&](int s, double tokens) KEEL_INLINE {
    if (record_shares && Recorded(s, rank)) draft.shares.Append({s, expert, id, tokens});
  };
  // A share from a source on the copy's node, which the link sums count (the copy's from_node
  // once its pass is done: `near` adds up its shares).
  double near = 0;
  auto give_near = [&](int s, double tokens) KEEL_INLINE {
    open -= tokens;
    remaining[s] -= tokens;
    add_row(s, tokens);
    near += tokens;
    to_node[s] += sign * tokens;
    share(s, tokens);
  };
  // Local: each copy takes what its own rank has.
  for (int i = 0; i < count; ++i) {
    select(i);
    const double tokens = std::min(remaining[rank], open);
    if (tokens > 0) {
      give_near(rank, tokens);
      kept[rank] += sign * tokens;
      from_node[rank] += sign * tokens;
    }
    room[i] = open;
  }
  // Same node, node by node and levelled (LevelNode), as AssignSpread's second pass.
  ByNode(begin, count, room, copy_nodes_);
  for (size_t run = 0; run < copy_nodes_.size();) {
    LevelNode(begin, room, remaining, run);
    const int copies = static_cast<int>(node_copies_.size());
    const int listed = static_cast<int>(node_sources_.size());
    int k = 0;
    for (int c = 0; c < copies; ++c) {
      const int i = node_copies_[c];
      select(i);
      near = 0;
      double want = takes_[c];
      while (want > 0 && k < listed) {
        const double tokens = std::min(want, gives_[k]);
        if (tokens > 0) {
          want -= tokens;
          gives_[k] -= tokens;
          give_near(node_sources_[k], tokens);
        }
        if (gives_[k] <= 0) ++k;
      }
      from_node[rank] += sign * near;
      room[i] = open;
    }
  }
  // The rest: sources in order fill copies in order, as AssignSpread's last pass does. The
  // quotas left add up to what the sources have left, so nothing is left over. A copy with
  // quota left has emptied every source on its node, so these shares come from other nodes and
  // leave the link sums alone: without rows or shares to write, nothing is left to do.
  if (!kRows && !record_shares) return;
  if (!kRows && shares_of_rank_ >= 0) {
    // Only the shares of one rank: laid end to end in that order, the sources' tokens and the
    // copies' open quotas cover the same span, and a share is where a source's stretch meets a
    // copy's (exact sums). A copy elsewhere takes that rank's stretch alone; a copy on it, every
    // source's, in order.
    const int mine = shares_of_rank_;
    double mine_begin = 0;
    for (int k = 0; k < mine; ++k) mine_begin += remaining[k];
    const double mine_end = mine_begin + remaining[mine];
    double copy_begin = 0;
    for (int i = 0; i < count; ++i) {
      if (room[i] <= 0) continue;
      select(i);
      const double copy_end = copy_begin + open;
      if (rank != mine) {
        const double tokens = std::min(copy_end, mine_end) - std::max(copy_begin, mine_begin);
        if (tokens > 0) share(mine, tokens);
      } else {
        double at = 0;
        for (int k = 0; k < num_ranks && at < copy_end; ++k) {
          const double next = at + remaining[k];
          const double tokens = std::min(copy_end, next) - std::max(copy_begin, at);
          if (tokens > 0) share(k, tokens);
          at = next;
        }
      }
      copy_begin = copy_end;
    }
    return;
  }
  // Four sources that fit the copy go at once.
  int s = 0;
  for (int i = 0; i < count; ++i) {
    if (room[i] <= 0) continue;
    select(i);
    while (open > 0 && s < num_ranks) {
      if (s % 4 == 0 && s + 4 <= num_ranks) {
        const double l0 = remaining[s], l1 = remaining[s + 1], l2 = remaining[s + 2],
                     l3 = remaining[s + 3];
        const double sum = (l0 + l1) + (l2 + l3);
        if (sum <= open) {
          // Each cell gets one addition, of +0.0 or -0.0 where the source has nothing left:
          // neither changes a cell, which is never -0.0.
          open -= sum;
          add_row(s, l0);
          add_row(s + 1, l1);
          add_row(s + 2, l2);
          add_row(s + 3, l3);
          if (record_shares) {
            const double left[4] = {l0, l1, l2, l3};
            // With one rank's shares, a copy elsewhere records only that rank's.
            const int mine = shares_of_rank_ - s;
            if (shares_of_rank_ < 0 || rank == shares_of_rank_) {
              for (int k = 0; k < 4; ++k) {
                if (left[k] > 0) share(s + k, left[k]);
              }
            } else if (mine >= 0 && mine < 4 && left[mine] > 0) {
              share(shares_of_rank_, left[mine]);
            }
          }
          s += 4;
          continue;
        }
      }
      const double tokens = std::min(remaining[s], open);
      if (tokens > 0) {
        assert(node_of_[s] != node_of_[rank]);
        open -= tokens;
        remaining[s] -= tokens;
        add_row(s, tokens);
        share(s, tokens);
      }
      if (remaining[s] <= 0) ++s;
    }
  }
}

void StepPlanner::Impl::AddExpert(int expert, const QuotaSplit& split, double sign, bool single_row,
                                  Draft& draft) {
  if (RankCount(expert) > 1) {
    if (fast_) {
      AssignSpreadWhole(expert, split, sign, draft);
    } else {
      AssignSpread(expert, split, sign, draft);
    }
    return;
  }
  const int num_slots = num_slots_;
  const int begin = solver_.copy_begin(expert);
  const int end = CopyEnd(expert);
  const int rank = solver_.copy_rank(begin);
  const double total = totals_[expert];
  const double scale = Scale(expert);
  draft.rank_tokens[rank] += sign * total;
  if (record_shares_) room_.resize(end - begin);
  for (int c = begin; c < end; ++c) {
    const int id = solver_.copy_id(c);
    const double tokens =
        rounded_[expert] == 0
            ? (c == begin ? total : 0.0)
            : static_cast<double>(id < num_slots ? split.slot_quota[id]
                                                 : split.extra_quota[id - num_slots]) *
                  scale;
    (id < num_slots ? draft.slot_tokens[id] : draft.transient_tokens[id - num_slots]) +=
        sign * tokens;
    if (record_shares_) room_[c - begin] = tokens;
  }
  if (single_row && fast_) {
    AddSingleLinks(expert, rank, sign, draft.links.data());
  } else if (single_row) {
    const size_t row = static_cast<size_t>(rank) * num_ranks_;
    const double* column = by_expert_ + static_cast<size_t>(expert) * num_sources_;
    for (int s = 0; s < num_sources_; ++s) {
      draft.received[row + source_rank_[s]] += sign * column[s];
      draft.Wrote(row + source_rank_[s]);
    }
  }
  if (record_shares_) ShareInSourceOrder(expert, draft);
}

void StepPlanner::Impl::ShareInSourceOrder(int expert, Draft& draft) {
  const int begin = solver_.copy_begin(expert);
  const int count = CopyEnd(expert) - begin;
  const double* column = Column(expert);
  draft.shares.Reserve(MaxShares(count));
  if (count == 1 && whole_) {
    // One copy, exact sums: its quota is the expert's total, so each source sends all it has in
    // one share, as the loop below would. Only the shares to record are looked at.
    const int id = solver_.copy_id(begin);
    const int rank = solver_.copy_rank(begin);
    auto share = [&](int s) {
      if (column[s] > 0) draft.shares.Append({source_rank_[s], expert, id, column[s]});
    };
    if (shares_of_rank_ < 0 || shares_of_rank_ == rank) {
      for (int s = 0; s < num_sources_; ++s) share(s);
    } else {
      for (int s = shares_of_rank_; s < num_sources_; s += num_ranks_) share(s);
    }
    return;
  }
  int open = 0;
  for (int s = 0; s < num_sources_; ++s) {
    double remaining = column[s];
    while (remaining > 0 && open < count) {
      const double tokens = std::min(remaining, room_[open]);
      if (tokens > 0) {
        if (Recorded(source_rank_[s], solver_.copy_rank(begin + open))) {
          draft.shares.Append({source_rank_[s], expert, solver_.copy_id(begin + open), tokens});
        }
        remaining -= tokens;
        room_[open] -= tokens;
      }
      if (room_[open] <= 0) ++open;
    }
    // Rounding dust goes to the copy last used.
    const int last = begin + std::min(open, count - 1);
    if (remaining > 0 && Recorded(source_rank_[s], solver_.copy_rank(last))) {
      draft.shares.Append({source_rank_[s], expert, solver_.copy_id(last), remaining});
    }
  }
}

}  // namespace keel
