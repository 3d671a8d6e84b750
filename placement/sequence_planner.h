// Luffy's sequence placement: which rank runs each sequence's non-expert layers, chosen so that
// the sequence's (token, k) rows find their experts close by. Moving a sequence costs its hidden
// states there and their gradient back; the cost model decides whether a plan pays at all.
// Pure and deterministic: the same inputs give the same plan on every rank.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "keel/status.hpp"
#include "placement/cost_model.h"
#include "placement/placement.h"

namespace keel {

// One sequence of the batch, as the planner sees it.
struct SequenceTraffic {
  int origin_rank = 0;  // the rank that holds the sequence now
  int64_t tokens = 0;   // its tokens: what the token bound counts and a move carries
  // [num_layers * num_experts] (token, k) rows the sequence sends to each expert, layer-major,
  // for the layers planned together (one layer, or every layer of the step).
  std::vector<double> expert_rows;
};

// What the search minimises. Either way the cost model's step decides whether a plan is used.
enum class SequenceObjective {
  // The cost model's step: the slowest rank's links and experts, then the summed link time.
  kStepTime,
  // The summed link time of the rows and moves (each byte priced at its link's bandwidth): the
  // traffic, cross-node bytes weighing most, whichever link is the busiest.
  kLinkTime,
};

struct SequencePlanOptions {
  SequenceObjective objective = SequenceObjective::kStepTime;
  // No rank ends with more than this times the mean tokens per rank (a rank already above it
  // may keep what it has, but takes no more), so attention and dense layers stay balanced.
  double max_token_imbalance = 1.10;
  // Bytes one token of a moving sequence carries each way (hidden states there, their gradient
  // back after the backward); 0: the cost model's token row (hidden_size x dtype_bytes).
  double move_bytes_per_token = 0;
  int max_sweeps = 64;  // rounds of the local search; each round only improves the plan
};

struct SequencePlan {
  std::vector<int> rank;  // [num_sequences] where each sequence runs; its origin when unused
  // False when no plan beat leaving every sequence where it is (the cost model's step time
  // below), and then `rank` is every origin: migration is off where it does not pay.
  bool used = false;
  int moved_sequences = 0;
  double moved_bytes = 0;  // one way; the gradient returns the same bytes
  // (token, k) rows summed over the layers: off the sequence's rank, and off its node.
  double remote_rows_before = 0;
  double remote_rows_after = 0;
  double cross_node_rows_before = 0;
  double cross_node_rows_after = 0;
  // The cost model's time of the planned layers (expert compute + all-to-all, summed over
  // layers) without and with the plan, and the moves' own time (there and back).
  double seconds_before = 0;
  double seconds_after = 0;  // includes move_seconds
  double move_seconds = 0;
  double cross_node_moved_bytes = 0;  // the part of moved_bytes that crosses nodes (one way)
  std::vector<int64_t> rank_tokens;   // [num_ranks] tokens each rank holds under `rank`
};

// Plans where each sequence runs. `layers`: the placement in force of each planned layer (all
// with the cost model's ranks and the same experts). A sequence on rank g sends its rows of
// expert e to e's copies on g when g holds one, else to e's copies on g's node, else to all of
// e's copies, split evenly (locality first, as Keel's quota router routes). A local search of
// single moves and pairwise swaps lowers the sum over sequences of the link time of their rows
// (each byte priced at its link's bandwidth, all passes) plus their move; with kStepTime a
// second search from there lowers the cost model's step itself (slowest links, slowest
// experts), which the sum does not see. The plan is used only when the cost model's step time
// with it is below the time without. InvalidArgument, naming the sequence and field, for
// inconsistent input.
Result<SequencePlan> PlanSequences(std::span<const Placement> layers,
                                   std::span<const SequenceTraffic> sequences,
                                   const CostModel& cost, const SequencePlanOptions& options = {});

// Joint expert placement for sequence migration: experts that the same sequences use go to the
// same node. Fitted to `history` (sequences of past steps; origin ranks are not read), one
// placement per layer with every expert once and homes where they sit. Starting from the static
// placement (Placement::Contiguous), pairs of experts of one layer on two nodes swap while that
// lowers the rows that would cross nodes if every sequence ran on its best node for the whole
// step (the layers are judged together, so a sequence's node serves it in every layer), and
// every node's expert load in each layer stays within max_node_load_imbalance x the mean (or
// the static placement's node load, if higher). Within a node, experts go to ranks by load
// (largest first, to the least loaded rank with a free slot), as many per rank as statically.
struct ExpertGroupingOptions {
  double max_node_load_imbalance = 1.10;
  int max_sweeps = 4;  // passes over every layer's expert pairs
};
Result<std::vector<Placement>> GroupExpertsBySequences(std::span<const SequenceTraffic> history,
                                                       int num_layers, int num_experts,
                                                       const Topology& topology, int slots_per_rank,
                                                       const ExpertGroupingOptions& options = {});

}  // namespace keel
