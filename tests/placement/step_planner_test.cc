// StepPlanner: one planner reused over changing placements, loads and options gives what a fresh
// PlanStepQuotas gives, bit for bit; shares_of_rank keeps exactly one rank's shares; the fast
// path gives the ordered routing; the routing's price is the cost model's; the all-to-all matrix
// is optional; integer counts give the routing of the same values as doubles; bad input is
// named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "placement/cost_model.h"
#include "placement/routing.h"
#include "placement/step_planner.h"
#include "tests/common/test_util.h"

namespace keel {
namespace {

struct Case {
  Placement placement;
  StepLoad load;
  std::vector<double> by_expert;  // load.traffic transposed
};

using testing::MakeTopology;

// Small experts: cheap to copy, so that transient replicas pay and get tried.
CostModelConfig SmallExperts() {
  CostModelConfig config;
  config.hidden_size = 1024;
  config.expert_ffn_size = 512;
  config.expert_tflops = 20.0;
  return config;
}

std::vector<double> ByExpert(const StepLoad& load) {
  std::vector<double> by_expert(load.traffic.size());
  for (int s = 0; s < load.num_sources; ++s) {
    for (int e = 0; e < load.num_experts; ++e) {
      by_expert[static_cast<size_t>(e) * load.num_sources + s] = load.at(s, e);
    }
  }
  return by_expert;
}

// A random placement of `num_experts` experts (each at least once, extra copies anywhere, some
// slots empty) and a skewed load from `num_sources` sources, whole or fractional counts.
Case RandomCase(std::mt19937& rng, int num_ranks, int slots_per_rank, int num_experts,
                int num_sources, bool fractional) {
  const int num_slots = num_ranks * slots_per_rank;
  EXPECT_LE(num_experts, num_slots);
  std::vector<int> phy2log(num_slots, kEmptySlot);
  std::vector<int> order(num_slots);
  for (int i = 0; i < num_slots; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (int e = 0; e < num_experts; ++e) phy2log[order[e]] = e;
  for (int i = num_experts; i < num_slots; ++i) {
    if (rng() % 4 != 0) phy2log[order[i]] = static_cast<int>(rng() % num_experts);
  }
  Placement placement = Placement::Create(num_experts, num_ranks, phy2log).value();
  std::vector<double> weight(num_experts);
  for (double& w : weight) w = std::pow((rng() % 1000 + 1) / 1000.0, 3);
  std::vector<double> traffic(static_cast<size_t>(num_sources) * num_experts);
  for (double& t : traffic) {
    const int e = static_cast<int>(&t - traffic.data()) % num_experts;
    const double v = rng() % 8 == 0 ? 0.0 : weight[e] * 400 * ((rng() % 100) / 50.0);
    t = fractional ? v * 0.37 : std::round(v);
  }
  StepLoad load = StepLoad::FromTraffic(num_sources, num_experts, traffic).value();
  std::vector<double> by_expert = ByExpert(load);
  return {std::move(placement), std::move(load), std::move(by_expert)};
}

// Random options: up to `max_transient` transient slots per rank, and shares recorded or not,
// every one or those of `rank`.
QuotaPlanOptions RandomOptions(std::mt19937& rng, int max_transient, int rank) {
  QuotaPlanOptions options;
  options.transient_per_rank = static_cast<int>(rng() % (max_transient + 1));
  options.record_shares = rng() % 2 == 0;
  options.shares_of_rank = options.record_shares && rng() % 2 == 0 ? rank : -1;
  return options;
}

void ExpectSameRouting(const StepRouting& a, const StepRouting& b) {
  EXPECT_EQ(a.num_ranks, b.num_ranks);
  // Bit for bit: EXPECT_EQ on doubles would let 0.0 and -0.0 pass.
  auto same_bits = [](const std::vector<double>& x, const std::vector<double>& y) {
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0);
  };
  EXPECT_TRUE(same_bits(a.rank_tokens, b.rank_tokens));
  EXPECT_TRUE(same_bits(a.sent_tokens, b.sent_tokens));
  EXPECT_TRUE(same_bits(a.slot_tokens, b.slot_tokens));
  EXPECT_TRUE(same_bits(a.transient_tokens, b.transient_tokens));
  EXPECT_EQ(std::memcmp(&a.predicted_seconds, &b.predicted_seconds, sizeof(double)), 0);
  ASSERT_EQ(a.transients.size(), b.transients.size());
  for (size_t i = 0; i < a.transients.size(); ++i) {
    EXPECT_EQ(a.transients[i].expert, b.transients[i].expert);
    EXPECT_EQ(a.transients[i].rank, b.transients[i].rank);
    EXPECT_EQ(a.transients[i].source_rank, b.transients[i].source_rank);
  }
  ASSERT_EQ(a.shares.size(), b.shares.size());
  for (size_t i = 0; i < a.shares.size(); ++i) {
    EXPECT_EQ(a.shares[i].source, b.shares[i].source);
    EXPECT_EQ(a.shares[i].expert, b.shares[i].expert);
    EXPECT_EQ(a.shares[i].copy, b.shares[i].copy);
    EXPECT_EQ(std::memcmp(&a.shares[i].tokens, &b.shares[i].tokens, sizeof(double)), 0);
  }
}

// One planner kept across steps whose placement, load shape and options all change: nothing of
// an earlier step may leak into a later one.
TEST(StepPlannerTest, ReusedPlannerMatchesFreshPlans) {
  std::mt19937 rng(11);
  const Topology topology = MakeTopology(2, 4);
  const CostModel cost(topology, SmallExperts());
  StepPlanner planner(topology, cost);
  StepRouting routing;
  int transients = 0;
  for (int step = 0; step < 120; ++step) {
    // Every few steps a new placement; the sources are sometimes more than the ranks.
    const int num_sources = step % 5 == 4 ? 8 * 2 + 3 : 8;
    const int num_experts = 6 + static_cast<int>(rng() % 18);  // at most the 24 slots
    Case c = RandomCase(rng, 8, 3, num_experts, num_sources, step % 3 == 2);
    QuotaPlanOptions options;
    options.transient_per_rank = static_cast<int>(rng() % 3);
    options.record_shares = rng() % 2 == 0;
    const auto fresh = PlanStepQuotas(c.placement, c.load, topology, cost, options);
    ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
    // The same placement and load twice in a row: the second call runs on kept buffers.
    for (int repeat = 0; repeat < 2; ++repeat) {
      ASSERT_TRUE(planner.Plan(c.placement, num_sources, c.by_expert, options, routing).ok());
      SCOPED_TRACE("step " + std::to_string(step) + " repeat " + std::to_string(repeat));
      ExpectSameRouting(routing, fresh.value());
    }
    transients += static_cast<int>(routing.transients.size());
  }
  EXPECT_GT(transients, 0) << "no case tried a transient replica";
}

// shares_of_rank r keeps exactly the shares that rank r sends or receives, in the full list's
// order, for whole and fractional counts, with and without the all-to-all matrix; the rest of the
// routing does not change. Six ranks take the general path; eight and twelve (nodes of four and
// of six ranks) take the fast path with whole counts from one source per rank.
TEST(StepPlannerTest, SharesOfRankAreThatRanksSubset) {
  std::mt19937 rng(5);
  for (const auto& [nodes, per_node] : {std::pair{2, 3}, std::pair{2, 4}, std::pair{2, 6}}) {
    const Topology topology = MakeTopology(nodes, per_node);
    const int num_ranks = nodes * per_node;
    for (const CostModelConfig& config : {CostModelConfig{}, SmallExperts()}) {
      const CostModel cost(topology, config);
      StepPlanner planner(topology, cost);
      for (int trial = 0; trial < 40; ++trial) {
        Case c = RandomCase(rng, num_ranks, 3, 5 + static_cast<int>(rng() % 12),
                            trial % 4 == 3 ? 2 * num_ranks + 1 : num_ranks, trial % 2 == 1);
        QuotaPlanOptions all;
        all.record_shares = true;
        all.transient_per_rank = trial % 3;
        all.sent_tokens = trial / 2 % 2 == 0;
        StepRouting full;
        ASSERT_TRUE(planner.Plan(c.placement, c.load.num_sources, c.by_expert, all, full).ok());
        for (int r = 0; r < num_ranks; ++r) {
          QuotaPlanOptions mine = all;
          mine.shares_of_rank = r;
          StepRouting part;
          ASSERT_TRUE(planner.Plan(c.placement, c.load.num_sources, c.by_expert, mine, part).ok());
          StepRouting expected = full;
          expected.shares.clear();
          for (const CopyShare& share : full.shares) {
            const int copy_rank = share.copy < c.placement.num_slots()
                                      ? c.placement.rank_of_slot(share.copy)
                                      : full.transients[share.copy - c.placement.num_slots()].rank;
            if (share.source == r || copy_rank == r) expected.shares.push_back(share);
          }
          SCOPED_TRACE("ranks " + std::to_string(num_ranks) + " trial " + std::to_string(trial) +
                       " rank " + std::to_string(r));
          EXPECT_LT(expected.shares.size(), full.shares.size());
          ExpectSameRouting(part, expected);
        }
      }
    }
  }
}

// With whole token counts, candidates for transient replicas are priced on a routing patched
// from the one kept, and the shares are recorded afresh for the routing chosen. Both must describe
// the same routing: the shares add up to the all-to-all matrix, the copies' tokens and the ranks'
// loads exactly (every sum of whole counts is exact), and those loads are an optimal split.
TEST(StepPlannerTest, RoutingAgreesWithItsShares) {
  std::mt19937 rng(23);
  const Topology topology = MakeTopology(2, 4);
  const CostModel cost(topology, SmallExperts());
  StepPlanner planner(topology, cost);
  StepRouting routing;
  int with_transients = 0;
  for (int trial = 0; trial < 200; ++trial) {
    Case c = RandomCase(rng, 8, 3, 8 + static_cast<int>(rng() % 14), 8, /*fractional=*/false);
    QuotaPlanOptions options;
    options.transient_per_rank = 1 + static_cast<int>(rng() % 3);
    options.record_shares = true;
    ASSERT_TRUE(planner.Plan(c.placement, 8, c.by_expert, options, routing).ok());
    if (!routing.transients.empty()) ++with_transients;
    const int num_slots = c.placement.num_slots();
    std::vector<double> sent(64, 0.0), rank(8, 0.0),
        copy(num_slots + routing.transients.size(), 0.0);
    for (const CopyShare& share : routing.shares) {
      const int to = share.copy < num_slots ? c.placement.rank_of_slot(share.copy)
                                            : routing.transients[share.copy - num_slots].rank;
      sent[share.source * 8 + to] += share.tokens;
      rank[to] += share.tokens;
      copy[share.copy] += share.tokens;
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    EXPECT_EQ(sent, routing.sent_tokens);
    EXPECT_EQ(rank, routing.rank_tokens);
    EXPECT_EQ(std::vector<double>(copy.begin(), copy.begin() + num_slots), routing.slot_tokens);
    EXPECT_EQ(std::vector<double>(copy.begin() + num_slots, copy.end()), routing.transient_tokens);
    // And the ranks' loads are an optimal split for the copies chosen.
    std::vector<long long> tokens(c.load.num_experts);
    const std::vector<double> totals = c.load.ExpertTotals();
    for (int e = 0; e < c.load.num_experts; ++e) tokens[e] = std::llround(totals[e]);
    const QuotaSplit optimal = SplitQuotas(c.placement, tokens, routing.transients);
    EXPECT_EQ(*std::max_element(rank.begin(), rank.end()),
              static_cast<double>(optimal.max_rank_tokens));
  }
  EXPECT_GT(with_transients, 10);
}

// Case c with `extra` more sources that send nothing: the same routing, as sources without tokens
// send no share and add only zeros. With whole counts and one source per rank in quads the
// planner takes its fast path (one pass over the traffic, shares found per copy, candidates
// patched into the routing kept and priced from link sums); with more sources than ranks it takes
// none of it, so this compares each shortcut with the ordered arithmetic it replaces, and the
// link sums' prices with the cost model's pass over the whole all-to-all matrix.
Case WithSilentSources(const Case& c, int extra) {
  const int num_sources = c.load.num_sources + extra;
  std::vector<double> traffic(static_cast<size_t>(num_sources) * c.load.num_experts, 0.0);
  std::copy(c.load.traffic.begin(), c.load.traffic.end(), traffic.begin());
  StepLoad load = StepLoad::FromTraffic(num_sources, c.load.num_experts, traffic).value();
  std::vector<double> by_expert = ByExpert(load);
  return {c.placement, std::move(load), std::move(by_expert)};
}

TEST(StepPlannerTest, ShortcutsGiveTheOrderedRouting) {
  std::mt19937 rng(41);
  int with_transients = 0;
  for (const auto& [nodes, per_node] :
       std::vector<std::pair<int, int>>{{1, 4}, {2, 4}, {1, 8}, {4, 4}, {2, 6}}) {
    const Topology topology = MakeTopology(nodes, per_node);
    const int num_ranks = nodes * per_node;
    const CostModel cost(topology, SmallExperts());
    StepPlanner quick(topology, cost);
    StepPlanner ordered(topology, cost);
    for (int trial = 0; trial < 60; ++trial) {
      const Case c = RandomCase(rng, num_ranks, 3, num_ranks + static_cast<int>(rng() % num_ranks),
                                num_ranks, /*fractional=*/trial % 5 == 4);
      const Case padded = WithSilentSources(c, num_ranks);
      const QuotaPlanOptions options = RandomOptions(rng, 3, 1);
      StepRouting fast, slow;
      ASSERT_TRUE(quick.Plan(c.placement, num_ranks, c.by_expert, options, fast).ok());
      ASSERT_TRUE(
          ordered.Plan(padded.placement, 2 * num_ranks, padded.by_expert, options, slow).ok());
      SCOPED_TRACE(std::to_string(num_ranks) + " ranks, trial " + std::to_string(trial));
      ExpectSameRouting(fast, slow);
      with_transients += fast.transients.empty() ? 0 : 1;
    }
  }
  EXPECT_GT(with_transients, 20);
}

// A later micro-batch of a step plans with the transients that earlier ones filled: they come
// first, in their order, count against their rank's room, take tokens like any copy, and the
// fast path gives the ordered path's routing with them too.
TEST(StepPlannerTest, FixedTransientsComeFirstAndFitTheRoom) {
  std::mt19937 rng(47);
  int kept_and_added = 0;
  for (const auto& [nodes, per_node] : std::vector<std::pair<int, int>>{{1, 4}, {2, 4}, {1, 8}}) {
    const Topology topology = MakeTopology(nodes, per_node);
    const int num_ranks = nodes * per_node;
    const CostModel cost(topology, SmallExperts());
    StepPlanner quick(topology, cost);
    StepPlanner ordered(topology, cost);
    for (int trial = 0; trial < 40; ++trial) {
      const Case first =
          RandomCase(rng, num_ranks, 3, num_ranks + static_cast<int>(rng() % num_ranks), num_ranks,
                     /*fractional=*/false);
      QuotaPlanOptions options = RandomOptions(rng, 2, 1);
      options.transient_per_rank = 2;
      StepRouting earlier;
      ASSERT_TRUE(quick.Plan(first.placement, num_ranks, first.by_expert, options, earlier).ok());
      // The next micro-batch: other tokens, the same placement.
      Case next = RandomCase(rng, num_ranks, 3, first.placement.num_experts(), num_ranks,
                             /*fractional=*/false);
      next = {first.placement, next.load, next.by_expert};
      const Case padded = WithSilentSources(next, num_ranks);
      options.fixed_transients = earlier.transients;
      StepRouting fast, slow;
      ASSERT_TRUE(quick.Plan(next.placement, num_ranks, next.by_expert, options, fast).ok());
      ASSERT_TRUE(
          ordered.Plan(padded.placement, 2 * num_ranks, padded.by_expert, options, slow).ok());
      SCOPED_TRACE(std::to_string(num_ranks) + " ranks, trial " + std::to_string(trial));
      ExpectSameRouting(fast, slow);
      ASSERT_GE(fast.transients.size(), earlier.transients.size());
      std::vector<int> on_rank(num_ranks, 0);
      for (size_t i = 0; i < fast.transients.size(); ++i) {
        const TransientReplica& t = fast.transients[i];
        if (i < earlier.transients.size()) {
          EXPECT_EQ(t.expert, earlier.transients[i].expert);
          EXPECT_EQ(t.rank, earlier.transients[i].rank);
        }
        const std::span<const int> holders = next.placement.copy_ranks(t.expert);
        EXPECT_EQ(std::count(holders.begin(), holders.end(), t.rank), 0);
        for (size_t j = 0; j < i; ++j) {
          EXPECT_FALSE(fast.transients[j].expert == t.expert && fast.transients[j].rank == t.rank);
        }
        EXPECT_LE(++on_rank[t.rank], options.transient_per_rank);
      }
      // Every token has a copy: the quotas add up to the load.
      double quotas = 0;
      for (double tokens : fast.slot_tokens) quotas += tokens;
      for (double tokens : fast.transient_tokens) quotas += tokens;
      double load = 0;
      for (double tokens : next.load.traffic) load += tokens;
      EXPECT_EQ(quotas, load);
      if (!earlier.transients.empty() && fast.transients.size() > earlier.transients.size()) {
        ++kept_and_added;
      }
    }
  }
  EXPECT_GT(kept_and_added, 5) << "no plan both kept and added transients: the test proves little";
}

// On the fast path a candidate transient whose price floor already misses is dropped unpriced.
// Near the break-even of a transient (found by bisection on the experts' FLOP/s, the ordered
// path deciding), the candidate's price and the kept one's differ in their last bits: a floor
// above the candidate's price would drop a transient that pays.
TEST(StepPlannerTest, PriceFloorDropsNoTransientThatPays) {
  std::mt19937 rng(43);
  int boundaries = 0;
  for (const auto& [nodes, per_node] : std::vector<std::pair<int, int>>{{4, 4}, {8, 4}}) {
    const Topology topology = MakeTopology(nodes, per_node);
    const int num_ranks = nodes * per_node;
    for (int trial = 0; trial < 16; ++trial) {
      const Case c = RandomCase(rng, num_ranks, 3, num_ranks + static_cast<int>(rng() % num_ranks),
                                num_ranks, /*fractional=*/false);
      const Case padded = WithSilentSources(c, num_ranks);
      const QuotaPlanOptions options{.transient_per_rank = 1};
      auto plan = [&](double tflops, bool fast) {
        CostModelConfig config = SmallExperts();
        config.expert_tflops = tflops;
        const CostModel cost(topology, config);
        StepPlanner planner(topology, cost);
        StepRouting routing;
        const Case& input = fast ? c : padded;
        EXPECT_TRUE(
            planner.Plan(input.placement, input.load.num_sources, input.by_expert, options, routing)
                .ok());
        return routing;
      };
      // Slow experts: more transients pay than for fast ones. Between the two, a candidate's
      // price crosses the kept one's where the number of transients kept changes.
      auto kept = [&](double tflops) { return plan(tflops, false).transients.size(); };
      double slow = 1e-3;
      double quick = 1e6;
      const size_t slow_kept = kept(slow);
      if (slow_kept == kept(quick)) continue;
      for (int step = 0; step < 200; ++step) {
        const double middle = slow + (quick - slow) / 2;
        if (middle == slow || middle == quick) break;
        (kept(middle) == slow_kept ? slow : quick) = middle;
      }
      ++boundaries;
      for (const double tflops : {slow, quick}) {
        SCOPED_TRACE(std::to_string(num_ranks) + " ranks, trial " + std::to_string(trial) +
                     ", tflops " + std::to_string(tflops));
        ExpectSameRouting(plan(tflops, true), plan(tflops, false));
      }
    }
  }
  EXPECT_GE(boundaries, 16);
}

// The price the planner gives its routing is the cost model's estimate of it, bit for bit: on the
// fast path it comes from link sums, off it from a pass over the whole all-to-all matrix.
TEST(StepPlannerTest, PredictedSecondsAreTheCostModels) {
  std::mt19937 rng(61);
  for (const auto& [nodes, per_node] :
       std::vector<std::pair<int, int>>{{1, 8}, {2, 4}, {4, 4}, {2, 6}}) {
    const Topology topology = MakeTopology(nodes, per_node);
    const int num_ranks = nodes * per_node;
    for (const CostModelConfig& config : {SmallExperts(), CostModelConfig{}}) {
      const CostModel cost(topology, config);
      StepPlanner planner(topology, cost);
      for (int trial = 0; trial < 30; ++trial) {
        const int num_sources = trial % 6 == 5 ? num_ranks + 3 : num_ranks;
        const Case c =
            RandomCase(rng, num_ranks, 3, num_ranks + static_cast<int>(rng() % num_ranks),
                       num_sources, /*fractional=*/trial % 5 == 4);
        QuotaPlanOptions options;
        options.transient_per_rank = static_cast<int>(rng() % 3);
        StepRouting routing;
        ASSERT_TRUE(planner.Plan(c.placement, num_sources, c.by_expert, options, routing).ok());
        const double expected =
            cost.EstimateWithSync(c.placement, routing, cost.ReplicaSyncSeconds(c.placement))
                .total_seconds();
        SCOPED_TRACE(std::to_string(num_ranks) + " ranks, trial " + std::to_string(trial));
        EXPECT_GT(routing.predicted_seconds, 0.0);
        EXPECT_EQ(std::memcmp(&routing.predicted_seconds, &expected, sizeof expected), 0)
            << routing.predicted_seconds << " vs " << expected;
      }
    }
  }
}

// Without the all-to-all matrix (as the engine plans) the routing is the same, sent_tokens left
// empty, whatever the counts and whichever path the planner takes; one planner switching between
// the two keeps nothing of one in the other.
TEST(StepPlannerTest, MatrixIsOptional) {
  std::mt19937 rng(57);
  const Topology topology = MakeTopology(2, 4);
  const CostModel cost(topology, SmallExperts());
  StepPlanner planner(topology, cost);
  int with_transients = 0;
  for (int trial = 0; trial < 80; ++trial) {
    // Mostly the fast path: whole counts from one source per rank.
    const int num_sources = trial % 4 == 3 ? 11 : 8;
    const Case c = RandomCase(rng, 8, 3, 8 + static_cast<int>(rng() % 14), num_sources,
                              /*fractional=*/trial % 5 == 4);
    QuotaPlanOptions options = RandomOptions(rng, 2, 3);
    StepRouting with, without;
    ASSERT_TRUE(planner.Plan(c.placement, num_sources, c.by_expert, options, with).ok());
    options.sent_tokens = false;
    ASSERT_TRUE(planner.Plan(c.placement, num_sources, c.by_expert, options, without).ok());
    SCOPED_TRACE("trial " + std::to_string(trial));
    EXPECT_TRUE(without.sent_tokens.empty());
    EXPECT_EQ(with.sent_tokens.size(), 64u);
    without.sent_tokens = with.sent_tokens;
    ExpectSameRouting(without, with);
    with_transients += with.transients.empty() ? 0 : 1;
  }
  EXPECT_GT(with_transients, 10);
}

// Many ranks and a few hot experts, the case where the search tries a transient per rank: the
// candidates that do not pay are taken back out of the kept routing, and each rebuild restores
// only the cells of the all-to-all matrix that the last one wrote. The matrix must still add
// up, source by source, to the traffic and, rank by rank, to the rank loads; the quotas to each
// expert's total; and a planner kept over steps whose traffic changes (rebuilding in buffers
// that held another step) must give what fresh plans give, bit for bit. Whole counts take the
// fast path (patched in place), fractional ones and more sources than ranks the general one.
TEST(StepPlannerTest, ManyRanksWithHotExpertsAddUp) {
  constexpr int kNodes = 64, kPerNode = 8, kRanks = kNodes * kPerNode;
  constexpr int kExperts = 64, kSlotsPerRank = 3;
  const Topology topology = MakeTopology(kNodes, kPerNode);
  const CostModel cost(topology, SmallExperts());
  // The static placement: expert e in slot e, every other slot empty.
  std::vector<int> phy2log(kRanks * kSlotsPerRank, kEmptySlot);
  for (int e = 0; e < kExperts; ++e) phy2log[e] = e;
  const Placement placement = Placement::Create(kExperts, kRanks, phy2log).value();
  QuotaPlanOptions options;
  options.transient_per_rank = 1;
  std::mt19937 rng(45);
  for (const bool fractional : {false, true}) {
    for (const int num_sources : {kRanks, kRanks + 3}) {
      StepPlanner planner(topology, cost);
      StepRouting routing;
      for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE("fractional " + std::to_string(fractional) + " sources " +
                     std::to_string(num_sources) + " step " + std::to_string(step));
        std::vector<double> traffic(static_cast<size_t>(num_sources) * kExperts, 0.0);
        for (int s = 0; s < num_sources; ++s) {
          for (const int hot : {3, 17, 40}) traffic[s * kExperts + hot] = 800 + rng() % 300;
          traffic[s * kExperts + rng() % kExperts] += fractional ? 0.25 : 1;
        }
        const StepLoad load = StepLoad::FromTraffic(num_sources, kExperts, traffic).value();
        const auto fresh = PlanStepQuotas(placement, load, topology, cost, options);
        ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
        ASSERT_TRUE(planner.Plan(placement, num_sources, ByExpert(load), options, routing).ok());
        ExpectSameRouting(routing, fresh.value());
        EXPECT_GT(routing.transients.size(), 100u);

        // Whole counts add up exactly; fractional ones within rounding.
        const double tolerance = fractional ? 1e-6 : 0.0;
        std::vector<double> sent(kRanks, 0.0), received(kRanks, 0.0);
        for (int s = 0; s < num_sources; ++s) {
          for (int e = 0; e < kExperts; ++e) sent[s % kRanks] += load.at(s, e);
        }
        for (int from = 0; from < kRanks; ++from) {
          double row = 0;
          for (int to = 0; to < kRanks; ++to) {
            const double tokens = routing.sent_tokens[static_cast<size_t>(from) * kRanks + to];
            ASSERT_GE(tokens, 0.0);
            row += tokens;
            received[to] += tokens;
          }
          ASSERT_NEAR(row, sent[from], tolerance) << "source rank " << from;
        }
        for (int rank = 0; rank < kRanks; ++rank) {
          ASSERT_NEAR(received[rank], routing.rank_tokens[rank], tolerance) << "rank " << rank;
        }
        std::vector<double> quotas(kExperts, 0.0);
        for (int slot = 0; slot < placement.num_slots(); ++slot) {
          if (placement.expert_at(slot) != kEmptySlot) {
            quotas[placement.expert_at(slot)] += routing.slot_tokens[slot];
          }
        }
        for (size_t i = 0; i < routing.transients.size(); ++i) {
          quotas[routing.transients[i].expert] += routing.transient_tokens[i];
        }
        const std::vector<double> totals = load.ExpertTotals();
        for (int e = 0; e < kExperts; ++e) {
          ASSERT_NEAR(quotas[e], totals[e], tolerance) << "expert " << e;
        }
      }
    }
  }
}

// Plan with 32-bit counts gives what Plan gives for the same values as doubles, bit for bit,
// whichever way it takes: its own pass (one source per rank, ranks a multiple of 8, no matrix;
// nodes of 8, 4, 6 and 12 ranks, 64 ranks and more for a block of 64), or the doubles (more
// sources than ranks, the matrix, ranks not a multiple of 8, counts too large for 32-bit sums).
// One planner switches between counts and doubles, and between placements, and keeps nothing of
// one call in the next.
TEST(StepPlannerTest, CountsGiveTheRoutingOfTheirDoubles) {
  std::mt19937 rng(71);
  const std::pair<int, int> shapes[] = {{2, 4}, {1, 8}, {2, 8}, {4, 6}, {2, 12}, {9, 8}, {1, 4}};
  int own_pass = 0;
  int with_transients = 0;
  for (const auto& [num_nodes, per_node] : shapes) {
    const Topology topology = MakeTopology(num_nodes, per_node);
    const CostModel cost(topology, SmallExperts());
    StepPlanner planner(topology, cost);
    const int num_ranks = num_nodes * per_node;
    for (int trial = 0; trial < 24; ++trial) {
      const int num_sources = trial % 6 == 5 ? num_ranks + 3 : num_ranks;
      const int num_experts = num_ranks + static_cast<int>(rng() % (2 * num_ranks));
      Case c = RandomCase(rng, num_ranks, 3, num_experts, num_sources, /*fractional=*/false);
      if (trial % 8 == 6) {
        // An expert whose total is beyond 32 bits.
        const size_t expert = rng() % num_experts;
        for (int s = 0; s < num_sources; ++s) c.by_expert[expert * num_sources + s] = 1 << 28;
      }
      QuotaPlanOptions options = RandomOptions(rng, 2, static_cast<int>(rng() % num_ranks));
      options.sent_tokens = trial % 4 == 3;
      const std::vector<std::int32_t> counts(c.by_expert.begin(), c.by_expert.end());
      // Counts after the last trial's doubles, doubles, and counts again on what the doubles
      // left: each must give the same routing.
      StepRouting from_doubles, from_counts, again;
      ASSERT_TRUE(planner.Plan(c.placement, num_sources, counts, options, from_counts).ok());
      ASSERT_TRUE(planner.Plan(c.placement, num_sources, c.by_expert, options, from_doubles).ok());
      ASSERT_TRUE(planner.Plan(c.placement, num_sources, counts, options, again).ok());
      SCOPED_TRACE(std::to_string(num_nodes) + " nodes of " + std::to_string(per_node) +
                   ", trial " + std::to_string(trial));
      ExpectSameRouting(from_counts, from_doubles);
      ExpectSameRouting(again, from_doubles);
      own_pass +=
          num_sources == num_ranks && num_ranks % 8 == 0 && !options.sent_tokens && trial % 8 != 6;
      with_transients += from_counts.transients.empty() ? 0 : 1;
    }
  }
  EXPECT_GT(own_pass, 60);
  EXPECT_GT(with_transients, 20);
}

// The status's message contains `expected`.
void ExpectError(const Status& status, const std::string& expected) {
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find(expected), std::string::npos) << status.ToString();
}

TEST(StepPlannerTest, BadInputIsNamed) {
  const Topology topology = MakeTopology(1, 2);
  const CostModel cost(topology, CostModelConfig{});
  StepPlanner planner(topology, cost);
  const Placement placement = Placement::Create(3, 2, {0, 1, 2, 0}).value();
  StepRouting routing;
  std::vector<double> by_expert = {1, 2, 3, 4, 5, 6};  // 3 experts x 2 sources
  ExpectError(planner.Plan(placement, 0, by_expert, {}, routing),
              "num_sources must be >= 1, got 0");
  ExpectError(planner.Plan(placement, 3, by_expert, {}, routing),
              "by_expert has 6 entries, expected 3 experts x 3 sources");
  by_expert[3] = -1;
  ExpectError(planner.Plan(placement, 2, by_expert, {}, routing),
              "by_expert[3] (expert 1, source 1) = -1.000000 is not a non-negative");
  by_expert[3] = 4;
  QuotaPlanOptions options;
  options.shares_of_rank = 2;
  ExpectError(planner.Plan(placement, 2, by_expert, options, routing),
              "shares_of_rank must be -1 or a rank below 2, got 2");
  options.shares_of_rank = -1;
  EXPECT_TRUE(planner.Plan(placement, 2, by_expert, options, routing).ok());
  EXPECT_DOUBLE_EQ(routing.rank_tokens[0] + routing.rank_tokens[1], 21.0);
  // Rank 0 holds experts 0 and 1, rank 1 experts 2 and 0.
  const std::vector<TransientReplica> on_holder = {{1, 1, 0}, {0, 1, 0}};
  options.transient_per_rank = 2;
  options.fixed_transients = on_holder;
  ExpectError(planner.Plan(placement, 2, by_expert, options, routing),
              "fixed_transients[1]: rank 1 already holds a copy of expert 0");
  const std::vector<TransientReplica> twice = {{1, 1, 0}, {1, 1, 0}};
  options.fixed_transients = twice;
  ExpectError(planner.Plan(placement, 2, by_expert, options, routing),
              "fixed_transients[1]: rank 1 already holds a copy of expert 1");
  const std::vector<TransientReplica> elsewhere = {{7, 1, 0}, {1, 1, 2}};
  options.fixed_transients = elsewhere;
  ExpectError(planner.Plan(placement, 2, by_expert, options, routing),
              "fixed_transients[0].expert = 7 is not in [0, 3)");
  options.fixed_transients = std::span(elsewhere).subspan(1);
  ExpectError(planner.Plan(placement, 2, by_expert, options, routing),
              "fixed_transients[0] names rank 2, not in [0, 2)");
  const std::vector<TransientReplica> one = {{1, 1, 0}};
  options.fixed_transients = one;
  options.transient_per_rank = 0;
  ExpectError(planner.Plan(placement, 2, by_expert, options, routing),
              "fixed_transients put 1 on rank 1, which has room for 0 transients");
  options.transient_per_rank = 1;
  ASSERT_TRUE(planner.Plan(placement, 2, by_expert, options, routing).ok());
  ASSERT_EQ(routing.transients.size(), 1u);
  EXPECT_EQ(routing.transients[0].expert, 1);
  options = {};

  std::vector<std::int32_t> counts = {1, 2, 3, 4, 5, 6};
  ExpectError(planner.Plan(placement, 3, counts, {}, routing),
              "counts has 6 entries, expected 3 experts x 3 sources");
  counts[3] = -1;
  ExpectError(planner.Plan(placement, 2, counts, {}, routing),
              "counts[3] (expert 1, source 1) = -1 is negative");
  // Eight ranks, one source each, no matrix: the planner's own pass over the counts.
  const Topology eight = MakeTopology(1, 8);
  const CostModel eight_cost(eight, CostModelConfig{});
  StepPlanner eight_planner(eight, eight_cost);
  const Placement one_each = Placement::Create(2, 8, {0, 1, 0, 1, 0, 1, 0, 1}).value();
  counts.assign(16, 2);
  counts[9] = -5;
  options.sent_tokens = false;
  ExpectError(eight_planner.Plan(one_each, 8, counts, options, routing),
              "counts[9] (expert 1, source 1) = -5 is negative");
  counts[9] = 5;
  ASSERT_TRUE(eight_planner.Plan(one_each, 8, counts, options, routing).ok());
  EXPECT_DOUBLE_EQ(routing.max_rank_tokens() * 8, 35.0 + 5.0);

  // Entries each within range whose total is not.
  by_expert = {6e14, 6e14, 1, 2, 3, 4};
  ExpectError(planner.Plan(placement, 2, by_expert, {}, routing),
              "expert 0 receives 1200000000000000.000000 tokens in all, beyond 1e15");
}

// -0.0 is a zero count: it sets the sign bit the planner's fast scan looks at, and must still be
// planned as 0.0 is, on both the fast path (one source per rank) and the general one.
TEST(StepPlannerTest, NegativeZeroIsAZeroCount) {
  for (int num_sources : {8, 3}) {
    const Topology topology = MakeTopology(1, 8);
    const CostModel cost(topology, SmallExperts());
    StepPlanner planner(topology, cost);
    const Placement placement = Placement::Create(2, 8, {0, 1, 0, 1, 0, 1, 0, 1}).value();
    std::vector<double> zero(2 * static_cast<size_t>(num_sources), 7.0);
    zero[1] = 0.0;
    std::vector<double> negative_zero = zero;
    negative_zero[1] = -0.0;
    QuotaPlanOptions options;
    options.transient_per_rank = 1;
    StepRouting from_zero, from_negative_zero;
    ASSERT_TRUE(planner.Plan(placement, num_sources, zero, options, from_zero).ok());
    const Status status =
        planner.Plan(placement, num_sources, negative_zero, options, from_negative_zero);
    ASSERT_TRUE(status.ok()) << status.ToString();
    SCOPED_TRACE(std::to_string(num_sources) + " sources");
    ExpectSameRouting(from_negative_zero, from_zero);
  }
}

}  // namespace
}  // namespace keel
