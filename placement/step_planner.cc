// Keel's per-step planner: the exact quota split (quota_solver.h), the locality-first assignment
// of source ranks to the copies it fills (within a node levelled, so that the traffic between
// nodes spreads evenly: step_planner_spread.cc), and greedy transient replicas kept only while
// the cost model says the layer gets faster. This file scans the traffic, searches the
// transients and hands the routing over; StepPlanner keeps its buffers between steps, and
// PlanStepQuotas runs a fresh one.
#include "placement/step_planner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/simd.h"
#include "placement/cost_model.h"
#include "placement/quota_solver.h"
#include "placement/routing.h"
#include "placement/step_planner_impl.h"
#include "placement/traffic_scan.h"

namespace keel {
namespace {

// sum[i] = ((sum[i] + rows[list[0]][i]) + rows[list[1]][i]) + ... for i < n, where row k starts at
// rows + k * stride: per entry the additions of one loop over the list after another, so the
// same bits. Each run of 32 entries keeps its sums in eight vector registers (named: an array
// indexed in a loop would live in memory) while it goes through the list.
KEEL_AVX2_CLONES void AddListedRows(double* sum, const double* rows, size_t stride, const int* list,
                                    int count, int n) {
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    DoubleQuad a0, a1, a2, a3, a4, a5, a6, a7;
    std::memcpy(&a0, sum + i, sizeof a0);
    std::memcpy(&a1, sum + i + 4, sizeof a1);
    std::memcpy(&a2, sum + i + 8, sizeof a2);
    std::memcpy(&a3, sum + i + 12, sizeof a3);
    std::memcpy(&a4, sum + i + 16, sizeof a4);
    std::memcpy(&a5, sum + i + 20, sizeof a5);
    std::memcpy(&a6, sum + i + 24, sizeof a6);
    std::memcpy(&a7, sum + i + 28, sizeof a7);
    for (int k = 0; k < count; ++k) {
      const double* row = rows + list[k] * stride + i;
      DoubleQuad b0, b1, b2, b3, b4, b5, b6, b7;
      std::memcpy(&b0, row, sizeof b0);
      std::memcpy(&b1, row + 4, sizeof b1);
      std::memcpy(&b2, row + 8, sizeof b2);
      std::memcpy(&b3, row + 12, sizeof b3);
      std::memcpy(&b4, row + 16, sizeof b4);
      std::memcpy(&b5, row + 20, sizeof b5);
      std::memcpy(&b6, row + 24, sizeof b6);
      std::memcpy(&b7, row + 28, sizeof b7);
      a0 += b0;
      a1 += b1;
      a2 += b2;
      a3 += b3;
      a4 += b4;
      a5 += b5;
      a6 += b6;
      a7 += b7;
    }
    std::memcpy(sum + i, &a0, sizeof a0);
    std::memcpy(sum + i + 4, &a1, sizeof a1);
    std::memcpy(sum + i + 8, &a2, sizeof a2);
    std::memcpy(sum + i + 12, &a3, sizeof a3);
    std::memcpy(sum + i + 16, &a4, sizeof a4);
    std::memcpy(sum + i + 20, &a5, sizeof a5);
    std::memcpy(sum + i + 24, &a6, sizeof a6);
    std::memcpy(sum + i + 28, &a7, sizeof a7);
  }
  for (; i + 4 <= n; i += 4) {
    DoubleQuad acc;
    std::memcpy(&acc, sum + i, sizeof acc);
    for (int k = 0; k < count; ++k) {
      DoubleQuad add;
      std::memcpy(&add, rows + list[k] * stride + i, sizeof add);
      acc += add;
    }
    std::memcpy(sum + i, &acc, sizeof acc);
  }
  for (; i < n; ++i) {
    double acc = sum[i];
    for (int k = 0; k < count; ++k) acc += rows[list[k] * stride + i];
    sum[i] = acc;
  }
}

// totals[k] = ((0.0 + row_k[0]) + row_k[1]) + ... for the `count` rows of length n that start at
// `rows`, `stride` apart. Eight rows at a time: one row's sum is a chain of dependent additions,
// and eight chains keep the adders busy.
void SumRows(const double* rows, size_t stride, int count, int n, double* totals) {
  int k = 0;
  // Named sums: in an array, GCC keeps them in memory and every addition waits on a store.
  for (; k + 8 <= count; k += 8) {
    const double* r0 = rows + static_cast<size_t>(k) * stride;
    const double *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride, *r4 = r3 + stride,
                 *r5 = r4 + stride, *r6 = r5 + stride, *r7 = r6 + stride;
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    for (int i = 0; i < n; ++i) {
      s0 += r0[i];
      s1 += r1[i];
      s2 += r2[i];
      s3 += r3[i];
      s4 += r4[i];
      s5 += r5[i];
      s6 += r6[i];
      s7 += r7[i];
    }
    totals[k] = s0;
    totals[k + 1] = s1;
    totals[k + 2] = s2;
    totals[k + 3] = s3;
    totals[k + 4] = s4;
    totals[k + 5] = s5;
    totals[k + 6] = s6;
    totals[k + 7] = s7;
  }
  for (; k < count; ++k) {
    const double* row = rows + static_cast<size_t>(k) * stride;
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += row[i];
    totals[k] = sum;
  }
}

// out[c * rows + r] = in[r * cols + c], in 8 x 8 tiles, so that the reads and the writes of a
// tile each stay within eight cache lines. Tiles of four rows and four columns go through four
// vector registers.
KEEL_AVX2_CLONES void Transpose(const double* in, int rows, int cols, double* out) {
  constexpr int kTile = 8;
  if (rows % 4 == 0 && cols % 4 == 0) {
    for (int r0 = 0; r0 < rows; r0 += kTile) {
      const int r1 = std::min(rows, r0 + kTile);
      for (int c0 = 0; c0 < cols; c0 += kTile) {
        const int c1 = std::min(cols, c0 + kTile);
        for (int r = r0; r < r1; r += 4) {
          for (int c = c0; c < c1; c += 4) {
            DoubleQuad a, b, x, y;
            const double* from = in + static_cast<size_t>(r) * cols + c;
            std::memcpy(&a, from, sizeof a);
            std::memcpy(&b, from + cols, sizeof b);
            std::memcpy(&x, from + 2 * static_cast<size_t>(cols), sizeof x);
            std::memcpy(&y, from + 3 * static_cast<size_t>(cols), sizeof y);
            const DoubleQuad ab_even = __builtin_shufflevector(a, b, 0, 4, 2, 6);
            const DoubleQuad ab_odd = __builtin_shufflevector(a, b, 1, 5, 3, 7);
            const DoubleQuad xy_even = __builtin_shufflevector(x, y, 0, 4, 2, 6);
            const DoubleQuad xy_odd = __builtin_shufflevector(x, y, 1, 5, 3, 7);
            const DoubleQuad column0 = __builtin_shufflevector(ab_even, xy_even, 0, 1, 4, 5);
            const DoubleQuad column1 = __builtin_shufflevector(ab_odd, xy_odd, 0, 1, 4, 5);
            const DoubleQuad column2 = __builtin_shufflevector(ab_even, xy_even, 2, 3, 6, 7);
            const DoubleQuad column3 = __builtin_shufflevector(ab_odd, xy_odd, 2, 3, 6, 7);
            double* to = out + static_cast<size_t>(c) * rows + r;
            std::memcpy(to, &column0, sizeof column0);
            std::memcpy(to + rows, &column1, sizeof column1);
            std::memcpy(to + 2 * static_cast<size_t>(rows), &column2, sizeof column2);
            std::memcpy(to + 3 * static_cast<size_t>(rows), &column3, sizeof column3);
          }
        }
      }
    }
    return;
  }
  for (int r0 = 0; r0 < rows; r0 += kTile) {
    const int r1 = std::min(rows, r0 + kTile);
    for (int c0 = 0; c0 < cols; c0 += kTile) {
      const int c1 = std::min(cols, c0 + kTile);
      for (int c = c0; c < c1; ++c) {
        for (int r = r0; r < r1; ++r) {
          out[static_cast<size_t>(c) * rows + r] = in[static_cast<size_t>(r) * cols + c];
        }
      }
    }
  }
}

// The all-to-all's peaks (AllToAllPeaks's bytes) from the link sums `links`, the ranks' loads
// `rank_tokens` and what each source sends in all, `sent`: every product with bytes_per_row is
// exact (the caller's condition), so the largest sum times bytes_per_row is the largest product.
//
// Rank r receives from_node[r] - kept[r] over its node's links and rank_tokens[r] - from_node[r]
// from other nodes (ReceivePeaks in step_planner_patch.cc); it sends to_node[r] - kept[r] and
// sent[r] - to_node[r].
LinkPeaks PeaksOf(const double* links, const double* rank_tokens, const double* sent, int num_ranks,
                  double bytes_per_row) {
  const double* from_node = links + static_cast<size_t>(kFromNode) * num_ranks;
  const double* to_node = links + static_cast<size_t>(kToNode) * num_ranks;
  const double* kept = links + static_cast<size_t>(kKept) * num_ranks;
  double intra = 0;
  double inter = 0;
  for (int r = 0; r < num_ranks; ++r) {
    intra = std::max({intra, from_node[r] - kept[r], to_node[r] - kept[r]});
    inter = std::max({inter, rank_tokens[r] - from_node[r], sent[r] - to_node[r]});
  }
  return {intra * bytes_per_row, inter * bytes_per_row};
}

// AddSingleLinkSums, sign 1, for each of `singles` (by rank), the traffic by expert `by_expert`
// [num_experts * num_ranks] holding their columns. The sums are exact (the fast path), so they
// may go in any order: a node's sums into its ranks' to_node stay in vector registers while its
// experts go by (one quad or two, for a node of four or eight ranks that starts at a multiple of
// four), and a rank's from_node and kept sums while its experts do. Written to memory after each
// expert, the same sums would wait on the store before.
KEEL_AVX2_CLONES void AddAllSingleLinkSums(const double* by_expert, const SingleExpert* singles,
                                           int count, int num_ranks, double* links) {
  double* from_node = links + static_cast<size_t>(kFromNode) * num_ranks;
  double* to_node = links + static_cast<size_t>(kToNode) * num_ranks;
  double* kept = links + static_cast<size_t>(kKept) * num_ranks;
  auto column_of = [&](int i) {
    return by_expert + static_cast<size_t>(singles[i].expert) * num_ranks;
  };
  for (int i = 0; i < count;) {
    const int first = singles[i].first;
    const int last = singles[i].last;
    int node_end = i;
    while (node_end < count && singles[node_end].first == first) ++node_end;
    const int quads =
        first % 4 == 0 && (last - first == 4 || last - first == 8) ? (last - first) / 4 : 0;
    if (quads == 0) {
      for (; i < node_end; ++i) {
        const double* column = column_of(i);
        double sum = 0;
        for (int s = first; s < last; ++s) {
          sum += column[s];
          to_node[s] += column[s];
        }
        from_node[singles[i].rank] += sum;
        kept[singles[i].rank] += column[singles[i].rank];
      }
      continue;
    }
    DoubleQuad node0, node1 = {};
    std::memcpy(&node0, to_node + first, sizeof node0);
    if (quads == 2) std::memcpy(&node1, to_node + first + 4, sizeof node1);
    while (i < node_end) {
      const int rank = singles[i].rank;
      DoubleQuad received = {};
      double kept_sum = 0;
      for (; i < node_end && singles[i].rank == rank; ++i) {
        const double* column = column_of(i);
        DoubleQuad tokens0, tokens1 = {};
        std::memcpy(&tokens0, column + first, sizeof tokens0);
        if (quads == 2) std::memcpy(&tokens1, column + first + 4, sizeof tokens1);
        node0 += tokens0;
        node1 += tokens1;
        received += tokens0 + tokens1;
        kept_sum += column[rank];
      }
      from_node[rank] += (received[0] + received[1]) + (received[2] + received[3]);
      kept[rank] += kept_sum;
    }
    std::memcpy(to_node + first, &node0, sizeof node0);
    if (quads == 2) std::memcpy(to_node + first + 4, &node1, sizeof node1);
  }
}

// Checks run in this order: the load's shape, then its entries (during Scan, and TrafficValues or
// ByExpertValues to name a bad one), then the rest.
Status ValidateLoadShape(const Placement& placement, const StepLoad& load) {
  if (load.num_experts != placement.num_experts()) {
    return InvalidArgument("load.num_experts " + std::to_string(load.num_experts) +
                           " does not match placement.num_experts " +
                           std::to_string(placement.num_experts()));
  }
  if (load.num_sources < 1) {
    return InvalidArgument("load.num_sources must be >= 1, got " +
                           std::to_string(load.num_sources));
  }
  if (load.traffic.size() != static_cast<size_t>(load.num_sources) * load.num_experts) {
    return InvalidArgument("load.traffic has " + std::to_string(load.traffic.size()) +
                           " entries, expected " + std::to_string(load.num_sources) + " x " +
                           std::to_string(load.num_experts));
  }
  return Status::Ok();
}

// Names the first entry that is not a token count; `name(i)` names entry i.
template <typename Name>
Status EntryValues(std::span<const double> values, Name name) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] < 0) {
      return InvalidArgument(name(i) + " = " + std::to_string(values[i]) +
                             " is not a non-negative token count");
    }
    if (values[i] > kMaxTokenCount) {
      return InvalidArgument(name(i) + " = " + std::to_string(values[i]) + " exceeds 1e15 tokens");
    }
  }
  return Status::Ok();
}

Status TrafficValues(const StepLoad& load) {
  return EntryValues(load.traffic,
                     [](size_t i) { return "load.traffic[" + std::to_string(i) + "]"; });
}

// Entry i of traffic by expert named `name` (by_expert or counts), with its expert and source.
std::string ByExpertEntry(const char* name, size_t i, int num_sources) {
  const size_t sources = static_cast<size_t>(num_sources);
  return std::string(name) + "[" + std::to_string(i) + "] (expert " + std::to_string(i / sources) +
         ", source " + std::to_string(i % sources) + ")";
}

Status ByExpertValues(std::span<const double> by_expert, int num_sources) {
  return EntryValues(by_expert,
                     [&](size_t i) { return ByExpertEntry("by_expert", i, num_sources); });
}

Status ValidateTopologyAndOptions(const Placement& placement, const Topology& topology,
                                  const CostModel& cost, const QuotaPlanOptions& options) {
  if (topology.num_ranks() != placement.num_ranks()) {
    return InvalidArgument("topology has " + std::to_string(topology.num_ranks()) +
                           " ranks, placement.num_ranks is " +
                           std::to_string(placement.num_ranks()));
  }
  if (cost.topology().num_ranks() != placement.num_ranks()) {
    return InvalidArgument(
        "cost model topology has " + std::to_string(cost.topology().num_ranks()) +
        " ranks, placement.num_ranks is " + std::to_string(placement.num_ranks()));
  }
  if (options.transient_per_rank < 0) {
    return InvalidArgument("transient_per_rank must be >= 0, got " +
                           std::to_string(options.transient_per_rank));
  }
  if (options.shares_of_rank < -1 || options.shares_of_rank >= placement.num_ranks()) {
    return InvalidArgument("shares_of_rank must be -1 or a rank below " +
                           std::to_string(placement.num_ranks()) + ", got " +
                           std::to_string(options.shares_of_rank));
  }
  const std::span<const TransientReplica> fixed = options.fixed_transients;
  for (size_t i = 0; i < fixed.size(); ++i) {
    const TransientReplica& t = fixed[i];
    const std::string name = "fixed_transients[" + std::to_string(i) + "]";
    if (t.expert < 0 || t.expert >= placement.num_experts()) {
      return InvalidArgument(name + ".expert = " + std::to_string(t.expert) + " is not in [0, " +
                             std::to_string(placement.num_experts()) + ")");
    }
    for (const int rank : {t.rank, t.source_rank}) {
      if (rank < 0 || rank >= placement.num_ranks()) {
        return InvalidArgument(name + " names rank " + std::to_string(rank) + ", not in [0, " +
                               std::to_string(placement.num_ranks()) + ")");
      }
    }
    const std::span<const int> holders = placement.copy_ranks(t.expert);
    const bool held = std::find(holders.begin(), holders.end(), t.rank) != holders.end() ||
                      std::any_of(fixed.begin(), fixed.begin() + i, [&](const TransientReplica& o) {
                        return o.expert == t.expert && o.rank == t.rank;
                      });
    if (held) {
      return InvalidArgument(name + ": rank " + std::to_string(t.rank) +
                             " already holds a copy of expert " + std::to_string(t.expert));
    }
  }
  return Status::Ok();
}

}  // namespace

bool NextTransient(const Placement& placement, const Topology& topology, QuotaSolver& solver,
                   std::span<const long long> tokens, std::span<const int> transients_on_rank,
                   std::span<const int> room, std::vector<char>& holds, TransientReplica& next) {
  const auto rank_load = solver.rank_load();
  const int num_ranks = placement.num_ranks();
  // The least-loaded rank (ties: the lowest) with a free transient slot that `skip` leaves, or -1.
  auto least_loaded = [&](auto skip) {
    int best = -1;
    for (int g = 0; g < num_ranks; ++g) {
      if (transients_on_rank[g] >= room[g] || skip(g)) continue;
      if (best < 0 || rank_load[g] < rank_load[best]) best = g;
    }
    return best;
  };
  // The target of every expert that holds no copy there.
  const int coolest = least_loaded([](int) { return false; });
  if (coolest < 0) return false;
  bool found = false;
  long long best_tokens = 0;
  long long best_copies = 1;
  for (int e : solver.bottleneck_experts()) {
    const long long copies = solver.copy_end(e) - solver.copy_begin(e);
    // tokens[e] / copies > best_tokens / best_copies, in integers.
    if (found && tokens[e] * best_copies <= best_tokens * copies) continue;
    // The solver's copies are the placement's plus the transients so far.
    bool holds_coolest = false;
    for (int c = solver.copy_begin(e); c < solver.copy_end(e); ++c) {
      holds_coolest |= solver.copy_rank(c) == coolest;
    }
    int target = coolest;
    if (holds_coolest) {
      holds.assign(num_ranks, 0);
      for (int c = solver.copy_begin(e); c < solver.copy_end(e); ++c) {
        holds[solver.copy_rank(c)] = 1;
      }
      target = least_loaded([&](int g) { return holds[g] != 0; });
      if (target < 0) continue;
    }
    int source = placement.home(e);
    for (int slot : placement.copies(e)) {
      const int holder = placement.rank_of_slot(slot);
      if (topology.same_node(holder, target)) {
        source = holder;
        break;
      }
    }
    next = {e, target, source};
    best_tokens = tokens[e];
    best_copies = copies;
    found = true;
  }
  return found;
}

void StepPlanner::Impl::Bind(const Placement& placement, int num_sources) {
  placement_ = &placement;
  if (bound_ && num_sources == num_sources_ && placement.num_experts() == num_experts_ &&
      placement.num_ranks() == num_ranks_ && placement.phy2log() == phy2log_) {
    return;
  }
  bound_ = true;
  phy2log_ = placement.phy2log();
  sync_seconds_ = -1;
  num_experts_ = placement.num_experts();
  num_ranks_ = placement.num_ranks();
  num_slots_ = placement.num_slots();
  num_sources_ = num_sources;
  source_rank_.resize(num_sources);
  for (int s = 0; s < num_sources; ++s) source_rank_[s] = s % num_ranks_;
  source_quads_ = num_sources == num_ranks_ && num_sources % 4 == 0;
  node_of_.resize(num_ranks_);
  for (int r = 0; r < num_ranks_; ++r) node_of_[r] = topology_.node_of(r);

  empty_on_rank_.assign(num_ranks_, 0);
  for (int slot = 0; slot < num_slots_; ++slot) {
    if (placement.expert_at(slot) == kEmptySlot) ++empty_on_rank_[placement.rank_of_slot(slot)];
  }
  std::vector<int> single_rank(num_experts_);  // the one rank holding the expert, else -1
  rank_single_begin_.assign(num_ranks_ + 1, 0);
  for (int e = 0; e < num_experts_; ++e) {
    const std::span<const int> ranks = placement.copy_ranks(e);
    const bool single = !ranks.empty() && std::all_of(ranks.begin(), ranks.end(),
                                                      [&](int r) { return r == ranks[0]; });
    single_rank[e] = single ? ranks[0] : -1;
    if (single) ++rank_single_begin_[ranks[0] + 1];
  }
  for (int r = 0; r < num_ranks_; ++r) rank_single_begin_[r + 1] += rank_single_begin_[r];
  rank_single_.resize(rank_single_begin_[num_ranks_]);
  std::vector<int> fill(rank_single_begin_.begin(), rank_single_begin_.end() - 1);
  for (int e = 0; e < num_experts_; ++e) {
    if (single_rank[e] >= 0) rank_single_[fill[single_rank[e]]++] = e;
  }
  singles_.clear();
  const int per_node = topology_.gpus_per_node();
  experts_.resize(num_experts_);
  for (int e = 0; e < num_experts_; ++e) {
    const int rank = single_rank[e];
    const int first = rank >= 0 ? node_of_[rank] * per_node : 0;
    experts_[e] = {e, rank, first, rank >= 0 ? std::min(first + per_node, num_ranks_) : 0};
  }
  for (int rank = 0; rank < num_ranks_; ++rank) {
    const int first = node_of_[rank] * per_node;
    for (int i = rank_single_begin_[rank]; i < rank_single_begin_[rank + 1]; ++i) {
      singles_.push_back({rank_single_[i], rank, first, std::min(first + per_node, num_ranks_)});
    }
  }
}

template <typename Keep>
void StepPlanner::Impl::AddSingles(int rank, double* row, Keep keep) {
  const size_t num_sources = static_cast<size_t>(num_sources_);
  const int begin = rank_single_begin_[rank];
  const int end = rank_single_begin_[rank + 1];
  if (num_sources_ == num_ranks_) {
    // One source per rank: each entry of the row adds its experts in ascending order.
    kept_.clear();
    for (int i = begin; i < end; ++i) {
      if (keep(rank_single_[i])) kept_.push_back(rank_single_[i]);
    }
    AddListedRows(row, by_expert_, num_sources, kept_.data(), static_cast<int>(kept_.size()),
                  num_sources_);
    return;
  }
  for (int s = 0; s < num_sources_; ++s) {
    double& cell = row[source_rank_[s]];
    for (int i = begin; i < end; ++i) {
      const int e = rank_single_[i];
      if (keep(e)) cell += by_expert_[e * num_sources + s];
    }
  }
}

bool StepPlanner::Impl::Scan() {
  const int num_experts = num_experts_;
  const int num_ranks = num_ranks_;
  totals_.resize(num_experts);
  const bool one_pass = source_quads_;
  EntryBits scanned;
  if (one_pass) {
    sent_.resize(num_ranks);
    lanes_.resize(4 * static_cast<size_t>(num_experts));
    scanned = ScanByExpert(by_expert_, num_experts, num_sources_, sent_.data(), lanes_.data(),
                           totals_.data());
  } else {
    scanned = ScanEntries(by_expert_, static_cast<size_t>(num_experts) * num_sources_);
  }
  // Any negative entry (or -0.0, or a NaN with its sign bit) sets the sign bit of the OR; then a
  // second look tells -0.0, a zero count, from a negative entry. A NaN, an infinity or an entry
  // beyond kMaxTokenCount makes its expert's total NaN or beyond kMaxTokenCount, as all other
  // entries are then non-negative. Either sends the caller to the exact check.
  const size_t num_entries = static_cast<size_t>(num_experts) * num_sources_;
  const bool non_negative =
      (scanned.bits >> 63) == 0 ||
      std::none_of(by_expert_, by_expert_ + num_entries, [](double v) { return v < 0; });
  auto sum_totals = [&] {
    double total = 0;
    for (int e = 0; e < num_experts; ++e) total += totals_[e];
    return total;
  };
  double total = one_pass ? sum_totals() : 0.0;
  // Whole numbers whose sum stays below 2^52: every sum of them is exact, whatever its order.
  whole_ = one_pass && non_negative && !scanned.fractional && total < 4503599627370496.0;
  if (!whole_) {
    // Totals in source order, as the fractional digits of a sum depend on its order.
    SumRows(by_expert_, num_sources_, num_experts, num_sources_, totals_.data());
    total = sum_totals();
    whole_ = non_negative && !scanned.fractional && total < 4503599627370496.0;
  }
  // Rounding is monotone and 2^53 is a double, so a rounded product below 2^53 is exact.
  fast_ = one_pass && whole_ && total * cost_.token_row_bytes() < 9007199254740992.0;
  if (fast_) {
    single_links_.assign(static_cast<size_t>(kLinkSums) * num_ranks, 0.0);
    AddAllSingleLinkSums(by_expert_, singles_.data(), static_cast<int>(singles_.size()), num_ranks,
                         single_links_.data());
  } else {
    scanned_.assign(static_cast<size_t>(num_ranks) * num_ranks, 0.0);
    for (int rank = 0; rank < num_ranks; ++rank) {
      AddSingles(rank, scanned_.data() + static_cast<size_t>(rank) * num_ranks,
                 [](int) { return true; });
    }
  }
  if (whole_) {
    const bool totals_in_range = RoundWholeTotals();
    return non_negative && totals_in_range;
  }
  bool in_range = non_negative;
  rounded_.resize(num_experts);
  scale_.resize(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    in_range &= totals_[e] <= kMaxTokenCount;
    rounded_[e] = std::isfinite(totals_[e]) ? std::llround(totals_[e]) : 0;
    scale_[e] = rounded_[e] > 0 ? totals_[e] / static_cast<double>(rounded_[e]) : 0.0;
  }
  return in_range;
}

const double* StepPlanner::Impl::Column(int expert) {
  const size_t at = static_cast<size_t>(expert) * num_sources_;
  if (by_expert_ != nullptr) return by_expert_ + at;
  column_.resize(num_sources_);
  CountsToDoubles(counts_ + at, num_sources_, column_.data());  // a multiple of 8 (ScanCounts)
  return column_.data();
}

bool StepPlanner::Impl::ScanCounts(const QuotaPlanOptions& options) {
  // The fast path's layout (one source per rank, eight at a time), without the all-to-all
  // matrix, whose rows would need the traffic as doubles.
  if (!source_quads_ || num_sources_ % 8 != 0 || options.sent_tokens) return false;
  const int num_experts = num_experts_;
  const int num_ranks = num_ranks_;
  totals_.resize(num_experts);
  sent_.resize(num_ranks);
  rounded_.resize(num_experts);
  int_lanes_.resize(ScanCountsScratch(num_experts, num_sources_));
  single_links_.assign(static_cast<size_t>(kLinkSums) * num_ranks, 0.0);
  double* links = single_links_.data();
  const CountSums sums{.totals = totals_.data(),
                       .sent = sent_.data(),
                       .to_node = links + static_cast<size_t>(kToNode) * num_ranks,
                       .from_node = links + static_cast<size_t>(kFromNode) * num_ranks,
                       .kept = links + static_cast<size_t>(kKept) * num_ranks,
                       .whole_totals = rounded_.data()};
  const std::uint32_t bits = keel::ScanCounts(counts_, num_experts, num_sources_, experts_.data(),
                                              int_lanes_.data(), sums);
  if (!CountSumsExact(bits, static_cast<size_t>(num_experts) * num_sources_)) return false;
  // The counts add up to less than 2^31, so every sum of them is exact; the link sums price the
  // routing when their products with the bytes per token row are too (see Scan).
  constexpr double kTotalBound = 2147483648.0;
  if (!(kTotalBound * cost_.token_row_bytes() < 9007199254740992.0)) {
    double total = 0;
    for (int s = 0; s < num_sources_; ++s) total += sent_[s];
    if (!(total * cost_.token_row_bytes() < 9007199254740992.0)) return false;
  }
  whole_ = true;
  fast_ = true;
  return true;  // the totals are below 2^31, so within kMaxTokenCount
}

bool StepPlanner::Impl::RoundWholeTotals() {
  const int num_experts = num_experts_;
  rounded_.resize(num_experts);
  bool in_range = true;
  // Whole totals below 2^52: the cast is the rounding.
  for (int e = 0; e < num_experts; ++e) {
    in_range &= totals_[e] <= kMaxTokenCount;
    rounded_[e] = static_cast<long long>(totals_[e]);
  }
  return in_range;
}

void StepPlanner::Impl::ResetReceived(Draft& draft) {
  const size_t num_ranks = static_cast<size_t>(num_ranks_);
  const size_t cells = keep_rows_ ? num_ranks * num_ranks : 0;
  // The base: what single-rank experts send (Scan) off the fast path, nothing on it.
  if (draft.received_stale || draft.received.size() != cells) {
    if (fast_) {
      draft.received.assign(cells, 0.0);
    } else {
      draft.received.assign(scanned_.begin(), scanned_.end());
    }
    draft.received_stale = false;
  } else {
    double* received = draft.received.data();
    for (const std::uint32_t cell : draft.written) received[cell] = fast_ ? 0.0 : scanned_[cell];
  }
  draft.written.clear();
}

void StepPlanner::Impl::Assign(size_t num_extras, const QuotaSplit& split, Draft& draft) {
  const int num_ranks = num_ranks_;
  draft.rank_tokens.assign(num_ranks, 0.0);
  draft.slot_tokens.assign(num_slots_, 0.0);
  draft.transient_tokens.assign(num_extras, 0.0);
  draft.shares.clear();
  remaining_.resize(num_sources_);
  ResetReceived(draft);
  if (fast_) {
    // Scan has the link sums of every single-rank expert. One that has a transient now is spread
    // over two ranks: its sums come out here, exactly (the fast path's sums are exact in any
    // order), and AddExpert below adds its spread routing.
    draft.links.assign(single_links_.begin(), single_links_.end());
    gained_.assign(num_experts_, 0);
    for (size_t i = 0; i < num_extras; ++i) {
      const int e = transients_[i].expert;
      if (experts_[e].rank < 0 || gained_[e]) continue;
      gained_[e] = 1;
      AddSingleLinks(e, experts_[e].rank, -1.0, draft.links.data());
    }
  }

  // Off the fast path, Scan sent every single-rank expert's tokens to its rank. Redo the rows of
  // ranks that lost one to a transient, in Scan's order, so the sums are what a fresh pass would
  // give.
  for (int rank = 0; rank < num_ranks && !fast_; ++rank) {
    bool changed = false;
    for (int i = rank_single_begin_[rank]; i < rank_single_begin_[rank + 1]; ++i) {
      changed |= RankCount(rank_single_[i]) != 1;
    }
    if (!changed) continue;
    const size_t first = static_cast<size_t>(rank) * num_ranks;
    double* row = draft.received.data() + first;
    std::fill(row, row + num_ranks, 0.0);
    for (int s = 0; s < num_ranks; ++s) draft.Wrote(first + s);
    AddSingles(rank, row, [&](int e) { return RankCount(e) == 1; });
  }
  if (!whole_) {
    for (int e = 0; e < num_experts_; ++e) {
      if (totals_[e] != 0) AddExpert(e, split, 1.0, /*single_row=*/false, draft);
    }
    return;
  }
  // Exact sums: an expert with one copy puts its whole total on it, as AddExpert would (its quota
  // is its rounded total, which is the total), and the rank sums may take it in any order. Its
  // shares are ShareInSourceOrder's, as in AddExpert.
  double* rank_tokens = draft.rank_tokens.data();
  double* slot_tokens = draft.slot_tokens.data();
  // With one source per rank and one rank's shares, a copy elsewhere gets that rank's tokens
  // alone: ShareInSourceOrder's one share, without the call.
  const int mine = num_sources_ == num_ranks ? shares_of_rank_ : -1;
  for (int e = 0; e < num_experts_; ++e) {
    const double total = totals_[e];
    if (total == 0) continue;
    const int begin = solver_.copy_begin(e);
    if (CopyEnd(e) - begin != 1) {
      AddExpert(e, split, 1.0, /*single_row=*/false, draft);
      continue;
    }
    const int id = solver_.copy_id(begin);
    const int rank = solver_.copy_rank(begin);
    rank_tokens[rank] += total;
    (id < num_slots_ ? slot_tokens[id] : draft.transient_tokens[id - num_slots_]) += total;
    if (!record_shares_) continue;
    if (mine < 0 || rank == mine) {
      ShareInSourceOrder(e, draft);
      continue;
    }
    const double tokens = Entry(e, mine);
    if (tokens > 0) {
      draft.shares.Reserve(1);
      draft.shares.Append({mine, e, id, tokens});
    }
  }
}

bool StepPlanner::Impl::KeepCandidate(const TransientReplica& candidate, double& best_seconds) {
  // On the fast path the candidate patches best_ in place (undone if it does not pay),
  // otherwise it gets a routing of its own.
  double seconds;
  if (fast_) {
    ListPatched(candidate.expert);
    if (FloorSeconds() >= best_seconds) return false;  // it cannot pay: no patch to make
    PatchBest(candidate.expert);
    seconds = Seconds(best_, transients_);
    if (!(seconds < best_seconds)) {
      RestoreBest(candidate.expert);
      return false;
    }
    KeepPatchedShares();
  } else {
    Assign(transients_.size(), trial_split_, trial_);
    seconds = Seconds(trial_, transients_);
    if (!(seconds < best_seconds)) return false;
    std::swap(best_, trial_);
  }
  ++transients_on_rank_[candidate.rank];
  best_seconds = seconds;
  std::swap(split_, trial_split_);
  return true;
}

bool StepPlanner::Impl::TakeRun(const Placement& placement, std::span<const long long> tokens,
                                const TransientReplica& first, double& best_seconds) {
  ++transients_on_rank_[first.rank];
  TransientReplica next;
  while (NextTransient(placement, topology_, solver_, tokens, transients_on_rank_, transient_room_,
                       holds_, next)) {
    transients_.push_back(next);
    ++transients_on_rank_[next.rank];
    solver_.AddCopy(placement, transients_, run_split_);
    if (run_split_.max_rank_tokens >= split_.max_rank_tokens) continue;
    // The copies together change the routing: a routing of their own, priced as a whole.
    Assign(transients_.size(), run_split_, trial_);
    const double seconds = Seconds(trial_, transients_);
    if (!(seconds < best_seconds)) continue;
    std::swap(best_, trial_);
    std::swap(split_, run_split_);
    best_seconds = seconds;
    return true;
  }
  return false;
}

double StepPlanner::Impl::Seconds(const Draft& draft,
                                  std::span<const TransientReplica> transients) const {
  const double max_rank_tokens =
      *std::max_element(draft.rank_tokens.begin(), draft.rank_tokens.end());
  if (fast_) {
    const LinkPeaks peaks = PeaksOf(draft.links.data(), draft.rank_tokens.data(), sent_.data(),
                                    num_ranks_, cost_.token_row_bytes());
    return cost_.EstimateFromPeaks(*placement_, max_rank_tokens, peaks, transients, sync_seconds_)
        .total_seconds();
  }
  return cost_
      .EstimateParts(*placement_, max_rank_tokens, draft.received, transients, sync_seconds_)
      .total_seconds();
}

void StepPlanner::Impl::Publish(Draft& draft, const std::vector<TransientReplica>& transients,
                                bool sent_tokens, StepRouting& routing) {
  const int num_ranks = num_ranks_;
  routing.num_ranks = num_ranks;
  routing.rank_tokens.swap(draft.rank_tokens);
  if (sent_tokens && fast_) {
    // The rows hold the experts spread over several ranks: add those that stayed on one.
    gained_.assign(num_experts_, 0);
    for (const TransientReplica& t : transients) gained_[t.expert] = 1;
    for (int rank = 0; rank < num_ranks; ++rank) {
      AddSingles(rank, draft.received.data() + static_cast<size_t>(rank) * num_ranks,
                 [&](int e) { return !gained_[e]; });
    }
  }
  routing.sent_tokens.resize(sent_tokens ? static_cast<size_t>(num_ranks) * num_ranks : 0);
  if (sent_tokens) {
    Transpose(draft.received.data(), num_ranks, num_ranks, routing.sent_tokens.data());
  }
  routing.slot_tokens.swap(draft.slot_tokens);
  routing.transients.assign(transients.begin(), transients.end());
  routing.transient_tokens.swap(draft.transient_tokens);
  draft.shares.MoveTo(routing.shares);
}

Status StepPlanner::Impl::Plan(const Placement& placement, int num_sources,
                               std::span<const double> by_expert, const QuotaPlanOptions& options,
                               StepRouting& routing, const StepLoad* load) {
  Bind(placement, num_sources);
  by_expert_ = by_expert.data();
  counts_ = nullptr;
  if (!Scan()) {
    KEEL_RETURN_IF_ERROR(load != nullptr ? TrafficValues(*load)
                                         : ByExpertValues(by_expert, num_sources));
    // Every entry is a valid count, so an expert's total is out of range.
    for (size_t e = 0; e < totals_.size(); ++e) {
      if (totals_[e] > kMaxTokenCount) {
        return InvalidArgument("expert " + std::to_string(e) + " receives " +
                               std::to_string(totals_[e]) + " tokens in all, beyond 1e15");
      }
    }
    return Internal("the step planner's scan refused traffic whose entries and totals are valid");
  }
  return Route(placement, options, routing);
}

Status StepPlanner::Impl::PlanCounts(const Placement& placement, int num_sources,
                                     std::span<const std::int32_t> counts,
                                     const QuotaPlanOptions& options, StepRouting& routing) {
  Bind(placement, num_sources);
  by_expert_ = nullptr;
  counts_ = counts.data();
  if (ScanCounts(options)) return Route(placement, options, routing);
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) {
      return InvalidArgument(ByExpertEntry("counts", i, num_sources) + " = " +
                             std::to_string(counts[i]) + " is negative");
    }
  }
  // The same counts as doubles: Plan gives the same routing for them, only slower.
  converted_.assign(counts.begin(), counts.end());
  return Plan(placement, num_sources, converted_, options, routing, nullptr);
}

Status StepPlanner::Impl::Route(const Placement& placement, const QuotaPlanOptions& options,
                                StepRouting& routing) {
  record_shares_ = options.record_shares;
  shares_of_rank_ = options.shares_of_rank;
  keep_rows_ = !fast_ || options.sent_tokens;
  // This step's scan gave a new base for the rows of received tokens: each draft starts from
  // it once, and from then on restores only the rows it wrote (ResetReceived).
  best_.received_stale = true;
  trial_.received_stale = true;
  KEEL_RETURN_IF_ERROR(ValidateTopologyAndOptions(placement, topology_, cost_, options));
  const std::span<const long long> tokens = rounded_;
  const size_t fixed = options.fixed_transients.size();
  transients_.assign(options.fixed_transients.begin(), options.fixed_transients.end());
  solver_.Solve(placement, tokens, transients_, split_);
  excluded_expert_ = -1;
  Assign(fixed, split_, best_);

  // Greedy transients: each must lower the max rank load and the cost model's predicted layer
  // time, alone or as the first of a run of copies that together do (TakeRun); the first
  // candidate that does neither ends the search. The baseline is priced once a candidate gets
  // that far, else at the end. Each candidate re-solves from the previous flow.
  size_t accepted = fixed;
  double best_seconds = -1;
  transient_room_.assign(num_ranks_, options.transient_per_rank);
  if (options.spare_slots) {
    for (int r = 0; r < num_ranks_; ++r) transient_room_[r] += empty_on_rank_[r];
  }
  transients_on_rank_.assign(num_ranks_, 0);
  for (const TransientReplica& t : options.fixed_transients) {
    if (++transients_on_rank_[t.rank] > transient_room_[t.rank]) {
      return InvalidArgument("fixed_transients put " + std::to_string(transients_on_rank_[t.rank]) +
                             " on rank " + std::to_string(t.rank) + ", which has room for " +
                             std::to_string(transient_room_[t.rank]) + " transients");
    }
  }
  if (std::any_of(transient_room_.begin(), transient_room_.end(), [](int n) { return n > 0; })) {
    TransientReplica next;
    while (NextTransient(placement, topology_, solver_, tokens, transients_on_rank_,
                         transient_room_, holds_, next)) {
      transients_.push_back(next);
      solver_.AddCopy(placement, transients_, trial_split_);
      if (best_seconds < 0 && trial_split_.max_rank_tokens <= split_.max_rank_tokens) {
        if (sync_seconds_ < 0) sync_seconds_ = cost_.ReplicaSyncSeconds(placement);
        best_seconds = Seconds(best_, {transients_.data(), accepted});
      }
      if (trial_split_.max_rank_tokens > split_.max_rank_tokens) break;
      // A copy that leaves the max where it is (two ranks tie at the top, say) cannot pay alone.
      const bool kept = trial_split_.max_rank_tokens < split_.max_rank_tokens &&
                        KeepCandidate(next, best_seconds);
      if (!kept && !TakeRun(placement, tokens, next, best_seconds)) break;
      accepted = transients_.size();
    }
  }
  transients_.resize(accepted);
  if (best_seconds < 0) {
    if (sync_seconds_ < 0) sync_seconds_ = cost_.ReplicaSyncSeconds(placement);
    best_seconds = Seconds(best_, transients_);
  }
  routing.predicted_seconds = best_seconds;
  Publish(best_, transients_, options.sent_tokens, routing);
  return Status::Ok();
}

void TrafficByExpert(std::span<const double> traffic, int num_sources, int num_experts,
                     std::vector<double>& by_expert) {
  assert(traffic.size() == static_cast<size_t>(num_sources) * num_experts);
  by_expert.resize(traffic.size());
  Transpose(traffic.data(), num_sources, num_experts, by_expert.data());
}

namespace {

// StepPlanner::Plan's shape checks: `size` entries, named `name`, for `num_sources` sources.
Status CheckByExpertShape(const Placement& placement, int num_sources, size_t size,
                          const char* name) {
  if (num_sources < 1) {
    return InvalidArgument("num_sources must be >= 1, got " + std::to_string(num_sources));
  }
  const size_t expected = static_cast<size_t>(num_sources) * placement.num_experts();
  if (size != expected) {
    return InvalidArgument(std::string(name) + " has " + std::to_string(size) +
                           " entries, expected " + std::to_string(placement.num_experts()) +
                           " experts x " + std::to_string(num_sources) + " sources");
  }
  return Status::Ok();
}

}  // namespace

StepPlanner::StepPlanner(const Topology& topology, const CostModel& cost)
    : impl_(std::make_unique<Impl>(topology, cost)) {}

StepPlanner::~StepPlanner() = default;

Status StepPlanner::Plan(const Placement& placement, int num_sources,
                         std::span<const double> by_expert, const QuotaPlanOptions& options,
                         StepRouting& routing) {
  KEEL_RETURN_IF_ERROR(CheckByExpertShape(placement, num_sources, by_expert.size(), "by_expert"));
  return impl_->Plan(placement, num_sources, by_expert, options, routing, nullptr);
}

Status StepPlanner::Plan(const Placement& placement, int num_sources,
                         std::span<const std::int32_t> counts, const QuotaPlanOptions& options,
                         StepRouting& routing) {
  KEEL_RETURN_IF_ERROR(CheckByExpertShape(placement, num_sources, counts.size(), "counts"));
  return impl_->PlanCounts(placement, num_sources, counts, options, routing);
}

Result<StepRouting> PlanStepQuotas(const Placement& placement, const StepLoad& load,
                                   const Topology& topology, const CostModel& cost,
                                   const QuotaPlanOptions& options) {
  KEEL_RETURN_IF_ERROR(ValidateLoadShape(placement, load));
  const int num_sources = load.num_sources;
  const int num_experts = load.num_experts;
  std::vector<double> by_expert;
  TrafficByExpert(load.traffic, num_sources, num_experts, by_expert);
  StepPlanner::Impl planner(topology, cost);
  StepRouting routing;
  KEEL_RETURN_IF_ERROR(planner.Plan(placement, num_sources, by_expert, options, routing, &load));
  return routing;
}

}  // namespace keel
