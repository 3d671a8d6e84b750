// The linear program DeepSeek's LPLB solves at every step, over the edges that redundant experts
// make between ranks, solved with GLPK's simplex:
//
//   variables   x_c >= 0 for every copy c of an expert with two or more copies, and t
//   minimise    t
//   subject to  sum over the copies c of e:  x_c = load_e          for every replicated expert e
//               fixed_r + sum over the copies c on r:  x_c <= t    for every rank r
//
// fixed_r is the load of the experts whose only copy is on rank r: they have no edge to move
// tokens along. This is the continuous relaxation of what Keel's quota solver (quota_solver.h)
// solves in whole tokens: for whole-token loads the quota solver's max rank load is the LP
// optimum rounded up (the max-flow view of both problems has integral capacities).
#pragma once

#include <span>
#include <vector>

#include "keel/status.hpp"
#include "placement/placement.h"

namespace keel {

struct LpBalance {
  std::vector<double> slot_tokens;  // [num_slots] tokens of each persistent slot
  double max_rank_tokens = 0;       // the LP optimum t
};

// Solves the LP above for `expert_load` [num_experts] (finite, >= 0) on `placement`. Copies of an
// expert on one rank count as one edge end: the rank's tokens of that expert are shared evenly
// among them. Internal when GLPK does not reach an optimum (it always exists).
Result<LpBalance> SolveLpBalance(const Placement& placement, std::span<const double> expert_load);

}  // namespace keel
