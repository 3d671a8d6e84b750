// How one MoE layer is parallelised (DESIGN.md "strategy") and what each way costs. `ep` keeps
// experts whole and is priced by CostModel on the policy's placement; `esp`, `parm` and `ppmoe`
// shard experts over fixed groups of ranks and are priced here, with the same link tiers and
// compute constants. The pool and `auto` choose among them per layer (SmartMoE). Who sends what
// to whom, and every formula, is drawn in docs/strategies.md.
#pragma once

#include <array>
#include <span>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"
#include "placement/cost_model.h"
#include "placement/load.h"
#include "placement/placement.h"

namespace keel {

enum class Strategy {
  kEp,     // expert parallelism: whole experts, placed and replicated by the policy
  kEsp,    // each expert sharded over shard_degree ranks of a node
  kParm,   // Parm: experts sharded over the MP group, de-duplicated dispatch, overlapped schedule
  kPpmoe,  // Pipeline-MoE: every expert sliced over all ranks of every node, no all-to-all
};
inline constexpr std::array<Strategy, 4> kAllStrategies = {Strategy::kEp, Strategy::kEsp,
                                                           Strategy::kParm, Strategy::kPpmoe};

std::string_view StrategyName(Strategy strategy);
// One of ep, esp, parm, ppmoe; the error names the value and the choices.
Result<Strategy> ParseStrategy(std::string_view name);

// One layer's step under one strategy, in the parts docs/strategies.md defines.
struct StrategyCost {
  double compute_seconds = 0;     // slowest rank's expert compute, forward + backward
  double all_to_all_seconds = 0;  // token exchanges between shard groups or ranks, all passes
  // Collectives inside a group of one node: esp's and parm's all-gather of token rows and
  // reduce-scatter of partial outputs, parm's MP all-gather, ppmoe's all-reduce. For parm, the
  // part its overlapped schedule does not hide behind the exchange.
  double all_reduce_seconds = 0;
  // Keeping copies consistent: ep's replica sync and transient fills, ppmoe's gradient
  // all-reduce between the nodes that each hold every expert.
  double sync_seconds = 0;
  double migration_seconds = 0;  // exposed migration (ep) or strategy switch (auto)
  double compute_imbalance = 1;  // slowest rank's rows / mean rank's rows
  double link_bytes = 0;         // bytes sent over links by all ranks, all passes
  // The most messages one rank sends to move the layer's tokens forward (dispatch and
  // combine, and the collectives inside its group; the backward sends as many again): a
  // message per peer that gets bytes from it.
  int messages_per_rank = 0;

  double total_seconds() const {
    return compute_seconds + all_to_all_seconds + all_reduce_seconds + sync_seconds +
           migration_seconds;
  }
};

// The degrees a config's 0 stands for: shard_degree 0 = the whole node; mp_degree 0 = the
// smallest divisor of gpus_per_node above 1 (1 for a node of one rank).
int ShardDegree(const StrategyConfig& config, int gpus_per_node);
int MpDegree(const StrategyConfig& config, int gpus_per_node);

// ep's StrategyCost: CostModel's estimate `layer` of the policy's `routing` (which must have
// its sent_tokens), with the routing's imbalance, link bytes and messages.
StrategyCost EpStrategyCost(const CostModel& cost, const LayerCost& layer,
                            const StepRouting& routing);

// Where a layer's expert state (weights + optimizer state) lives under a strategy, for the
// price of switching between two strategies. `ep_homes` [num_experts]: the home rank of each
// expert under ep (the policy's placement in force; empty = the contiguous static homes);
// unused by the other strategies, whose layouts are fixed.
struct StrategyLayout {
  Strategy strategy = Strategy::kEp;
  std::span<const int> ep_homes;
};

class StrategyModel {
 public:
  // Fails when the strategy config does not fit the topology (a shard or MP degree that does
  // not divide gpus_per_node) or the GEMM efficiency curve does not parse.
  static Result<StrategyModel> Create(const CostModel& cost, const StrategyConfig& config);

  const CostModel& cost_model() const { return *cost_; }
  int shard_degree() const { return shard_degree_; }  // esp
  int mp_degree() const { return mp_degree_; }        // parm
  // Ranks an expert's shards span under `strategy` (1 for ep).
  int ShardsOf(Strategy strategy) const;

  // Expert GEMM throughput at an inner width of `columns`, relative to the full expert's
  // (expert_ffn_size columns): the measured curve's ratio, 1 when the curve is empty.
  double RelativeGemmEfficiency(double columns) const;

  // One layer's step under esp, parm or ppmoe, whose layouts are fixed (docs/strategies.md):
  // `load` [num_ranks x num_experts] is the traffic of the step. ep is priced on a placement
  // by CostModel::Estimate; asking for it here is an error.
  Result<StrategyCost> Estimate(Strategy strategy, const StepLoad& load) const;

  // Seconds to move one layer's expert state from `from`'s layout to `to`'s: each rank receives
  // the state it gains, from a rank of its own node when one held the expert, else over the
  // network; the slowest rank sets the time. 0 for the same strategy (ep's own moves are
  // priced by CostModel::Migration).
  double SwitchSeconds(const StrategyLayout& from, const StrategyLayout& to, int num_experts) const;

 private:
  StrategyModel(const CostModel& cost, const StrategyConfig& config,
                std::vector<GemmEfficiencyPoint> curve);
  double CurveAt(double columns) const;
  // esp and parm: experts sharded over groups of `group_size` consecutive ranks.
  StrategyCost EstimateSharded(const StepLoad& load, int group_size, bool parm) const;
  StrategyCost EstimatePpmoe(const StepLoad& load) const;
  // [num_ranks] fraction of expert `expert`'s state that each rank holds under `layout`.
  void StateShares(const StrategyLayout& layout, int expert, int num_experts,
                   std::span<double> shares) const;

  const CostModel* cost_;
  StrategyConfig config_;
  std::vector<GemmEfficiencyPoint> curve_;
  int shard_degree_ = 1;
  int mp_degree_ = 1;
};

// The first of `count` owners holds experts [0, E/count) (the first E % count owners one more),
// as Placement::Contiguous deals them to ranks: the owner of `expert`.
int ContiguousOwner(int expert, int num_experts, int count);

// SmartMoE's offline pool: `costs` [num_strategies][num_steps] a layer's step seconds under each
// candidate on a profiling trace. Greedily picks `size` candidates (indices into `costs`, in
// the order picked): first the one with the least total, then each time the one that most
// lowers the total of the per-step minimum over the picked ones; ties go to the lower index.
// The first, where `auto` starts, is the steadiest candidate (least standard deviation of its
// steps) of those that tie with the least total: whose mean excess over it, step by step, is
// within that excess's standard error.
std::vector<int> SelectPool(std::span<const std::vector<double>> costs, int size);

// `auto`'s choice at a replan: `estimated` [pool size] the estimated layer step of each pool
// member, `spread` [pool size] the standard deviation of the steps behind each estimate, and
// `switch_seconds` [pool size] the price of switching to it from `current` (an index into the
// pool). The gain of the cheapest member counts only beyond the two estimates' combined spread;
// auto switches only when that gain is at least min_gain_fraction of the current estimate and
// repays the switch within switch_payback_steps; else it keeps `current`.
int ChooseStrategy(int current, std::span<const double> estimated, std::span<const double> spread,
                   std::span<const double> switch_seconds, const StrategyConfig& config);

}  // namespace keel
