// Predicts one MoE layer's step time from a routing and a placement change, so that every policy
// prices its decisions the same way:
//   slowest rank's expert compute + all-to-all of the traffic over intra/inter-node links
//   + replica gradient/weight sync + transient-replica fills + exposed migration.
// Constants come from config (CostModelConfig) and can be calibrated on the hardware.
#pragma once

#include <span>
#include <vector>

#include "common/config.h"
#include "placement/placement.h"
#include "placement/routing.h"
#include "placement/topology.h"

namespace keel {

// The most bytes any rank sends, or receives, over each link class in one all-to-all pass.
struct LinkPeaks {
  double intra_bytes = 0;  // within a node
  double inter_bytes = 0;  // between nodes
};

struct LayerCost {
  double compute_seconds = 0;       // slowest rank's expert compute, forward + backward
  double all_to_all_seconds = 0;    // slowest rank's dispatch/combine traffic, all passes
  double replica_sync_seconds = 0;  // slowest rank's replica gradient reduce + weight push,
                                    // a ring over each expert's copies
  double transient_seconds = 0;     // slowest rank's transient-replica weight fills + grads,
                                    // a chain per expert from its source
  double exposed_migration_seconds = 0;

  double total_seconds() const {
    return compute_seconds + all_to_all_seconds + replica_sync_seconds + transient_seconds +
           exposed_migration_seconds;
  }
};

// Bytes and time to turn one placement into another.
struct MigrationCost {
  int changed_slots = 0;
  int moved_homes = 0;
  double bytes = 0;    // replica fills carry weights; home moves carry weights + optimizer state
  double seconds = 0;  // slowest receiving rank, each copy fed from its nearest holder
};

class CostModel {
 public:
  CostModel(const Topology& topology, const CostModelConfig& config);

  const Topology& topology() const { return topology_; }
  const CostModelConfig& config() const { return config_; }

  double expert_parameters() const;  // expert_matrices * hidden * ffn
  double expert_weight_bytes() const;
  double home_move_bytes() const;  // parameters * home_move_bytes_per_parameter
  double token_row_bytes() const;  // hidden * dtype_bytes
  // Seconds for one rank to run `tokens` token rows through one expert, forward + backward.
  double ComputeSeconds(double tokens) const;

  // The step time of one layer under `routing` on `placement`, with `migration_seconds` of
  // background transfers that overlap one forward/backward of this layer; only the excess is
  // exposed.
  LayerCost Estimate(const Placement& placement, const StepRouting& routing,
                     double migration_seconds = 0) const;

  // Estimate for a planner that prices several routings on one placement: `replica_sync_seconds`
  // must be ReplicaSyncSeconds(placement), which depends on the placement alone and so is
  // computed once. The same LayerCost as Estimate.
  LayerCost EstimateWithSync(const Placement& placement, const StepRouting& routing,
                             double replica_sync_seconds, double migration_seconds = 0) const;

  // EstimateWithSync from a routing's parts, for a planner that keeps them in buffers of its own:
  // the slowest rank's tokens, the all-to-all matrix `all_to_all` [num_ranks * num_ranks] (rows
  // by source as in StepRouting::sent_tokens, or its transpose: a rank's sends and receives enter
  // alike and are added in the same order either way, so both give the same bits) and this
  // step's transient replicas.
  LayerCost EstimateParts(const Placement& placement, double max_rank_tokens,
                          std::span<const double> all_to_all,
                          std::span<const TransientReplica> transients, double replica_sync_seconds,
                          double migration_seconds = 0) const;

  // EstimateParts once the all-to-all's peaks are known: the same LayerCost as EstimateParts for a
  // matrix whose link sums peak at `peaks`.
  LayerCost EstimateFromPeaks(const Placement& placement, double max_rank_tokens, LinkPeaks peaks,
                              std::span<const TransientReplica> transients,
                              double replica_sync_seconds, double migration_seconds = 0) const;

  MigrationCost Migration(const Placement& from, const Placement& to) const;

  // OK when every price in `cost` (and `migration`, when given) is finite; else InvalidArgument
  // naming the terms and the constants they come from. Constants that passed ValidateConfig give
  // finite prices for any trace (common/config_keys.cc); a program that fills CostModelConfig
  // itself may not, and callers that report prices check them here rather than write inf or NaN
  // (null in JSON).
  Status CheckFinite(const LayerCost& cost, const MigrationCost* migration = nullptr) const;

  // Seconds of one all-to-all of `bytes` [num_ranks * num_ranks] (rows by source): the slowest
  // rank's sends or receives over each link class, as one pass of Estimate's all-to-all. Prices
  // traffic that is not token rows, such as the sequences a sequence plan moves.
  double TransferSeconds(std::span<const double> bytes) const;

  // The replica_sync_seconds term of Estimate alone: it depends only on the placement.
  double ReplicaSyncSeconds(const Placement& placement) const;

  // The transient_seconds term of Estimate alone: the fills of `transients` (in the order they
  // were added) on `placement`, each expert's copies a chain from its source.
  double TransientSeconds(const Placement& placement,
                          std::span<const TransientReplica> transients) const;

 private:
  // TransientSeconds for this many transients or fewer (a step planner's usual count) skips the
  // table of every rank.
  static constexpr size_t kFewTransients = 8;
  double FewTransientSeconds(std::span<const TransientReplica> transients) const;

  Topology topology_;
  CostModelConfig config_;
  std::vector<int> rank_node_;  // [num_ranks] node of each rank, so hot loops need not divide
};

}  // namespace keel
