// Sequence planner: hand-checked small batches, and properties on random batches (the token
// bound holds, the plan is never worse than no migration by the cost model's measure, the same
// input gives the same plan).
#include "placement/sequence_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace keel {
namespace {

CostModelConfig SmallModel() {
  CostModelConfig config;
  config.expert_tflops = 1.0;
  config.hidden_size = 1024;
  config.expert_ffn_size = 1024;
  config.dtype_bytes = 2;
  return config;
}

Topology MakeTopology(int nodes, int per_node) {
  TopologyConfig config;
  config.num_nodes = nodes;
  config.gpus_per_node = per_node;
  config.intra_node_gb_per_s = 100;
  config.inter_node_gb_per_s = 10;
  return Topology::Create(config).value();
}

// A sequence of `tokens` tokens on `origin` whose rows go to the experts listed (one layer).
SequenceTraffic Sequence(int origin, int64_t tokens, int experts,
                         std::vector<std::pair<int, double>> rows) {
  SequenceTraffic sequence;
  sequence.origin_rank = origin;
  sequence.tokens = tokens;
  sequence.expert_rows.assign(experts, 0.0);
  for (const auto& [expert, count] : rows) sequence.expert_rows[expert] = count;
  return sequence;
}

TEST(SequencePlannerTest, SwapsTwoSequencesThatSitOnEachOthersExperts) {
  // Two ranks, expert 0 on rank 0 and expert 1 on rank 1. Each sequence routes only to the
  // other rank's expert; the token bound (1.0) forbids a lone move, a swap makes every row local.
  CostModel cost(MakeTopology(1, 2), SmallModel());
  const std::vector<Placement> layers = {Placement::Contiguous(2, 2, 1).value()};
  const std::vector<SequenceTraffic> batch = {Sequence(0, 100, 2, {{1, 200}}),
                                              Sequence(1, 100, 2, {{0, 200}})};
  SequencePlanOptions options;
  options.max_token_imbalance = 1.0;
  const SequencePlan plan = PlanSequences(layers, batch, cost, options).value();
  EXPECT_TRUE(plan.used);
  EXPECT_EQ(plan.rank, (std::vector<int>{1, 0}));
  EXPECT_DOUBLE_EQ(plan.remote_rows_before, 400);
  EXPECT_DOUBLE_EQ(plan.remote_rows_after, 0);
  EXPECT_EQ(plan.moved_sequences, 2);
  EXPECT_DOUBLE_EQ(plan.moved_bytes, 2 * 100 * cost.token_row_bytes());
  EXPECT_EQ(plan.rank_tokens, (std::vector<int64_t>{100, 100}));
  EXPECT_LT(plan.seconds_after, plan.seconds_before);
  // Each direction carries one sequence of 100 rows of 2 KiB, there and back over one link.
  EXPECT_DOUBLE_EQ(plan.move_seconds, 2 * 100 * cost.token_row_bytes() / 100e9);
}

TEST(SequencePlannerTest, TheTokenBoundStopsALoneMove) {
  CostModel cost(MakeTopology(1, 2), SmallModel());
  const std::vector<Placement> layers = {Placement::Contiguous(2, 2, 1).value()};
  // Both sequences want rank 1; with a bound of 1.0 neither may go without the other leaving.
  const std::vector<SequenceTraffic> batch = {Sequence(0, 100, 2, {{1, 200}}),
                                              Sequence(1, 100, 2, {{1, 200}})};
  SequencePlanOptions options;
  options.max_token_imbalance = 1.0;
  SequencePlan plan = PlanSequences(layers, batch, cost, options).value();
  EXPECT_FALSE(plan.used);
  EXPECT_EQ(plan.rank, (std::vector<int>{0, 1}));
  // With room for both on rank 1, sequence 0 moves.
  options.max_token_imbalance = 2.0;
  plan = PlanSequences(layers, batch, cost, options).value();
  EXPECT_TRUE(plan.used);
  EXPECT_EQ(plan.rank, (std::vector<int>{1, 1}));
  EXPECT_EQ(plan.rank_tokens, (std::vector<int64_t>{0, 200}));
}

TEST(SequencePlannerTest, AMoveDearerThanItsRowsIsNotMade) {
  CostModel cost(MakeTopology(1, 2), SmallModel());
  const std::vector<Placement> layers = {Placement::Contiguous(2, 2, 1).value()};
  // 1 row to the other rank for a sequence of 100 tokens: the move (100 rows each way) costs
  // far more than the 4 passes of one row it saves.
  const std::vector<SequenceTraffic> batch = {Sequence(0, 100, 2, {{0, 99}, {1, 1}}),
                                              Sequence(1, 100, 2, {{1, 99}, {0, 1}})};
  const SequencePlan plan = PlanSequences(layers, batch, cost, {}).value();
  EXPECT_FALSE(plan.used);
  EXPECT_EQ(plan.moved_sequences, 0);
  EXPECT_DOUBLE_EQ(plan.seconds_after, plan.seconds_before);
}

TEST(SequencePlannerTest, CrossNodeRowsWeighMoreThanIntraNodeRows) {
  // 2 nodes x 2 ranks, one expert per rank, every rank full (bound 1.0: only swaps). The
  // sequence on rank 0 sends 1000 rows to expert 1 (rank 1, its node) and 60 to expert 2 (rank 2,
  // the other node); the other sequences keep their few rows local. The intra-node link is the
  // slowest (1000 rows at 100 GB/s against 60 at 10 GB/s).
  CostModel cost(MakeTopology(2, 2), SmallModel());
  const std::vector<Placement> layers = {Placement::Contiguous(4, 4, 1).value()};
  std::vector<SequenceTraffic> batch = {Sequence(0, 10, 4, {{1, 1000}, {2, 60}}),
                                        Sequence(1, 10, 4, {{1, 5}}), Sequence(2, 10, 4, {{2, 5}}),
                                        Sequence(3, 10, 4, {{3, 5}})};
  SequencePlanOptions options;
  options.max_token_imbalance = 1.0;
  const SequencePlan plan = PlanSequences(layers, batch, cost, options).value();
  // Sequence 0 swaps with sequence 1 (rank 1): its 1000 rows become local and the 60 still
  // cross; going to rank 2 instead would make 1000 rows cross, 10 times dearer per byte.
  ASSERT_TRUE(plan.used);
  EXPECT_EQ(plan.rank[0], 1);
  EXPECT_EQ(plan.rank[1], 0);
  EXPECT_DOUBLE_EQ(plan.cross_node_rows_before, 60);
  EXPECT_DOUBLE_EQ(plan.cross_node_rows_after, 60);
  EXPECT_DOUBLE_EQ(plan.remote_rows_after, 60 + 5);
}

TEST(SequencePlannerTest, RowsOfAnExpertWithoutALocalCopyStayOnTheNode) {
  // Expert 0 has copies on ranks 1 (node 0) and 2 (node 1); a sequence on rank 0 sends all its
  // rows of expert 0 to rank 1: none cross nodes.
  CostModel cost(MakeTopology(2, 2), SmallModel());
  // slots: rank 0 {1}, rank 1 {0}, rank 2 {0}, rank 3 {2}
  const std::vector<Placement> layers = {Placement::Create(3, 4, {1, 0, 0, 2}).value()};
  const std::vector<SequenceTraffic> batch = {Sequence(0, 1000, 3, {{0, 8}})};
  const SequencePlan plan = PlanSequences(layers, batch, cost, {}).value();
  EXPECT_DOUBLE_EQ(plan.cross_node_rows_before, 0);
  EXPECT_DOUBLE_EQ(plan.remote_rows_before, 8);
}

TEST(SequencePlannerTest, NamesTheBadField) {
  CostModel cost(MakeTopology(1, 2), SmallModel());
  const std::vector<Placement> layers = {Placement::Contiguous(2, 2, 1).value()};
  std::vector<SequenceTraffic> batch = {Sequence(0, 10, 2, {{0, 1}})};
  batch[0].origin_rank = 2;
  EXPECT_NE(PlanSequences(layers, batch, cost).status().message().find("origin_rank 2"),
            std::string::npos);
  batch[0].origin_rank = 0;
  batch[0].expert_rows.push_back(1);
  EXPECT_NE(PlanSequences(layers, batch, cost).status().message().find("expert_rows has 3"),
            std::string::npos);
  batch[0].expert_rows = {1, -1};
  EXPECT_NE(PlanSequences(layers, batch, cost).status().message().find("expert_rows[1]"),
            std::string::npos);
  batch[0].expert_rows = {1, 1};
  SequencePlanOptions options;
  options.max_token_imbalance = 0.5;
  EXPECT_NE(
      PlanSequences(layers, batch, cost, options).status().message().find("max_token_imbalance"),
      std::string::npos);
  EXPECT_FALSE(PlanSequences({}, batch, cost).ok());
}

// A random batch: `per_rank` sequences per rank of random length, each preferring a few experts
// per layer (affinity), on a random placement with some replicas.
struct RandomCase {
  std::vector<Placement> layers;
  std::vector<SequenceTraffic> batch;
};

RandomCase MakeRandomCase(std::mt19937_64& rng, int ranks, int experts, int num_layers,
                          int per_rank) {
  RandomCase c;
  const int slots_per_rank = (experts + ranks - 1) / ranks + 1;
  for (int l = 0; l < num_layers; ++l) {
    std::vector<int> phy2log(static_cast<size_t>(ranks) * slots_per_rank, kEmptySlot);
    std::vector<int> order(experts);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int i = 0; i < experts; ++i) {
      phy2log[static_cast<size_t>(i % ranks) * slots_per_rank + i / ranks] = order[i];
    }
    for (int g = 0; g < ranks; ++g) {
      const int e = static_cast<int>(rng() % experts);
      int& last = phy2log[static_cast<size_t>(g) * slots_per_rank + slots_per_rank - 1];
      bool held = false;
      for (int s = 0; s < slots_per_rank - 1; ++s) {
        held = held || phy2log[static_cast<size_t>(g) * slots_per_rank + s] == e;
      }
      if (!held) last = e;
    }
    c.layers.push_back(Placement::Create(experts, ranks, phy2log).value());
  }
  for (int g = 0; g < ranks; ++g) {
    for (int i = 0; i < per_rank; ++i) {
      SequenceTraffic sequence;
      sequence.origin_rank = g;
      sequence.tokens = 16 + static_cast<int64_t>(rng() % 200);
      sequence.expert_rows.assign(static_cast<size_t>(num_layers) * experts, 0.0);
      for (int l = 0; l < num_layers; ++l) {
        const int favourite = static_cast<int>(rng() % experts);
        for (int64_t t = 0; t < sequence.tokens * 2; ++t) {
          const int e = rng() % 3 != 0 ? (favourite + static_cast<int>(rng() % 3)) % experts
                                       : static_cast<int>(rng() % experts);
          sequence.expert_rows[static_cast<size_t>(l) * experts + e] += 1;
        }
      }
      c.batch.push_back(std::move(sequence));
    }
  }
  return c;
}

TEST(SequencePlannerTest, RandomBatchesKeepTheBoundAndNeverLose) {
  std::mt19937_64 rng(7);
  int used = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int nodes = 1 + trial % 3;
    const int per_node = 2 + trial % 4;
    const int ranks = nodes * per_node;
    const int experts = ranks * (1 + trial % 3);
    CostModel cost(MakeTopology(nodes, per_node), SmallModel());
    const RandomCase c = MakeRandomCase(rng, ranks, experts, 1 + trial % 4, 1 + trial % 5);
    SequencePlanOptions options;
    options.max_token_imbalance = 1.0 + 0.05 * (trial % 5);
    const SequencePlan plan = PlanSequences(c.layers, c.batch, cost, options).value();
    SCOPED_TRACE("trial " + std::to_string(trial));

    // The token bound: no rank above max(bound, what it held before).
    std::vector<int64_t> before(ranks, 0);
    std::vector<int64_t> after(ranks, 0);
    int64_t total = 0;
    for (size_t s = 0; s < c.batch.size(); ++s) {
      before[c.batch[s].origin_rank] += c.batch[s].tokens;
      after[plan.rank[s]] += c.batch[s].tokens;
      total += c.batch[s].tokens;
    }
    EXPECT_EQ(after, plan.rank_tokens);
    const double bound = options.max_token_imbalance * static_cast<double>(total) / ranks;
    for (int g = 0; g < ranks; ++g) {
      EXPECT_LE(static_cast<double>(after[g]),
                std::max(std::floor(bound), static_cast<double>(before[g])));
    }
    // Never worse than no migration, by the cost model's measure; unused means unmoved.
    EXPECT_LE(plan.seconds_after, plan.seconds_before);
    if (plan.used) {
      EXPECT_LT(plan.seconds_after, plan.seconds_before);
      ++used;
    } else {
      for (size_t s = 0; s < c.batch.size(); ++s) EXPECT_EQ(plan.rank[s], c.batch[s].origin_rank);
      EXPECT_EQ(plan.moved_sequences, 0);
    }
    int moved = 0;
    for (size_t s = 0; s < c.batch.size(); ++s) moved += plan.rank[s] != c.batch[s].origin_rank;
    EXPECT_EQ(moved, plan.moved_sequences);
    // Deterministic.
    const SequencePlan again = PlanSequences(c.layers, c.batch, cost, options).value();
    EXPECT_EQ(again.rank, plan.rank);
    EXPECT_EQ(again.seconds_after, plan.seconds_after);
  }
  // Sequences with affinity on several ranks should often be worth moving.
  EXPECT_GT(used, 10);
}

TEST(ExpertGroupingTest, ExpertsOfTheSameSequencesShareANode) {
  // 2 nodes of one rank, 4 experts, 2 layers. Sequences of kind A use experts 0 and 2 in both
  // layers, kind B experts 1 and 3; statically {0, 1} share node 0 and every sequence sends half
  // its rows across nodes. Grouped, {0, 2} and {1, 3} share a node.
  const Topology topology = MakeTopology(2, 1);
  std::vector<SequenceTraffic> history;
  for (int kind = 0; kind < 2; ++kind) {
    for (int i = 0; i < 3; ++i) {
      SequenceTraffic sequence;
      sequence.tokens = 10;
      sequence.expert_rows.assign(8, 0.0);
      for (int l = 0; l < 2; ++l) {
        sequence.expert_rows[l * 4 + kind] = 10;
        sequence.expert_rows[l * 4 + kind + 2] = 10;
      }
      history.push_back(sequence);
    }
  }
  const std::vector<Placement> grouped =
      GroupExpertsBySequences(history, 2, 4, topology, 2).value();
  ASSERT_EQ(grouped.size(), 2u);
  for (const Placement& placement : grouped) {
    EXPECT_EQ(placement.copy_ranks(0)[0], placement.copy_ranks(2)[0]);
    EXPECT_EQ(placement.copy_ranks(1)[0], placement.copy_ranks(3)[0]);
    EXPECT_NE(placement.copy_ranks(0)[0], placement.copy_ranks(1)[0]);
    for (int e = 0; e < 4; ++e) EXPECT_EQ(placement.logcnt()[e], 1);
  }
  // The sequence planner then keeps every row on the sequence's node once the sequences move.
  CostModel cost(topology, SmallModel());
  for (size_t s = 0; s < history.size(); ++s) history[s].origin_rank = static_cast<int>(s % 2);
  SequencePlanOptions options;
  options.max_token_imbalance = 1.0;
  const SequencePlan plan = PlanSequences(grouped, history, cost, options).value();
  EXPECT_DOUBLE_EQ(plan.cross_node_rows_after, 0);
  EXPECT_GT(plan.cross_node_rows_before, 0);
}

TEST(ExpertGroupingTest, TheNodeLoadBoundHolds) {
  // All sequences use experts 0 and 1 only (statically on different nodes): grouping them on
  // one node would put every row there, beyond the bound, so nothing moves.
  const Topology topology = MakeTopology(2, 1);
  SequenceTraffic sequence;
  sequence.tokens = 10;
  sequence.expert_rows = {10, 0, 10, 0};  // 1 layer, 4 experts: 0 on node 0, 2 on node 1
  const std::vector<SequenceTraffic> history(4, sequence);
  const std::vector<Placement> grouped =
      GroupExpertsBySequences(history, 1, 4, topology, 2).value();
  EXPECT_NE(grouped[0].copy_ranks(0)[0], grouped[0].copy_ranks(2)[0]);
  ExpertGroupingOptions loose;
  loose.max_node_load_imbalance = 2.0;
  const std::vector<Placement> together =
      GroupExpertsBySequences(history, 1, 4, topology, 2, loose).value();
  EXPECT_EQ(together[0].copy_ranks(0)[0], together[0].copy_ranks(2)[0]);
  EXPECT_NE(GroupExpertsBySequences(history, 2, 4, topology, 2)
                .status()
                .message()
                .find("sequence 0 has 4 expert_rows, expected 8"),
            std::string::npos);
}

}  // namespace
}  // namespace keel
