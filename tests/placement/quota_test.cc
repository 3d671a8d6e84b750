// Keel's quota planner: the exact split against a brute-force optimum, the locality of the
// source assignment, and when transient replicas are (and are not) added.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "placement/cost_model.h"
#include "placement/quota_solver.h"
#include "placement/routing.h"
#include "tests/common/test_util.h"

namespace keel {
namespace {

Placement MakePlacement(int num_experts, int num_ranks, std::vector<int> phy2log,
                        std::vector<int> home = {}) {
  auto p = Placement::Create(num_experts, num_ranks, std::move(phy2log), std::move(home));
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

using testing::MakeTopology;

// Rank of every copy: persistent slots, then extra copies.
std::vector<long long> RankLoads(const Placement& p, const std::vector<TransientReplica>& extras,
                                 const QuotaSplit& split) {
  std::vector<long long> loads(p.num_ranks(), 0);
  for (int s = 0; s < p.num_slots(); ++s) loads[p.rank_of_slot(s)] += split.slot_quota[s];
  for (size_t i = 0; i < extras.size(); ++i) loads[extras[i].rank] += split.extra_quota[i];
  return loads;
}

// Minimal max rank load over every integer split, by dynamic programming over rank-load vectors.
long long BruteForceMaxLoad(const Placement& p, const std::vector<long long>& tokens,
                            const std::vector<TransientReplica>& extras) {
  const int num_ranks = p.num_ranks();
  std::vector<std::vector<long long>> states = {std::vector<long long>(num_ranks, 0)};
  for (int e = 0; e < p.num_experts(); ++e) {
    std::vector<int> ranks;
    for (int slot : p.copies(e)) ranks.push_back(p.rank_of_slot(slot));
    for (const TransientReplica& x : extras) {
      if (x.expert == e) ranks.push_back(x.rank);
    }
    std::vector<std::vector<long long>> next;
    for (const auto& state : states) {
      // Every composition of tokens[e] into ranks.size() parts.
      std::vector<long long> part(ranks.size(), 0);
      auto recurse = [&](auto&& self, size_t i, long long left) -> void {
        if (i + 1 == ranks.size()) {
          part[i] = left;
          std::vector<long long> s = state;
          for (size_t k = 0; k < ranks.size(); ++k) s[ranks[k]] += part[k];
          next.push_back(std::move(s));
          return;
        }
        for (long long x = 0; x <= left; ++x) {
          part[i] = x;
          self(self, i + 1, left - x);
        }
      };
      recurse(recurse, 0, tokens[e]);
    }
    std::sort(next.begin(), next.end());
    next.erase(std::unique(next.begin(), next.end()), next.end());
    states = std::move(next);
  }
  long long best = -1;
  for (const auto& s : states) {
    const long long m = *std::max_element(s.begin(), s.end());
    if (best < 0 || m < best) best = m;
  }
  return best;
}

TEST(SplitQuotasTest, MatchesBruteForceOnSmallRandomCases) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 150; ++trial) {
    const int num_ranks = 1 + rng() % 4;
    const int num_experts = 1 + rng() % 5;
    const int slots_per_rank = (num_experts + num_ranks - 1) / num_ranks + 1 + rng() % 2;
    // Every expert once, then random extra persistent copies (up to 3 copies in all), rest empty;
    // a rank may hold two copies of one expert.
    std::vector<int> phy2log(num_ranks * slots_per_rank, kEmptySlot);
    std::vector<int> order(phy2log.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int> copies(num_experts, 1);
    size_t next = 0;
    for (int e = 0; e < num_experts; ++e) phy2log[order[next++]] = e;
    for (; next < order.size(); ++next) {
      const int e = rng() % (num_experts + 1);
      if (e < num_experts && copies[e] < 3) {
        phy2log[order[next]] = e;
        ++copies[e];
      }
    }
    Placement p = MakePlacement(num_experts, num_ranks, phy2log);
    std::vector<TransientReplica> extras;
    if (rng() % 2) {
      const int e = rng() % num_experts;
      if (copies[e] < 3) extras.push_back({e, static_cast<int>(rng() % num_ranks), 0});
    }
    std::vector<long long> tokens(num_experts);
    for (auto& t : tokens) t = rng() % 9;

    const QuotaSplit split = SplitQuotas(p, tokens, extras);
    ASSERT_EQ(split.slot_quota.size(), static_cast<size_t>(p.num_slots()));
    ASSERT_EQ(split.extra_quota.size(), extras.size());
    const auto loads = RankLoads(p, extras, split);
    EXPECT_EQ(split.max_rank_tokens, *std::max_element(loads.begin(), loads.end()));
    EXPECT_EQ(split.max_rank_tokens, BruteForceMaxLoad(p, tokens, extras)) << "trial " << trial;
    // Quotas are non-negative, only on copies of the expert, and sum to its tokens.
    std::vector<long long> sums(num_experts, 0);
    for (int s = 0; s < p.num_slots(); ++s) {
      EXPECT_GE(split.slot_quota[s], 0);
      if (p.expert_at(s) == kEmptySlot) {
        EXPECT_EQ(split.slot_quota[s], 0);
      } else {
        sums[p.expert_at(s)] += split.slot_quota[s];
      }
    }
    for (size_t i = 0; i < extras.size(); ++i) sums[extras[i].expert] += split.extra_quota[i];
    EXPECT_EQ(sums, tokens) << "trial " << trial;
  }
}

TEST(SplitQuotasTest, SingleCopyExpertsStayPut) {
  // Rank 0: experts 0, 1; rank 1: experts 2, 1. Expert 0 and 2 have one copy each.
  Placement p = MakePlacement(3, 2, {0, 1, 2, 1});
  const QuotaSplit split = SplitQuotas(p, {10, 6, 2}, {});
  EXPECT_EQ(split.slot_quota[0], 10);
  EXPECT_EQ(split.slot_quota[2], 2);
  EXPECT_EQ(split.slot_quota[1], 0);  // expert 1 goes to the lighter rank 1
  EXPECT_EQ(split.slot_quota[3], 6);
  EXPECT_EQ(split.max_rank_tokens, 10);
}

TEST(SplitQuotasTest, TwoCopiesOnOneRankShareItEvenly) {
  Placement p = MakePlacement(2, 2, {0, 0, 1, kEmptySlot});
  const QuotaSplit split = SplitQuotas(p, {5, 1}, {});
  EXPECT_EQ(split.slot_quota, (std::vector<long long>{3, 2, 1, 0}));
  EXPECT_EQ(split.max_rank_tokens, 5);
}

TEST(SplitQuotasTest, ExtraCopyTakesShare) {
  Placement p = MakePlacement(2, 2, {0, 1});
  const QuotaSplit without = SplitQuotas(p, {10, 2}, {});
  EXPECT_EQ(without.max_rank_tokens, 10);
  const QuotaSplit with = SplitQuotas(p, {10, 2}, {{0, 1, 0}});
  EXPECT_EQ(with.max_rank_tokens, 6);
  EXPECT_EQ(with.slot_quota[0] + with.extra_quota[0], 10);
}

TEST(SplitQuotasTest, IsDeterministic) {
  std::mt19937 rng(3);
  std::vector<int> phy2log;
  for (int s = 0; s < 40; ++s) phy2log.push_back(s < 32 ? s : static_cast<int>(rng() % 32));
  Placement p = MakePlacement(32, 8, phy2log);
  std::vector<long long> tokens(32);
  for (auto& t : tokens) t = rng() % 1000;
  const QuotaSplit a = SplitQuotas(p, tokens, {{3, 5, 0}});
  const QuotaSplit b = SplitQuotas(p, tokens, {{3, 5, 0}});
  EXPECT_EQ(a.slot_quota, b.slot_quota);
  EXPECT_EQ(a.extra_quota, b.extra_quota);
  EXPECT_EQ(a.max_rank_tokens, b.max_rank_tokens);
}

TEST(SplitQuotasTest, ZeroTokens) {
  Placement p = MakePlacement(2, 2, {0, 1, 1, 0});
  const QuotaSplit split = SplitQuotas(p, {0, 0}, {});
  EXPECT_EQ(split.max_rank_tokens, 0);
  EXPECT_EQ(split.slot_quota, (std::vector<long long>(4, 0)));
}

// A replan prices candidates one slot apart with QuotaSplitter::MaxRankTokens, which resumes from
// the previous solution: it must give the optimum a fresh SplitQuotas gives, whatever the previous
// placement was, and Split the same split.
TEST(QuotaSplitterTest, MatchesSplitQuotasAlongRandomSlotChanges) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 40; ++trial) {
    const int num_ranks = 2 + static_cast<int>(rng() % 7);
    const int slots_per_rank = 1 + static_cast<int>(rng() % 4);
    const int num_slots = num_ranks * slots_per_rank;
    const int num_experts = 1 + static_cast<int>(rng() % num_slots);
    std::vector<int> phy2log(num_slots, kEmptySlot);
    for (int s = 0; s < num_slots; ++s) {
      phy2log[s] = s < num_experts ? s : static_cast<int>(rng() % (num_experts + 1)) - 1;
    }
    std::shuffle(phy2log.begin(), phy2log.end(), rng);
    std::vector<long long> tokens(num_experts);
    for (auto& t : tokens) t = rng() % 4 == 0 ? 0 : static_cast<long long>(rng() % 5000);
    QuotaSplitter splitter;
    QuotaSplit split;
    splitter.Split(MakePlacement(num_experts, num_ranks, phy2log), tokens, split);
    const QuotaSplit fresh =
        SplitQuotas(MakePlacement(num_experts, num_ranks, phy2log), tokens, {});
    EXPECT_EQ(split.slot_quota, fresh.slot_quota);
    EXPECT_EQ(split.max_rank_tokens, fresh.max_rank_tokens);
    for (int change = 0; change < 20; ++change) {
      // Give a random slot to a random expert, keeping every expert on at least one slot.
      std::vector<int> next = phy2log;
      next[rng() % num_slots] = static_cast<int>(rng() % num_experts);
      auto candidate = Placement::Create(num_experts, num_ranks, next);
      if (!candidate.ok()) continue;
      EXPECT_EQ(splitter.MaxRankTokens(*candidate),
                SplitQuotas(*candidate, tokens, {}).max_rank_tokens)
          << "trial " << trial << " change " << change;
      phy2log = std::move(next);
    }
  }
}

// Copies of one expert on one rank share that rank's tokens evenly, lower slots (then extra
// copies in their given order) taking the remainder.
void ExpectEvenOnEachRank(const Placement& p, const std::vector<TransientReplica>& extras,
                          const QuotaSplit& split, const std::string& where) {
  for (int e = 0; e < p.num_experts(); ++e) {
    for (int r = 0; r < p.num_ranks(); ++r) {
      std::vector<long long> quotas;  // in that order
      for (int s = 0; s < p.num_slots(); ++s) {
        if (p.expert_at(s) == e && p.rank_of_slot(s) == r) quotas.push_back(split.slot_quota[s]);
      }
      for (size_t i = 0; i < extras.size(); ++i) {
        if (extras[i].expert == e && extras[i].rank == r) quotas.push_back(split.extra_quota[i]);
      }
      if (quotas.size() < 2) continue;
      const long long count = static_cast<long long>(quotas.size());
      const long long sum = std::accumulate(quotas.begin(), quotas.end(), 0LL);
      for (long long i = 0; i < count; ++i) {
        EXPECT_EQ(quotas[i], sum / count + (i < sum % count ? 1 : 0))
            << where << ": copy " << i << " of expert " << e << " on rank " << r;
      }
    }
  }
}

// Every expert once, the other slots random copies, all shuffled over num_ranks x slots_per_rank
// slots; up to 39 tokens per expert, a fifth of the experts none.
struct SolverCase {
  Placement placement;
  std::vector<long long> tokens;
};
SolverCase RandomSolverCase(std::mt19937& rng, int num_ranks, int slots_per_rank, int num_experts) {
  std::vector<int> phy2log(num_ranks * slots_per_rank);
  for (size_t s = 0; s < phy2log.size(); ++s) {
    phy2log[s] = s < static_cast<size_t>(num_experts) ? static_cast<int>(s)
                                                      : static_cast<int>(rng() % num_experts);
  }
  std::shuffle(phy2log.begin(), phy2log.end(), rng);
  std::vector<long long> tokens(num_experts);
  for (auto& t : tokens) t = rng() % 5 == 0 ? 0 : static_cast<long long>(rng() % 40);
  return {MakePlacement(num_experts, num_ranks, std::move(phy2log)), std::move(tokens)};
}

// The solver's bottleneck experts, after a solve, after each copy added (mostly to one of them,
// as the per-step planner adds transients), and after a fresh solve with the same copies. B must
// be ascending with tokens, and pin the max load T:
//  - a copy of an expert outside B, or of one in B on a rank that holds B, leaves T as it is;
//  - B is the last min cut's experts plus those on one of its ranks alone, so with S the ranks
//    that hold B, T = ceil(tokens(B) / |S|).
// Each split is also checked as a split, even on each rank (ExpectEvenOnEachRank).
TEST(QuotaSolverTest, BottleneckExpertsPinTheMaxLoad) {
  std::mt19937 rng(23);
  int pinned = 0;
  for (int trial = 0; trial < 200; ++trial) {
    // Small cases, and larger ones where a cut's experts are few against all of them (the
    // solver then lists them from the cut's ranks instead of passing over every expert).
    const bool large = trial % 2 == 1;
    const int num_ranks = (large ? 8 : 2) + static_cast<int>(rng() % 4);
    const int slots_per_rank = large ? 4 : 2;
    const int num_experts = large ? num_ranks * 3 + static_cast<int>(rng() % num_ranks)
                                  : 2 + static_cast<int>(rng() % (num_ranks * slots_per_rank - 1));
    const SolverCase c = RandomSolverCase(rng, num_ranks, slots_per_rank, num_experts);
    const Placement& p = c.placement;
    const std::vector<long long>& tokens = c.tokens;

    std::vector<TransientReplica> extras;
    // Checks `solver` after its last call, which solved for `extras`.
    auto check = [&](QuotaSolver& solver, const QuotaSplit& split, const std::string& where) {
      const long long max_load = split.max_rank_tokens;
      ASSERT_EQ(max_load, SplitQuotas(p, tokens, extras).max_rank_tokens) << where;
      // A split of every expert's tokens among its copies, whose max rank load is max_load.
      const std::vector<long long> loads = RankLoads(p, extras, split);
      EXPECT_EQ(*std::max_element(loads.begin(), loads.end()), max_load) << where;
      std::vector<long long> sums(num_experts, 0);
      for (int s = 0; s < p.num_slots(); ++s) {
        EXPECT_GE(split.slot_quota[s], 0) << where;
        if (p.expert_at(s) != kEmptySlot) sums[p.expert_at(s)] += split.slot_quota[s];
      }
      for (size_t i = 0; i < extras.size(); ++i) {
        EXPECT_GE(split.extra_quota[i], 0) << where;
        sums[extras[i].expert] += split.extra_quota[i];
      }
      EXPECT_EQ(sums, tokens) << where;
      ExpectEvenOnEachRank(p, extras, split, where);
      const std::vector<int> bottleneck = solver.bottleneck_experts();
      ASSERT_TRUE(std::is_sorted(bottleneck.begin(), bottleneck.end())) << where;
      auto holds = [&](int expert, int rank) {
        for (int c = solver.copy_begin(expert); c < solver.copy_end(expert); ++c) {
          if (solver.copy_rank(c) == rank) return true;
        }
        return false;
      };
      std::vector<char> in_bottleneck(num_experts, 0), pinning_rank(num_ranks, 0);
      long long pinned_tokens = 0;
      for (int e : bottleneck) {
        EXPECT_GT(tokens[e], 0) << where;
        in_bottleneck[e] = 1;
        pinned_tokens += tokens[e];
        for (int r = 0; r < num_ranks; ++r) pinning_rank[r] |= holds(e, r);
      }
      const long long pinning_ranks = std::count(pinning_rank.begin(), pinning_rank.end(), 1);
      if (!bottleneck.empty()) {
        ++pinned;
        EXPECT_EQ(max_load, (pinned_tokens + pinning_ranks - 1) / pinning_ranks) << where;
      }
      for (int e = 0; e < num_experts; ++e) {
        for (int r = 0; r < num_ranks; ++r) {
          if (tokens[e] == 0 || holds(e, r) || (in_bottleneck[e] && !pinning_rank[r])) continue;
          std::vector<TransientReplica> more = extras;
          more.push_back({e, r, 0});
          EXPECT_EQ(SplitQuotas(p, tokens, more).max_rank_tokens, max_load)
              << where << ": a copy of expert " << e << " on rank " << r;
        }
      }
    };
    QuotaSolver solver;
    QuotaSplit split;
    solver.Solve(p, tokens, extras, split);
    for (;;) {
      const std::string where =
          "trial " + std::to_string(trial) + " extras " + std::to_string(extras.size());
      check(solver, split, where + " (re-solved)");
      // The same copies solved afresh.
      QuotaSolver fresh;
      QuotaSplit fresh_split;
      fresh.Solve(p, tokens, extras, fresh_split);
      check(fresh, fresh_split, where + " (fresh)");
      // The next copy: mostly a bottleneck expert on a rank without it, as the planner adds
      // one; else any expert (with tokens or not) on any rank (holding it or not).
      const std::vector<int>& bottleneck = solver.bottleneck_experts();
      if (extras.size() == 3) break;
      int expert = static_cast<int>(rng() % num_experts);
      int rank = static_cast<int>(rng() % num_ranks);
      if (rng() % 3 != 0 && !bottleneck.empty()) {
        expert = bottleneck[rng() % bottleneck.size()];
        std::vector<char> holder(num_ranks, 0);
        for (int c = solver.copy_begin(expert); c < solver.copy_end(expert); ++c) {
          holder[solver.copy_rank(c)] = 1;
        }
        for (int tries = 0; tries < num_ranks && holder[rank]; ++tries) {
          rank = (rank + 1) % num_ranks;
        }
      }
      extras.push_back({expert, rank, 0});
      solver.AddCopy(p, extras, split);
    }
  }
  EXPECT_GT(pinned, 200);  // the cases exercise the bound, not only empty lists
}

// NextTransient against the rule it states, found by brute force: of the bottleneck experts that
// some rank can take, the most tokens per copy (ties: the lowest id), on the least-loaded rank
// (ties: the lowest) with a free transient slot and no copy of it, fed from its first holder on
// that rank's node, else its home. Few ranks have a free slot, so that the least-loaded of them
// often holds the expert.
TEST(QuotaSolverTest, NextTransientFollowsItsRule) {
  std::mt19937 rng(37);
  int found = 0;
  int coolest_held = 0;  // the least-loaded free rank held the chosen expert
  for (int trial = 0; trial < 600; ++trial) {
    const int per_node = 2 + static_cast<int>(rng() % 3);
    const int num_nodes = 1 + static_cast<int>(rng() % 3);
    const int num_ranks = num_nodes * per_node;
    const Topology topology = MakeTopology(num_nodes, per_node);
    const int slots_per_rank = 2;
    const int num_experts = 2 + static_cast<int>(rng() % (num_ranks * slots_per_rank - 1));
    const SolverCase c = RandomSolverCase(rng, num_ranks, slots_per_rank, num_experts);
    const Placement& p = c.placement;
    const std::vector<long long>& tokens = c.tokens;

    std::vector<TransientReplica> extras;
    QuotaSolver solver;
    QuotaSplit split;
    solver.Solve(p, tokens, extras, split);
    std::vector<char> scratch;
    for (int round = 0; round < 3; ++round) {
      // Each rank's slots for transients (as with spare slots, not all alike), most of them taken.
      std::vector<int> room(num_ranks);
      for (int& n : room) n = 1 + static_cast<int>(rng() % 2);
      std::vector<int> on_rank(num_ranks);
      for (int g = 0; g < num_ranks; ++g) on_rank[g] = rng() % 3 == 0 ? 0 : room[g];
      const std::span<const long long> load = solver.rank_load();
      auto free = [&](int g) { return on_rank[g] < room[g]; };
      auto holds = [&](int e, int g) {
        for (int c = solver.copy_begin(e); c < solver.copy_end(e); ++c) {
          if (solver.copy_rank(c) == g) return true;
        }
        return false;
      };
      bool expect_found = false;
      TransientReplica expected;
      long long best_tokens = 0;
      long long best_copies = 1;
      for (int e : solver.bottleneck_experts()) {
        int target = -1;
        for (int g = 0; g < num_ranks; ++g) {
          if (!free(g) || holds(e, g)) continue;
          if (target < 0 || load[g] < load[target] || (load[g] == load[target] && g < target)) {
            target = g;
          }
        }
        if (target < 0) continue;
        const long long copies = solver.copy_end(e) - solver.copy_begin(e);
        const bool hotter = tokens[e] * best_copies > best_tokens * copies;
        if (expect_found &&
            !(hotter || (tokens[e] * best_copies == best_tokens * copies && e < expected.expert))) {
          continue;
        }
        int source = p.home(e);
        for (int slot : p.copies(e)) {
          if (topology.same_node(p.rank_of_slot(slot), target)) {
            source = p.rank_of_slot(slot);
            break;
          }
        }
        expected = {e, target, source};
        best_tokens = tokens[e];
        best_copies = copies;
        expect_found = true;
      }
      TransientReplica next{-1, -1, -1};
      const std::string where =
          "trial " + std::to_string(trial) + " round " + std::to_string(round);
      ASSERT_EQ(NextTransient(p, topology, solver, tokens, on_rank, room, scratch, next),
                expect_found)
          << where;
      if (!expect_found) break;
      ++found;
      EXPECT_EQ(next.expert, expected.expert) << where;
      EXPECT_EQ(next.rank, expected.rank) << where;
      EXPECT_EQ(next.source_rank, expected.source_rank) << where;
      int coolest = -1;
      for (int g = 0; g < num_ranks; ++g) {
        if (free(g) && (coolest < 0 || load[g] < load[coolest])) coolest = g;
      }
      if (holds(expected.expert, coolest)) ++coolest_held;
      extras.push_back(next);
      solver.AddCopy(p, extras, split);
    }
  }
  EXPECT_GT(found, 400);
  EXPECT_GT(coolest_held, 10);
}

// A solver that last resolved another placement adds a copy to that one: its flows, not the
// quotas of its last solve, are where AddCopy starts.
TEST(QuotaSolverTest, AddCopyAfterResolve) {
  std::mt19937 rng(29);
  for (int trial = 0; trial < 100; ++trial) {
    const int num_ranks = 3 + static_cast<int>(rng() % 4);
    const int num_experts = num_ranks + static_cast<int>(rng() % num_ranks);
    auto random_placement = [&] {
      std::vector<int> phy2log(num_ranks * 3);
      for (size_t s = 0; s < phy2log.size(); ++s) {
        phy2log[s] = s < static_cast<size_t>(num_experts) ? static_cast<int>(s)
                                                          : static_cast<int>(rng() % num_experts);
      }
      std::shuffle(phy2log.begin(), phy2log.end(), rng);
      return MakePlacement(num_experts, num_ranks, phy2log);
    };
    const Placement first = random_placement();
    const Placement second = random_placement();
    std::vector<long long> tokens(num_experts);
    for (auto& t : tokens) t = static_cast<long long>(rng() % 50);
    QuotaSolver solver;
    QuotaSplit split;
    solver.Solve(first, tokens, {}, split);
    EXPECT_EQ(solver.Resolve(second), SplitQuotas(second, tokens, {}).max_rank_tokens);
    const std::vector<TransientReplica> extras = {
        {static_cast<int>(rng() % num_experts), static_cast<int>(rng() % num_ranks), 0}};
    solver.AddCopy(second, extras, split);
    const std::string where = "trial " + std::to_string(trial);
    EXPECT_EQ(split.max_rank_tokens, SplitQuotas(second, tokens, extras).max_rank_tokens) << where;
    const std::vector<long long> loads = RankLoads(second, extras, split);
    EXPECT_EQ(*std::max_element(loads.begin(), loads.end()), split.max_rank_tokens) << where;
    std::vector<long long> sums(num_experts, 0);
    for (int s = 0; s < second.num_slots(); ++s) sums[second.expert_at(s)] += split.slot_quota[s];
    sums[extras[0].expert] += split.extra_quota[0];
    EXPECT_EQ(sums, tokens) << where;
    ExpectEvenOnEachRank(second, extras, split, where);
  }
}

// --- PlanStepQuotas ---------------------------------------------------------------------------

CostModelConfig SmallExperts() {
  CostModelConfig config;
  config.hidden_size = 64;
  config.expert_ffn_size = 64;
  config.expert_tflops = 1e-6;  // compute dominates: a transient replica pays for itself
  return config;
}

void ExpectConsistent(const Placement& p, const StepLoad& load, const StepRouting& r) {
  const int num_ranks = p.num_ranks();
  const double total = load.TotalTokens();
  EXPECT_NEAR(std::accumulate(r.rank_tokens.begin(), r.rank_tokens.end(), 0.0), total,
              1e-9 * (1 + total));
  double slots = std::accumulate(r.slot_tokens.begin(), r.slot_tokens.end(), 0.0);
  slots = std::accumulate(r.transient_tokens.begin(), r.transient_tokens.end(), slots);
  EXPECT_NEAR(slots, total, 1e-9 * (1 + total));
  ASSERT_EQ(r.transient_tokens.size(), r.transients.size());
  // Row sums of the traffic are what each source rank sent; column sums what each rank computes.
  std::vector<double> sent(num_ranks, 0.0);
  for (int s = 0; s < load.num_sources; ++s) {
    for (int e = 0; e < load.num_experts; ++e) sent[s % num_ranks] += load.at(s, e);
  }
  for (int src = 0; src < num_ranks; ++src) {
    double row = 0;
    double column = 0;
    for (int dst = 0; dst < num_ranks; ++dst) {
      row += r.sent_tokens[src * num_ranks + dst];
      column += r.sent_tokens[dst * num_ranks + src];
      EXPECT_GE(r.sent_tokens[src * num_ranks + dst], -1e-9);
    }
    EXPECT_NEAR(row, sent[src], 1e-9 * (1 + total));
    EXPECT_NEAR(column, r.rank_tokens[src], 1e-9 * (1 + total));
  }
}

TEST(PlanStepQuotasTest, KeepsTokensLocalWhenQuotaAllows) {
  // Expert 0 on ranks 0 and 1, 10 tokens from each: the split is 10/10 and nothing crosses.
  Placement p = MakePlacement(3, 2, {0, 1, 0, 2});
  auto load = StepLoad::FromTraffic(2, 3, {10, 5, 0, 10, 0, 5});
  ASSERT_TRUE(load.ok());
  const Topology topo = MakeTopology(1, 2);
  const CostModel cost(topo, CostModelConfig{});
  auto r = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(p, *load, *r);
  EXPECT_DOUBLE_EQ(r->sent_tokens[0 * 2 + 1], 0.0);
  EXPECT_DOUBLE_EQ(r->sent_tokens[1 * 2 + 0], 0.0);
  EXPECT_DOUBLE_EQ(r->rank_tokens[0], 15.0);
  EXPECT_DOUBLE_EQ(r->rank_tokens[1], 15.0);
}

TEST(PlanStepQuotasTest, PrefersSameNodeCopyWhenLocalQuotaIsFull) {
  // Two nodes of two ranks. Expert 0 on ranks 0, 1 (node 0) and 2 (node 1); all of its 30 tokens
  // come from rank 0, whose local copy takes 10: the next 10 go to rank 1, not rank 2.
  Placement p = MakePlacement(1, 4, {0, 0, 0, kEmptySlot});
  std::vector<double> traffic = {30, 0, 0, 0};
  auto load = StepLoad::FromTraffic(4, 1, traffic);
  ASSERT_TRUE(load.ok());
  const Topology topo = MakeTopology(2, 2);
  const CostModel cost(topo, CostModelConfig{});
  auto r = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(p, *load, *r);
  EXPECT_DOUBLE_EQ(r->sent_tokens[0], 10.0);
  EXPECT_DOUBLE_EQ(r->sent_tokens[1], 10.0);
  EXPECT_DOUBLE_EQ(r->sent_tokens[2], 10.0);
}

TEST(PlanStepQuotasTest, ANodesSourcesAndCopiesLevelWhatCrossesNodes) {
  // Two nodes of four ranks; expert 0 alone. Worked by hand from the levelled same-node pass.
  const Topology topo = MakeTopology(2, 4);
  const CostModel cost(topo, CostModelConfig{});
  auto sent = [](const StepRouting& r, int from, int to) { return r.sent_tokens[from * 8 + to]; };

  // Copies on ranks 3 and 7, quotas 9 and 9; sources 0 and 1 (node 0) send 12 and 6. Rank 3's 9
  // come from them down to a common level (8 and 1, keeping 4 and 5), not 9 from source 0 alone
  // (which would leave source 0 with 3 and source 1 with 6 for the other node).
  Placement p = MakePlacement(
      1, 8, {kEmptySlot, kEmptySlot, kEmptySlot, 0, kEmptySlot, kEmptySlot, kEmptySlot, 0});
  auto load = StepLoad::FromTraffic(8, 1, {12, 6, 0, 0, 0, 0, 0, 0});
  ASSERT_TRUE(load.ok());
  auto r = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(p, *load, *r);
  EXPECT_EQ(sent(*r, 0, 3), 8.0);
  EXPECT_EQ(sent(*r, 1, 3), 1.0);
  EXPECT_EQ(sent(*r, 0, 7), 4.0);
  EXPECT_EQ(sent(*r, 1, 7), 5.0);

  // Copies on ranks 0, 6 and 7, quotas 10 each; source 1 (node 0) sends 21, source 4 (node 1) 9.
  // Node 1's 9 tokens go to its two copies so that what they still need is level (5 and 4,
  // leaving 5 and 6 to come from node 0), not 9 to rank 6 and 10 from node 0 to rank 7.
  p = MakePlacement(1, 8, {0, kEmptySlot, kEmptySlot, kEmptySlot, kEmptySlot, kEmptySlot, 0, 0});
  load = StepLoad::FromTraffic(8, 1, {0, 21, 0, 0, 9, 0, 0, 0});
  ASSERT_TRUE(load.ok());
  r = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(p, *load, *r);
  EXPECT_EQ(sent(*r, 1, 0), 10.0);
  EXPECT_EQ(sent(*r, 4, 6), 5.0);
  EXPECT_EQ(sent(*r, 4, 7), 4.0);
  EXPECT_EQ(sent(*r, 1, 6), 5.0);
  EXPECT_EQ(sent(*r, 1, 7), 6.0);
}

TEST(PlanStepQuotasTest, ManySourcesMapRoundRobin) {
  Placement p = MakePlacement(2, 2, {0, 1});
  auto load = StepLoad::FromTraffic(4, 2, {1, 2, 3, 4, 5, 6, 7, 8});
  ASSERT_TRUE(load.ok());
  const Topology topo = MakeTopology(1, 2);
  const CostModel cost(topo, CostModelConfig{});
  auto r = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(p, *load, *r);
  EXPECT_DOUBLE_EQ(r->sent_tokens[0 * 2 + 1], 2.0 + 6.0);  // sources 0 and 2 are rank 0
}

TEST(PlanStepQuotasTest, RejectsMismatchedInputs) {
  Placement p = MakePlacement(2, 2, {0, 1});
  const Topology topo = MakeTopology(1, 2);
  const CostModel cost(topo, CostModelConfig{});
  auto load = StepLoad::FromExpertCounts(2, std::vector<double>{1, 2, 3});
  ASSERT_TRUE(load.ok());
  auto r = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("load.num_experts 3"), std::string::npos);
  auto good = StepLoad::FromExpertCounts(2, std::vector<double>{1, 2});
  ASSERT_TRUE(good.ok());
  const Topology big = MakeTopology(1, 4);
  r = PlanStepQuotas(p, *good, big, CostModel(big, {}), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("topology has 4 ranks"), std::string::npos);
  r = PlanStepQuotas(p, *good, topo, cost, {.transient_per_rank = -1});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("transient_per_rank must be >= 0, got -1"),
            std::string::npos);
}

// A hot expert with one copy on rank 0 of an 8-rank node.
struct HotCase {
  Placement placement = MakePlacement(8, 8, {0, 1, 2, 3, 4, 5, 6, 7});
  StepLoad load;
  HotCase() {
    std::vector<double> counts = {800, 10, 10, 10, 10, 10, 10, 10};
    load = StepLoad::FromExpertCounts(8, counts).value();
  }
};

TEST(PlanStepQuotasTest, AddsTransientsForHotExpertWhenTheyPay) {
  HotCase c;
  const Topology topo = MakeTopology(1, 8);
  const CostModel cost(topo, SmallExperts());
  auto r = PlanStepQuotas(c.placement, c.load, topo, cost, {.transient_per_rank = 1});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(c.placement, c.load, *r);
  EXPECT_FALSE(r->transients.empty());
  std::vector<int> per_rank(8, 0);
  for (const TransientReplica& t : r->transients) {
    EXPECT_EQ(t.expert, 0);
    EXPECT_FALSE(c.placement.holds(t.rank, t.expert));
    EXPECT_EQ(t.source_rank, 0);  // same node: fed from the holder
    EXPECT_LE(++per_rank[t.rank], 1);
  }
  auto none = PlanStepQuotas(c.placement, c.load, topo, cost, {});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->transients.empty());
  EXPECT_LT(r->max_rank_tokens(), none->max_rank_tokens());
  EXPECT_LT(cost.Estimate(c.placement, *r).total_seconds(),
            cost.Estimate(c.placement, *none).total_seconds());
}

TEST(PlanStepQuotasTest, TwoRanksTiedAtTheTopGetATransientEach) {
  // Experts 0 and 1 (ranks 0 and 1) get 100 tokens each, experts 2 and 3 none. A transient of
  // expert 0 alone leaves rank 1 at 100; with one of expert 1 beside it the busiest rank falls to
  // 50. Before the pair was tried, the search stopped at the first copy and added none.
  Placement p = MakePlacement(4, 4, {0, 1, 2, 3});
  auto load = StepLoad::FromExpertCounts(4, std::vector<double>{100, 100, 0, 0});
  ASSERT_TRUE(load.ok());
  const Topology topo = MakeTopology(1, 4);
  const CostModel cost(topo, SmallExperts());
  auto r = PlanStepQuotas(p, *load, topo, cost, {.transient_per_rank = 1});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(p, *load, *r);
  ASSERT_EQ(r->transients.size(), 2u);
  EXPECT_EQ(r->transients[0].expert, 0);
  EXPECT_EQ(r->transients[1].expert, 1);
  EXPECT_EQ(r->max_rank_tokens(), 50.0);
  auto none = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(none.ok());
  EXPECT_LT(cost.Estimate(p, *r).total_seconds(), cost.Estimate(p, *none).total_seconds());
}

// With spare_slots the slots a placement leaves empty take transients beyond transient_per_rank:
// here ranks 1 and 3 each have one empty slot and there are no transient slots, so the hot
// expert's copies go there and nowhere else.
TEST(PlanStepQuotasTest, SpareSlotsTakeTransients) {
  Placement p = MakePlacement(6, 4, {0, 1, 2, kEmptySlot, 3, 4, 5, kEmptySlot});
  auto load = StepLoad::FromExpertCounts(4, std::vector<double>{800, 10, 10, 10, 10, 10});
  ASSERT_TRUE(load.ok());
  const Topology topo = MakeTopology(1, 4);
  const CostModel cost(topo, SmallExperts());
  auto none = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->transients.empty());
  auto spare = PlanStepQuotas(p, *load, topo, cost, {.spare_slots = true});
  ASSERT_TRUE(spare.ok()) << spare.status().ToString();
  ExpectConsistent(p, *load, *spare);
  std::vector<int> per_rank(4, 0);
  for (const TransientReplica& t : spare->transients) {
    EXPECT_EQ(t.expert, 0);
    ++per_rank[t.rank];
  }
  EXPECT_EQ(per_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_LT(spare->max_rank_tokens(), none->max_rank_tokens());
  // With a transient slot per rank as well, rank 2 can take a copy too (an expert has at most one
  // copy per rank, so ranks 1 and 3 keep one each).
  auto both = PlanStepQuotas(p, *load, topo, cost, {.transient_per_rank = 1, .spare_slots = true});
  ASSERT_TRUE(both.ok());
  ExpectConsistent(p, *load, *both);
  std::fill(per_rank.begin(), per_rank.end(), 0);
  for (const TransientReplica& t : both->transients) ++per_rank[t.rank];
  EXPECT_EQ(per_rank, (std::vector<int>{0, 1, 1, 1}));
  EXPECT_LT(both->max_rank_tokens(), spare->max_rank_tokens());
}

TEST(PlanStepQuotasTest, NoTransientsWhenWeightsAreExpensive) {
  HotCase c;
  const Topology topo = MakeTopology(1, 8);
  CostModelConfig config;
  config.hidden_size = 16384;
  config.expert_ffn_size = 65536;
  const CostModel cost(topo, config);
  auto r = PlanStepQuotas(c.placement, c.load, topo, cost, {.transient_per_rank = 2});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->transients.empty());
}

TEST(PlanStepQuotasTest, TransientsRespectPerRankLimitAndHolders) {
  std::mt19937 rng(11);
  const Topology topo = MakeTopology(2, 4, 400, 25);
  const CostModel cost(topo, SmallExperts());
  for (int trial = 0; trial < 30; ++trial) {
    std::vector<int> phy2log;
    for (int s = 0; s < 24; ++s) phy2log.push_back(s < 16 ? s : static_cast<int>(rng() % 16));
    Placement p = MakePlacement(16, 8, phy2log);
    std::vector<double> traffic(8 * 16);
    for (int s = 0; s < 8; ++s) {
      for (int e = 0; e < 16; ++e) traffic[s * 16 + e] = (e < 2 ? 400 : 1) * (rng() % 5);
    }
    auto load = StepLoad::FromTraffic(8, 16, traffic);
    ASSERT_TRUE(load.ok());
    const int limit = 1 + trial % 2;
    auto r = PlanStepQuotas(p, *load, topo, cost, {.transient_per_rank = limit});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ExpectConsistent(p, *load, *r);
    std::vector<int> per_rank(8, 0);
    for (size_t i = 0; i < r->transients.size(); ++i) {
      const TransientReplica& t = r->transients[i];
      EXPECT_FALSE(p.holds(t.rank, t.expert));
      EXPECT_TRUE(p.holds(t.source_rank, t.expert));
      EXPECT_LE(++per_rank[t.rank], limit);
      for (size_t j = 0; j < i; ++j) {
        EXPECT_FALSE(r->transients[j].expert == t.expert && r->transients[j].rank == t.rank);
      }
    }
    auto plain = PlanStepQuotas(p, *load, topo, cost, {});
    ASSERT_TRUE(plain.ok());
    EXPECT_LE(cost.Estimate(p, *r).total_seconds(), cost.Estimate(p, *plain).total_seconds());
  }
}

// 8 ranks x 4 slots, 8 to 24 experts each with a copy, the rest random replicas; traffic with
// counts over four orders of magnitude.
struct RandomCase {
  Placement placement;
  StepLoad load;
};

RandomCase MakeRandomCase(std::mt19937& rng) {
  const int num_experts = 8 + rng() % 17;
  std::vector<int> phy2log;
  for (int s = 0; s < 8 * 4; ++s) {
    phy2log.push_back(s < num_experts ? s : static_cast<int>(rng() % num_experts));
  }
  std::shuffle(phy2log.begin(), phy2log.end(), rng);
  std::vector<double> traffic(8 * num_experts);
  std::uniform_int_distribution<int> skew(0, 3);
  for (auto& t : traffic) t = std::floor(std::pow(10.0, skew(rng)) * (rng() % 7));
  auto load = StepLoad::FromTraffic(8, num_experts, traffic);
  EXPECT_TRUE(load.ok());
  return {MakePlacement(num_experts, 8, phy2log), *load};
}

TEST(PlanStepQuotasTest, NeverLessBalancedThanEvenRouting) {
  std::mt19937 rng(5);
  const Topology topo = MakeTopology(2, 4);
  const CostModel cost(topo, CostModelConfig{});
  for (int trial = 0; trial < 100; ++trial) {
    RandomCase c = MakeRandomCase(rng);
    const Placement& p = c.placement;
    const StepLoad* load = &c.load;
    auto r = PlanStepQuotas(p, *load, topo, cost, {});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ExpectConsistent(p, *load, *r);
    const StepRouting even = RouteEvenly(p, *load);
    // Integer quotas can exceed a fractional even split by less than one token.
    EXPECT_LE(r->max_rank_tokens(), std::ceil(even.max_rank_tokens() - 1e-9)) << "trial " << trial;
    // The same inputs give the same routing.
    auto again = PlanStepQuotas(p, *load, topo, cost, {});
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(r->sent_tokens, again->sent_tokens);
  }
}

// Shares are the routing at the finest grain the engine needs: they add up to each source's
// traffic per expert, to each copy's quota, and to the traffic matrix between ranks.
TEST(PlanStepQuotasTest, SharesAddUpToTrafficQuotasAndSentTokens) {
  std::mt19937 rng(11);
  const Topology topo = MakeTopology(2, 4);
  const CostModel cost(topo, SmallExperts());
  for (int trial = 0; trial < 100; ++trial) {
    RandomCase c = MakeRandomCase(rng);
    const int num_experts = c.placement.num_experts();
    const Placement& p = c.placement;
    const std::vector<double>& traffic = c.load.traffic;
    const StepLoad* load = &c.load;
    QuotaPlanOptions options;
    options.transient_per_rank = trial % 2;
    options.record_shares = true;
    auto r = PlanStepQuotas(p, *load, topo, cost, options);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const int num_slots = p.num_slots();
    std::vector<double> per_source(8 * num_experts, 0.0);
    std::vector<double> per_copy(num_slots + r->transients.size(), 0.0);
    std::vector<double> sent(64, 0.0);
    for (const CopyShare& share : r->shares) {
      ASSERT_GT(share.tokens, 0.0);
      ASSERT_GE(share.copy, 0);
      ASSERT_LT(share.copy, static_cast<int>(per_copy.size()));
      const int expert = share.copy < num_slots ? p.expert_at(share.copy)
                                                : r->transients[share.copy - num_slots].expert;
      ASSERT_EQ(expert, share.expert) << "a share names a copy of another expert";
      const int rank = share.copy < num_slots ? p.rank_of_slot(share.copy)
                                              : r->transients[share.copy - num_slots].rank;
      per_source[share.source * num_experts + share.expert] += share.tokens;
      per_copy[share.copy] += share.tokens;
      sent[share.source * 8 + rank] += share.tokens;
    }
    EXPECT_EQ(per_source, traffic) << "trial " << trial;
    for (int c = 0; c < num_slots; ++c) EXPECT_DOUBLE_EQ(per_copy[c], r->slot_tokens[c]);
    for (size_t i = 0; i < r->transients.size(); ++i) {
      EXPECT_DOUBLE_EQ(per_copy[num_slots + i], r->transient_tokens[i]);
    }
    for (int i = 0; i < 64; ++i) EXPECT_DOUBLE_EQ(sent[i], r->sent_tokens[i]) << "trial " << trial;
    // Without record_shares the routing is the same and carries no shares.
    options.record_shares = false;
    auto plain = PlanStepQuotas(p, *load, topo, cost, options);
    ASSERT_TRUE(plain.ok());
    EXPECT_TRUE(plain->shares.empty());
    EXPECT_EQ(plain->slot_tokens, r->slot_tokens);
  }
}

TEST(PlanStepQuotasTest, FractionalLoadsKeepTheirTotals) {
  Placement p = MakePlacement(3, 2, {0, 1, 0, 2});
  auto load = StepLoad::FromTraffic(2, 3, {0.3, 2.6, 0.1, 1.7, 0.2, 3.9});
  ASSERT_TRUE(load.ok());
  const Topology topo = MakeTopology(1, 2);
  const CostModel cost(topo, CostModelConfig{});
  auto r = PlanStepQuotas(p, *load, topo, cost, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectConsistent(p, *load, *r);
}

}  // namespace
}  // namespace keel
