// Per-step routing of one layer: how each expert's tokens are split among its physical copies
// (persistent slots plus this step's transient replicas), and the rank loads and all-to-all
// traffic that follow. These functions work with any placement, from any policy.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"
#include "placement/load.h"
#include "placement/placement.h"
#include "placement/topology.h"

namespace keel {

class CostModel;
class QuotaSolver;

// A copy of `expert` filled on `rank` for this step only, its weights sent from `source_rank`.
struct TransientReplica {
  int expert = 0;
  int rank = 0;
  int source_rank = 0;
};

// Tokens one source rank sends to one copy of an expert: `copy` is a persistent slot, or
// num_slots + i for transients[i].
struct CopyShare {
  int source = 0;
  int expert = 0;
  int copy = 0;
  double tokens = 0;
};

struct StepRouting {
  int num_ranks = 0;
  std::vector<double> rank_tokens;  // [num_ranks] token rows computed by each rank
  // [num_ranks * num_ranks] rows from src (row) to dst (column); empty when the planner was asked
  // not to fill it (QuotaPlanOptions::sent_tokens).
  std::vector<double> sent_tokens;
  std::vector<double> slot_tokens;  // [num_slots] quota of each persistent slot
  std::vector<TransientReplica> transients;
  std::vector<double> transient_tokens;  // [transients.size()] quota of each transient replica
  // Filled only by PlanStepQuotas with record_shares: every (source, copy) pair with tokens, by
  // expert, so each rank can map its own tokens to physical copies.
  std::vector<CopyShare> shares;
  // Filled by the quota planner (PlanStepQuotas, StepPlanner): the cost model's layer time for
  // this routing, as it priced its transient replicas (CostModel::Estimate's total without
  // migration). 0 from RouteEvenly and RouteWithShadows.
  double predicted_seconds = 0;

  double max_rank_tokens() const;
  double mean_rank_tokens() const;
  // max / mean rank load; 1.0 when no tokens were routed.
  double imbalance() const;
};

// Each source splits its tokens of an expert evenly among the expert's copies (vLLM / EPLB style).
StepRouting RouteEvenly(const Placement& placement, const StepLoad& load);

// Every source keeps its tokens of the `shadowed` experts and computes them locally (FasterMoE
// shadowing: those experts' weights were broadcast to all ranks); other experts route evenly.
// Every (shadowed expert, rank without a persistent copy) becomes a transient replica fed from
// the expert's home, so the cost model charges the broadcast.
StepRouting RouteWithShadows(const Placement& placement, const StepLoad& load,
                             const std::vector<int>& shadowed);

// Each source splits its tokens of an expert among the expert's copies in proportion to the
// copies' quotas: `slot_quota` [num_slots] for the persistent slots, `transient_quota`
// [transients.size()] for this step's transient replicas. An expert whose copies have no quota
// splits evenly among its persistent copies. Quotas need not sum to the load: only their
// proportions count. InvalidArgument for sizes that disagree or a negative quota.
Result<StepRouting> RouteInProportion(const Placement& placement, const StepLoad& load,
                                      std::span<const double> slot_quota,
                                      std::vector<TransientReplica> transients = {},
                                      std::span<const double> transient_quota = {});

// Keel's per-step planner. Quotas: the integer split of each expert's tokens among its copies
// that minimizes the max rank load (exact), with locality first when sources are assigned to
// copies: same rank, then same node (levelled, so that the traffic between nodes spreads evenly
// over sources and copies), then the rest. Transient replicas (at most
// transient_per_rank per rank, never on a rank that already holds the expert): added greedily for
// the hottest experts while the cost model predicts that the layer gets faster.
struct QuotaPlanOptions {
  int transient_per_rank = 0;  // 0: quotas only
  // The persistent slots the placement leaves empty take transients too, beyond
  // transient_per_rank on their rank (policy.keel.spare_slots: per_step).
  bool spare_slots = false;
  bool record_shares = false;  // fill StepRouting::shares (the engine's routing needs them)
  // With record_shares: -1 records every share; a rank records only the shares it sends or
  // receives, which is all that Engine::Route on that rank reads.
  int shares_of_rank = -1;
  // Fill StepRouting::sent_tokens, the all-to-all matrix (CostModel::Estimate reads it; the
  // engine's routing does not). Without it sent_tokens is left empty.
  bool sent_tokens = true;
  // Transients that are already filled for this step (by an earlier micro-batch of it): they are
  // copies whatever this plan decides, StepRouting::transients starts with them in this order,
  // and each counts against its rank's room (transient_per_rank, and the empty slots with
  // spare_slots). Each is on a rank below num_ranks that holds no persistent copy of its expert
  // and no other of these transients of that expert.
  std::span<const TransientReplica> fixed_transients = {};
};
Result<StepRouting> PlanStepQuotas(const Placement& placement, const StepLoad& load,
                                   const Topology& topology, const CostModel& cost,
                                   const QuotaPlanOptions& options);

// The exact quota split alone: per slot, integer tokens for every expert. `extra_copies` lists
// additional (expert, rank) copies, e.g. transient replicas. Returns [num_slots + extra] quotas
// and the minimal max rank load. Counts are rounded to whole tokens.
struct QuotaSplit {
  std::vector<long long> slot_quota;   // [num_slots]
  std::vector<long long> extra_quota;  // [extra_copies.size()]
  long long max_rank_tokens = 0;
};
QuotaSplit SplitQuotas(const Placement& placement, const std::vector<long long>& expert_tokens,
                       const std::vector<TransientReplica>& extra_copies);

// SplitQuotas (no extra copies) for a planner that prices several placements of one layer in a
// row, as a replan does with its candidates: buffers persist between calls, and a candidate's
// max rank load resumes from the previous solution instead of starting over.
class QuotaSplitter {
 public:
  QuotaSplitter();
  ~QuotaSplitter();
  QuotaSplitter(const QuotaSplitter&) = delete;
  QuotaSplitter& operator=(const QuotaSplitter&) = delete;

  // The same split as SplitQuotas(placement, tokens, {}). `tokens` [num_experts] must stay alive
  // and unchanged until the next Split.
  void Split(const Placement& placement, std::span<const long long> tokens, QuotaSplit& split);
  // The max_rank_tokens that Split would give for `placement` (same experts and ranks as the
  // last Split) and the last Split's tokens; cheap when `placement` differs from the one solved
  // before in a few slots. Needs a Split first.
  long long MaxRankTokens(const Placement& placement);

 private:
  std::unique_ptr<QuotaSolver> solver_;
};

}  // namespace keel
