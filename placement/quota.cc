// PLACEHOLDER: replaced by the exact quota planner.
#include "placement/routing.h"
namespace keel {
Result<StepRouting> PlanStepQuotas(const Placement& p, const StepLoad& l, const Topology&,
                                   const CostModel&, const QuotaPlanOptions&) {
  return RouteEvenly(p, l);
}
QuotaSplit SplitQuotas(const Placement&, const std::vector<long long>&,
                       const std::vector<TransientReplica>&) { return {}; }
}  // namespace keel
