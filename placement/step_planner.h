// StepPlanner: PlanStepQuotas (placement/routing.h) as an object that a trainer's rank keeps per
// layer and calls at every step.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "keel/status.hpp"
#include "placement/cost_model.h"
#include "placement/placement.h"
#include "placement/routing.h"
#include "placement/topology.h"

namespace keel {

// Traffic by expert, as StepPlanner::Plan takes it: `by_expert` [num_experts * num_sources]
// becomes the transpose of `traffic` [num_sources * num_experts] (StepLoad::traffic's layout).
void TrafficByExpert(std::span<const double> traffic, int num_sources, int num_experts,
                     std::vector<double>& by_expert);

// PlanStepQuotas for a caller that plans a layer at every step, as a trainer's rank does: the
// same routing, bit for bit, with what depends on the placement alone rebuilt only when the
// placement changes, every buffer kept between calls, and the traffic given by expert, so that
// each expert's sources are contiguous.
class StepPlanner {
 public:
  // `topology` and `cost` must outlive the planner.
  StepPlanner(const Topology& topology, const CostModel& cost);
  ~StepPlanner();
  StepPlanner(const StepPlanner&) = delete;
  StepPlanner& operator=(const StepPlanner&) = delete;

  // Plans one step of `placement`. `by_expert` [num_experts * num_sources] holds the tokens that
  // source s sends to expert e at e * num_sources + s: the transpose of StepLoad::traffic.
  // Writes into `routing`, reusing its buffers, what PlanStepQuotas would return.
  Status Plan(const Placement& placement, int num_sources, std::span<const double> by_expert,
              const QuotaPlanOptions& options, StepRouting& routing);
  // The same for whole token counts, `counts` in by_expert's layout: the routing that Plan gives
  // for the same values as doubles, bit for bit. A trainer has its routers' counts as integers,
  // and this takes them as they are. With one source per rank, ranks a multiple of 8 and no
  // all-to-all matrix (options.sent_tokens false, as the engine asks), one pass over the 32-bit
  // counts replaces the test for whole numbers, as long as num_experts * num_sources times the
  // OR of all counts (at least the largest count, below twice it) stays below 2^31: at 256
  // experts and 64 ranks, counts below 2^17. Otherwise it plans the counts as doubles. A negative
  // count is an error that names it.
  Status Plan(const Placement& placement, int num_sources, std::span<const std::int32_t> counts,
              const QuotaPlanOptions& options, StepRouting& routing);

 private:
  class Impl;
  // Runs on an Impl of its own, so that a bad entry is named by its index in StepLoad::traffic.
  friend Result<StepRouting> PlanStepQuotas(const Placement& placement, const StepLoad& load,
                                            const Topology& topology, const CostModel& cost,
                                            const QuotaPlanOptions& options);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel
