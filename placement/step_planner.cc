// Keel's per-step planner: the exact quota split (quota_solver.h), the locality-first assignment
// of source ranks to the copies it fills (within a node levelled, so that the traffic between
// nodes spreads evenly), and greedy transient replicas kept only while the cost model says the
// layer gets faster. StepPlanner keeps its buffers between steps; PlanStepQuotas
// runs a fresh one.
#include "placement/step_planner.h"

#include <algorithm>
#include <cassert>
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

// Link sums of a routing on the fast path (one source per rank, exact sums), three arrays of
// num_ranks: per rank, the tokens it receives from its own node and those it sends to its own
// node (both with what it keeps), and the tokens it keeps. What a rank receives in all is its
// load, and what it sends in all is its sources' traffic, so with these the four link sums of
// the all-to-all follow by subtraction (PeaksOf).
enum LinkSum { kFromNode = 0, kToNode = 1, kKept = 2 };
constexpr int kLinkSums = 3;

// The all-to-all's peaks (AllToAllPeaks's bytes) from the link sums `links`, the ranks' loads
// `rank_tokens` and what each source sends in all, `sent`: every product with bytes_per_row is
// exact (the caller's condition), so the largest sum times bytes_per_row is the largest product.
//
// Rank r receives from_node[r] - kept[r] over its node's links and rank_tokens[r] - from_node[r]
// from other nodes (ReceivePeaks); it sends to_node[r] - kept[r] and sent[r] - to_node[r].
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

// PeaksOf's receive side alone, over the ranks that `skip` does not mark: a floor under the
// peaks of any routing in which those ranks receive what they receive here.
LinkPeaks ReceivePeaks(const double* links, const double* rank_tokens, const char* skip,
                       int num_ranks, double bytes_per_row) {
  const double* from_node = links + static_cast<size_t>(kFromNode) * num_ranks;
  const double* kept = links + static_cast<size_t>(kKept) * num_ranks;
  double intra = 0;
  double inter = 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (skip[r]) continue;
    intra = std::max(intra, from_node[r] - kept[r]);
    inter = std::max(inter, rank_tokens[r] - from_node[r]);
  }
  return {intra * bytes_per_row, inter * bytes_per_row};
}

// Adds `sign` times the link sums of an expert whose copies all sit on `rank` to `links`: its
// sources `column` [num_ranks] send everything there, so rank `rank` receives the tokens of its
// node's sources [first, last), which each send theirs to their node, and keeps its own.
inline void AddSingleLinkSums(const double* column, int rank, int first, int last, int num_ranks,
                              double sign, double* links) {
  double* to_node = links + static_cast<size_t>(kToNode) * num_ranks;
  double from_node = 0;
  int s = first;
  if (first % 4 == 0) {
    DoubleQuad lanes = {};
    for (; s + 4 <= last; s += 4) {
      DoubleQuad tokens, cell;
      std::memcpy(&tokens, column + s, sizeof tokens);
      tokens *= sign;
      lanes += tokens;
      std::memcpy(&cell, to_node + s, sizeof cell);
      cell += tokens;
      std::memcpy(to_node + s, &cell, sizeof cell);
    }
    from_node = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  for (; s < last; ++s) {
    from_node += sign * column[s];
    to_node[s] += sign * column[s];
  }
  links[static_cast<size_t>(kFromNode) * num_ranks + rank] += from_node;
  links[static_cast<size_t>(kKept) * num_ranks + rank] += sign * column[rank];
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

// to[0, n) = counts[0, n) as doubles, n a multiple of 4: four at a time, as GCC's -O2 leaves
// the plain loop scalar.
inline void CountsToDoubles(const std::int32_t* counts, int n, double* to) {
  for (int i = 0; i < n; i += 4) {
    IntQuad quad;
    std::memcpy(&quad, counts + i, sizeof quad);
    const DoubleQuad doubles = __builtin_convertvector(quad, DoubleQuad);
    std::memcpy(to + i, &doubles, sizeof doubles);
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
  return Status::Ok();
}

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

namespace {

// Shares as a draft writes them: room is made once per expert, and an append is then a store (in
// the loops here std::vector::push_back stays a call). The buffer only grows; the entries past
// size() are left over.
class ShareList {
 public:
  size_t size() const { return size_; }
  const CopyShare* begin() const { return buffer_.data(); }
  const CopyShare* end() const { return buffer_.data() + size_; }
  void clear() { size_ = 0; }
  // Room for `count` more appends.
  void Reserve(size_t count) {
    if (buffer_.size() < size_ + count) buffer_.resize(size_ + count);
  }
  void Append(const CopyShare& share) {
    assert(size_ < buffer_.size());
    buffer_[size_++] = share;
  }
  void Append(const CopyShare* first, const CopyShare* last) {
    Reserve(static_cast<size_t>(last - first));
    std::copy(first, last, buffer_.data() + size_);
    size_ += static_cast<size_t>(last - first);
  }
  void swap(ShareList& other) {
    buffer_.swap(other.buffer_);
    std::swap(size_, other.size_);
  }
  // Moves the shares into `out`, whose old buffer this list takes (its entries left over).
  void MoveTo(std::vector<CopyShare>& out) {
    buffer_.resize(size_);
    out.swap(buffer_);
    size_ = 0;
  }

 private:
  std::vector<CopyShare> buffer_;
  size_t size_ = 0;
};

}  // namespace

class StepPlanner::Impl {
 public:
  Impl(const Topology& topology, const CostModel& cost) : topology_(topology), cost_(cost) {}

  // StepPlanner::Plan after the shape checks. `load`: the same traffic by source, to name a bad
  // entry by its index there; null to name it in `by_expert`.
  Status Plan(const Placement& placement, int num_sources, std::span<const double> by_expert,
              const QuotaPlanOptions& options, StepRouting& routing, const StepLoad* load);
  // StepPlanner::Plan for integer counts after the shape checks.
  Status PlanCounts(const Placement& placement, int num_sources,
                    std::span<const std::int32_t> counts, const QuotaPlanOptions& options,
                    StepRouting& routing);

 private:
  // A routing under construction. The tokens that rank s sends to rank d sit at
  // received[d * num_ranks + s], the transpose of StepRouting::sent_tokens: a rank's row then
  // takes a single-rank expert's sources as one contiguous addition. On the fast path `received`
  // holds only the tokens of experts spread over several ranks (Publish adds the rest when the
  // caller wants the matrix), and `links` the link sums that price it.
  struct Draft {
    std::vector<double> rank_tokens;  // [num_ranks]
    std::vector<double> received;     // [num_ranks * num_ranks]
    std::vector<double> slot_tokens;  // [num_slots]
    std::vector<double> transient_tokens;
    ShareList shares;
    std::vector<double> links;  // [kLinkSums * num_ranks], fast path only
  };
  // What PatchBest overwrote in best_.
  struct Undo {
    std::vector<int> rows;         // ranks whose rows of received tokens changed
    std::vector<double> received;  // those rows before, one after another
    std::vector<double> rank_tokens;
    std::vector<double> slot_tokens;
    std::vector<double> transient_tokens;
    std::vector<double> links;
  };

  // What depends on the placement and the number of sources alone; kept while they stay.
  void Bind(const Placement& placement, int num_sources);
  // The pass over the traffic: per-expert totals and, for the experts held by one rank in the
  // placement (every source sends there), their link sums (single_links_) on the fast path,
  // else the rows they fill (scanned_). False when some entry may be negative, not finite or
  // beyond kMaxTokenCount; the caller then names it.
  bool Scan();
  // Scan for integer counts (counts_), on the fast path alone: false when the routing cannot
  // take them there or some count is negative (the caller then names it, or plans the counts as
  // doubles).
  bool ScanCounts(const QuotaPlanOptions& options);
  // rounded_ for whole totals below 2^52 (whole_); false when some total is beyond kMaxTokenCount.
  bool RoundWholeTotals();
  // What follows the scan: the quotas, the transients and the routing.
  Status Route(const Placement& placement, const QuotaPlanOptions& options, StepRouting& routing);
  // Source s's tokens of `expert`, from by_expert_ or counts_.
  double Entry(int expert, int source) const {
    const size_t at = static_cast<size_t>(expert) * num_sources_ + source;
    return by_expert_ != nullptr ? by_expert_[at] : static_cast<double>(counts_[at]);
  }
  // What a quota of `expert` is multiplied by to give tokens: 1 for whole totals, which are their
  // rounded ones (an expert rounded to 0 has no quota above 0).
  double Scale(int expert) const { return whole_ ? 1.0 : scale_[expert]; }
  // `expert`'s sources' tokens: in by_expert_, or counts_ made doubles in column_ (valid until
  // the next call).
  const double* Column(int expert);
  // Adds `sign` times the link sums of `expert`, whose copies all sit on `rank`, to `links`.
  void AddSingleLinks(int expert, int rank, double sign, double* links);
  // Adds the tokens of `rank`'s single-rank experts that `keep` accepts to `row`, that rank's
  // row of received tokens: for each source, experts in ascending order, a rank's sources in
  // ascending order.
  template <typename Keep>
  void AddSingles(int rank, double* row, Keep keep);
  // The copies of `expert` in force: the solver's, less the candidate transient it holds last
  // when that candidate was dropped (excluded_expert_). Its rank never held the expert.
  int CopyEnd(int expert) const {
    return solver_.copy_end(expert) - (expert == excluded_expert_ ? 1 : 0);
  }
  int RankCount(int expert) const {
    return solver_.rank_count(expert) - (expert == excluded_expert_ ? 1 : 0);
  }
  // Fills `draft` for the copies in force, `num_extras` transients beyond the placement, and the
  // quotas in `split`.
  void Assign(size_t num_extras, const QuotaSplit& split, Draft& draft);
  // Adds `sign` (1 or -1) times the routing of `expert`'s tokens under `split` to `draft`; the
  // tokens of an expert on one rank enter its row of received tokens (its link sums on the fast
  // path) only with `single_row` (Assign has them from Scan).
  void AddExpert(int expert, const QuotaSplit& split, double sign, bool single_row, Draft& draft);
  // Tokens of `expert` with copies on several ranks: local copies first (copy order), then each
  // node's copies from that node's sources, levelled (LevelGives) so that what the sources keep
  // and what the copies still need, both of which cross nodes next, are as even as they can be,
  // then the rest in copy order and ascending source order.
  void AssignSpread(int expert, const QuotaSplit& split, double sign, Draft& draft);
  // The copies [begin, begin + count) of the solver with room[i] > 0, as indices i, by node
  // (ties: copy order): the same-node pass of the two Assign functions goes node by node.
  void ByNode(int begin, int count, const double* room, std::vector<int>& by_node) const;
  // The same-node pass's flow for the node of copy copy_nodes_[run] (ByNode's order): that node's
  // copies with room (node_copies_; `run` moves past them), its sources (node_sources_), and what
  // each source gives (gives_) and each copy takes (takes_), both levelled (LevelGives) to the
  // smaller of what the sources have left and what the copies still need.
  void LevelNode(int begin, const double* room, const double* remaining, size_t& run);
  // AssignSpread on the fast path: the same shares, found per copy instead of per source, and
  // the link sums. Every copy gets its whole quota (the quotas add up to the expert's total), so
  // the slot and rank sums take the quotas at once.
  void AssignSpreadWhole(int expert, const QuotaSplit& split, double sign, Draft& draft);
  // AssignSpreadWhole with (kRows) or without the rows of received tokens.
  template <bool kRows>
  void AssignSpreadWholeRows(int expert, const QuotaSplit& split, double sign, Draft& draft);
  // Whether any copy of `expert` has a different quota in trial_split_ than in split_ (split_
  // must be the solver's previous split, as it is when a candidate follows the base or a kept
  // candidate).
  bool QuotasMoved(int expert) const;
  // patched_: the experts with tokens whose routing the candidate transient of `expert` changes,
  // ascending: those whose quotas moved, and `expert`; touched_: the ranks that hold a copy of
  // one of them.
  void ListPatched(int expert);
  // On the fast path, after ListPatched: a floor under the candidate's price. Its max rank load
  // is the solver's (exact there), and a rank that holds no copy of a patched expert receives
  // what it received before, so those ranks' receive sums floor the all-to-all's peaks. Every
  // term of the price grows with its inputs.
  double FloorSeconds() const;
  // On the fast path, after ListPatched: turns best_ into the routing for the candidate
  // transient of `expert` in place, taking out and putting back the routing of each patched
  // expert: the same bits as a fresh Assign. What it overwrites goes to undo_; the patched
  // experts' new shares wait in moved_shares_ until the candidate is kept.
  void PatchBest(int expert);
  // Once the candidate is kept: the new shares of the experts PatchBest patched replace theirs
  // in best_.
  void KeepPatchedShares();
  // Takes best_ back to what it was before PatchBest.
  void RestoreBest();
  // Shares of an expert whose copies sit on one rank: sources in ascending order fill the copies
  // in copy order up to the quotas in room_.
  void ShareInSourceOrder(int expert, Draft& draft);
  // The most shares that the routing of an expert with `count` copies makes: each share empties
  // its source or fills its copy, and each source may send rounding dust once more.
  size_t MaxShares(int count) const { return 2 * static_cast<size_t>(num_sources_) + count; }
  // Whether a share from `source_rank` to a copy on `rank` is recorded (given record_shares_).
  bool Recorded(int source_rank, int rank) const {
    return shares_of_rank_ < 0 || source_rank == shares_of_rank_ || rank == shares_of_rank_;
  }
  // Keeps the candidate transient (the last of transients_, solved into trial_split_) when its
  // routing lowers the predicted time below `best_seconds` (then updated, with best_, split_
  // and the slot taken); else leaves them as they were.
  bool KeepCandidate(const TransientReplica& candidate, double& best_seconds);
  // After a candidate transient `first` (the last of transients_) that does not pay on its own:
  // adds the next candidates one at a time, while slots are free, and keeps them all at the
  // first that, together with the ones before, lowers the max rank load and the predicted time
  // below `best_seconds` (then updated, with best_, split_ and the slots taken). The first fill
  // costs a whole weight transfer while the copies after it fill in parallel on other ranks, so
  // a run of copies can pay where its first does not. Returns whether it kept the run; solver_
  // then holds all of its copies either way, as after any candidate that ends the search.
  bool TakeRun(const Placement& placement, std::span<const long long> tokens,
               const TransientReplica& first, double& best_seconds);
  // The cost model's layer time for `draft` with `transients`; from its link sums on the fast
  // path.
  double Seconds(const Draft& draft, std::span<const TransientReplica> transients) const;
  // Moves `draft` into `routing`, whose old buffers `draft` takes for the next step; the
  // all-to-all matrix only with `sent_tokens`.
  void Publish(Draft& draft, const std::vector<TransientReplica>& transients, bool sent_tokens,
               StepRouting& routing);

  const Topology& topology_;
  const CostModel& cost_;

  // Bound by Bind.
  const Placement* placement_ = nullptr;  // this call's
  bool bound_ = false;
  std::vector<int> phy2log_;  // the placement Bind last saw
  int num_experts_ = 0;
  int num_ranks_ = 0;
  int num_slots_ = 0;
  int num_sources_ = 0;
  std::vector<int> source_rank_;  // [num_sources]
  std::vector<int> node_of_;      // [num_ranks]
  // One source per rank, a multiple of 4 of them: source s is rank s, a rank's row of received
  // tokens lines up with an expert's sources, and both go four at a time.
  bool source_quads_ = false;
  std::vector<SingleExpert> singles_;  // the experts on one rank, by rank, then ascending
  std::vector<SingleExpert> experts_;  // [num_experts] where each sits, for ScanCounts
  // Experts on one rank in the placement, grouped by that rank, ascending.
  std::vector<int> rank_single_begin_;  // [num_ranks + 1]
  std::vector<int> rank_single_;
  std::vector<int> empty_on_rank_;  // [num_ranks] slots the placement leaves empty

  // This step's. The traffic by expert: by_expert_, or counts_ (then on the fast path).
  const double* by_expert_ = nullptr;
  const std::int32_t* counts_ = nullptr;
  std::vector<double> column_;            // scratch of Column
  std::vector<std::uint32_t> int_lanes_;  // scratch of ScanCounts
  std::vector<double> converted_;  // counts as doubles, where the fast path does not take them
  bool record_shares_ = false;
  int shares_of_rank_ = -1;  // options.shares_of_rank
  bool whole_ = false;       // every entry a whole number, and every sum of them exact
  // The fast path: whole_, one source per rank (source_quads_), and every link sum times the
  // cost model's bytes per token row exact, so that link sums price a routing (PeaksOf). A
  // routing is then patched in place and found per copy; sums are exact in any order.
  bool fast_ = false;
  std::vector<double> sent_;   // [num_ranks] what each source sends in all
  std::vector<double> lanes_;  // [4 * num_experts] scratch of ScanByExpert
  // Whether drafts keep their rows of received tokens: off the fast path, or when the caller
  // wants the all-to-all matrix.
  bool keep_rows_ = true;
  std::vector<double> single_links_;  // [kLinkSums * num_ranks] fast path: single-rank experts
  // The bound placement's replica sync, once a candidate needs it; -1 until then.
  double sync_seconds_ = -1;
  std::vector<double> totals_;
  std::vector<long long> rounded_;
  // [num_experts] totals_ / rounded_ (0 when rounded to 0), where not whole_: quotas count rounded
  // tokens, and this scales them to the expert's exact total. Computed once, as every Assign
  // needs it. Whole totals need no scale (Scale).
  std::vector<double> scale_;
  // [num_ranks * num_ranks] received from single-rank experts, off the fast path.
  std::vector<double> scanned_;
  std::vector<double> remaining_;  // [num_sources] tokens of the current expert still unsent
  std::vector<double> room_;       // [copies of the current expert] quota still open
  std::vector<int> kept_;          // scratch of AddSingles
  // Scratch of the same-node pass of AssignSpread and AssignSpreadWholeRows (LevelGives).
  std::vector<int> node_sources_;
  std::vector<int> node_copies_;
  std::vector<int> copy_nodes_;
  std::vector<double> gives_;
  std::vector<double> takes_;
  std::vector<int> level_order_;
  QuotaSolver solver_;
  QuotaSplit split_;
  QuotaSplit trial_split_;
  QuotaSplit run_split_;  // TakeRun's
  std::vector<TransientReplica> transients_;
  int excluded_expert_ = -1;  // see CopyEnd
  std::vector<int> transients_on_rank_;
  std::vector<int> transient_room_;  // [num_ranks] this call's slots for transients
  std::vector<char> holds_;
  Draft best_;
  // The candidate's routing where best_ is not patched in place; else the shares that
  // KeepPatchedShares builds.
  Draft trial_;
  Undo undo_;
  std::vector<int> patched_;   // see ListPatched
  Draft moved_shares_;         // scratch of PatchBest: their new shares, until kept
  std::vector<char> touched_;  // [num_ranks] see ListPatched
  std::vector<char> gained_;   // [num_experts] scratch of Assign and Publish
};

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
  double* rank_row = received;  // the open copy's rank's row of received tokens
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
    rank_row = received + static_cast<size_t>(rank) * num_ranks;
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
    rank_row[source_rank[s]] += sign * tokens;
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
    rank_row[s] += sign * l0;
    rank_row[s + 1] += sign * l1;
    rank_row[s + 2] += sign * l2;
    rank_row[s + 3] += sign * l3;
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
  // that it stays in a register), `row` its rank's row of received tokens (with kRows). Source
  // (= rank) s sends it `tokens` > 0.
  int rank = 0;
  int id = 0;
  double open = 0;
  double* row = received;
  auto select = [&](int i) KEEL_INLINE {
    rank = solver.copy_rank(begin + i);
    id = solver.copy_id(begin + i);
    open = room[i];
    if constexpr (kRows) row = received + static_cast<size_t>(rank) * num_ranks;
  };
  auto add_row = [&](int s, double tokens) KEEL_INLINE {
    if constexpr (kRows) row[s] += sign * tokens;
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

void StepPlanner::Impl::Assign(size_t num_extras, const QuotaSplit& split, Draft& draft) {
  const int num_ranks = num_ranks_;
  draft.rank_tokens.assign(num_ranks, 0.0);
  draft.slot_tokens.assign(num_slots_, 0.0);
  draft.transient_tokens.assign(num_extras, 0.0);
  draft.shares.clear();
  remaining_.resize(num_sources_);
  if (fast_) {
    // Scan has the link sums of every single-rank expert. One that has a transient now is spread
    // over two ranks: its sums come out here, exactly (the fast path's sums are exact in any
    // order), and AddExpert below adds its spread routing.
    draft.received.assign(keep_rows_ ? static_cast<size_t>(num_ranks) * num_ranks : 0, 0.0);
    draft.links.assign(single_links_.begin(), single_links_.end());
    gained_.assign(num_experts_, 0);
    for (size_t i = 0; i < num_extras; ++i) {
      const int e = transients_[i].expert;
      if (experts_[e].rank < 0 || gained_[e]) continue;
      gained_[e] = 1;
      AddSingleLinks(e, experts_[e].rank, -1.0, draft.links.data());
    }
  } else {
    draft.received.assign(scanned_.begin(), scanned_.end());
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
    double* row = draft.received.data() + static_cast<size_t>(rank) * num_ranks;
    std::fill(row, row + num_ranks, 0.0);
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
    double* row = draft.received.data() + static_cast<size_t>(rank) * num_ranks_;
    const double* column = by_expert_ + static_cast<size_t>(expert) * num_sources_;
    for (int s = 0; s < num_sources_; ++s) row[source_rank_[s]] += sign * column[s];
  }
  if (record_shares_) ShareInSourceOrder(expert, draft);
}

bool StepPlanner::Impl::QuotasMoved(int expert) const {
  // The candidate's own quota is new; the transients before it are in both splits.
  const size_t kept_extras = split_.extra_quota.size();
  for (int c = solver_.copy_begin(expert); c < solver_.copy_end(expert); ++c) {
    const int id = solver_.copy_id(c);
    if (id < num_slots_) {
      if (split_.slot_quota[id] != trial_split_.slot_quota[id]) return true;
      continue;
    }
    const size_t extra = static_cast<size_t>(id - num_slots_);
    if (extra < kept_extras && split_.extra_quota[extra] != trial_split_.extra_quota[extra]) {
      return true;
    }
  }
  return false;
}

void StepPlanner::Impl::ListPatched(int expert) {
  // Only the experts whose flows the candidate's solve moved can have new quotas.
  patched_.clear();
  for (int e : solver_.changed_experts()) {
    if (totals_[e] != 0 && (e == expert || QuotasMoved(e))) patched_.push_back(e);
  }
  std::sort(patched_.begin(), patched_.end());
  touched_.assign(num_ranks_, 0);
  for (int e : patched_) {
    for (int c = solver_.copy_begin(e); c < solver_.copy_end(e); ++c) {
      touched_[solver_.copy_rank(c)] = 1;
    }
  }
}

double StepPlanner::Impl::FloorSeconds() const {
  const LinkPeaks peaks = ReceivePeaks(best_.links.data(), best_.rank_tokens.data(),
                                       touched_.data(), num_ranks_, cost_.token_row_bytes());
  return cost_
      .EstimateFromPeaks(*placement_, static_cast<double>(trial_split_.max_rank_tokens), peaks,
                         transients_, sync_seconds_)
      .total_seconds();
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
      RestoreBest();
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

void StepPlanner::Impl::PatchBest(int expert) {
  const bool record_shares = record_shares_;
  // Only the rows of ranks that hold a patched expert change (on the fast path the rows hold
  // only experts spread over several ranks, and the link sums the others).
  const size_t num_ranks = static_cast<size_t>(num_ranks_);
  undo_.rows.clear();
  for (size_t r = 0; r < num_ranks && keep_rows_; ++r) {
    if (touched_[r]) undo_.rows.push_back(static_cast<int>(r));
  }
  undo_.received.resize(undo_.rows.size() * num_ranks);
  for (size_t i = 0; i < undo_.rows.size(); ++i) {
    std::memcpy(undo_.received.data() + i * num_ranks,
                best_.received.data() + undo_.rows[i] * num_ranks, sizeof(double) * num_ranks);
  }
  undo_.rank_tokens.assign(best_.rank_tokens.begin(), best_.rank_tokens.end());
  undo_.slot_tokens.assign(best_.slot_tokens.begin(), best_.slot_tokens.end());
  undo_.transient_tokens.assign(best_.transient_tokens.begin(), best_.transient_tokens.end());
  undo_.links.assign(best_.links.begin(), best_.links.end());
  best_.transient_tokens.push_back(0.0);

  // The new shares of the experts patched, by expert: Assign's order.
  moved_shares_.shares.clear();
  for (int e : patched_) {
    // Out under the kept split, without the candidate; back in under the candidate's split.
    record_shares_ = false;
    excluded_expert_ = e == expert ? e : -1;
    AddExpert(e, split_, -1.0, /*single_row=*/true, best_);
    excluded_expert_ = -1;
    record_shares_ = record_shares;
    // Shares go to moved_shares_, whose sums are never read.
    best_.shares.swap(moved_shares_.shares);
    AddExpert(e, trial_split_, 1.0, /*single_row=*/true, best_);
    best_.shares.swap(moved_shares_.shares);
  }
}

void StepPlanner::Impl::KeepPatchedShares() {
  // best_'s shares with those of the patched experts replaced, still by expert.
  trial_.shares.clear();
  if (!record_shares_) return;
  const CopyShare* kept = best_.shares.begin();
  const CopyShare* fresh = moved_shares_.shares.begin();
  // The shares are by expert: binary searches find each patched expert's run.
  auto by_expert = [](const CopyShare& share, int expert) { return share.expert < expert; };
  for (int e : patched_) {
    const CopyShare* from = kept;
    kept = std::lower_bound(kept, best_.shares.end(), e, by_expert);
    trial_.shares.Append(from, kept);
    while (kept != best_.shares.end() && kept->expert == e) ++kept;
    from = fresh;
    while (fresh != moved_shares_.shares.end() && fresh->expert == e) ++fresh;
    trial_.shares.Append(from, fresh);
  }
  trial_.shares.Append(kept, best_.shares.end());
  best_.shares.swap(trial_.shares);
}

void StepPlanner::Impl::RestoreBest() {
  const size_t num_ranks = static_cast<size_t>(num_ranks_);
  for (size_t i = 0; i < undo_.rows.size(); ++i) {
    std::memcpy(best_.received.data() + undo_.rows[i] * num_ranks,
                undo_.received.data() + i * num_ranks, sizeof(double) * num_ranks);
  }
  best_.rank_tokens.swap(undo_.rank_tokens);
  best_.slot_tokens.swap(undo_.slot_tokens);
  best_.transient_tokens.swap(undo_.transient_tokens);
  best_.links.swap(undo_.links);
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
  KEEL_RETURN_IF_ERROR(ValidateTopologyAndOptions(placement, topology_, cost_, options));
  const std::span<const long long> tokens = rounded_;
  transients_.clear();
  solver_.Solve(placement, tokens, transients_, split_);
  excluded_expert_ = -1;
  Assign(0, split_, best_);

  // Greedy transients: each must lower the max rank load and the cost model's predicted layer
  // time, alone or as the first of a run of copies that together do (TakeRun); the first
  // candidate that does neither ends the search. The baseline is priced once a candidate gets
  // that far, else at the end. Each candidate re-solves from the previous flow.
  size_t accepted = 0;
  double best_seconds = -1;
  transient_room_.assign(num_ranks_, options.transient_per_rank);
  if (options.spare_slots) {
    for (int r = 0; r < num_ranks_; ++r) transient_room_[r] += empty_on_rank_[r];
  }
  if (std::any_of(transient_room_.begin(), transient_room_.end(), [](int n) { return n > 0; })) {
    transients_on_rank_.assign(num_ranks_, 0);
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
