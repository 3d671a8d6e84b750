// Engine::Impl's call agreement: every collective call starts with one all-reduce of the same
// size, whatever the call, in which each rank announces what it is doing. Ranks that disagree
// (one routes layer 0 while another routes layer 1, or restores a state) and a rank whose own
// argument checks failed then get an error on every rank, instead of collectives of different
// sizes that hang or abort inside the communicator, or a wrong answer.
#include "engine/engine_impl.h"

#include <algorithm>
#include <string>

namespace keel {
namespace {

// What each rank announces, in its own row of the all-reduce.
enum HeaderField : size_t { kCall, kLayer, kMicroBatch, kStep, kLocalError, kHeaderFields };

std::string CallName(int64_t call) {
  switch (static_cast<CollectiveCall>(call)) {
    case CollectiveCall::kRoute:
      return "Route";
    case CollectiveCall::kReduceGradients:
      return "ReduceGradients";
    case CollectiveCall::kStepEnd:
      return "StepEnd";
    case CollectiveCall::kPlanSequences:
      return "PlanSequences";
    case CollectiveCall::kRestoreState:
      return "RestoreState";
  }
  return "call " + std::to_string(call);
}

// "Route(layer 1, micro-batch 0) at step 3" from one rank's header.
std::string Describe(const int64_t* header) {
  std::string out = CallName(header[kCall]);
  if (static_cast<CollectiveCall>(header[kCall]) == CollectiveCall::kRoute) {
    out += "(layer " + std::to_string(header[kLayer]) + ", micro-batch " +
           std::to_string(header[kMicroBatch]) + ")";
  } else if (header[kLayer] >= 0) {
    out += "(layer " + std::to_string(header[kLayer]) + ")";
  }
  return out + " at step " + std::to_string(header[kStep]);
}

}  // namespace

Status Engine::Impl::AgreeOnCall(CollectiveCall call, int layer, const Status& local,
                                 std::span<const int32_t> expert_counts) {
  const size_t num_ranks = static_cast<size_t>(num_ranks_);
  const size_t num_experts = static_cast<size_t>(options_.num_experts);
  const size_t counts_at = num_ranks * kHeaderFields;
  agreement_.assign(counts_at + num_experts * num_ranks, 0);
  int64_t* mine = agreement_.data() + static_cast<size_t>(rank_) * kHeaderFields;
  mine[kCall] = static_cast<int64_t>(call);
  mine[kLayer] = layer;
  mine[kMicroBatch] = call == CollectiveCall::kRoute ? NextMicroBatch(layer) : 0;
  mine[kStep] = stats_.steps;
  mine[kLocalError] = static_cast<int64_t>(local.code());
  if (local.ok()) {
    for (size_t e = 0; e < expert_counts.size(); ++e) {
      agreement_[counts_at + e * num_ranks + rank_] = expert_counts[e];
    }
  }
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(agreement_, ReduceOp::kSum));

  // Every rank reads the same sums, so every rank returns the same verdict; a rank whose own
  // checks failed returns its own error, which says more.
  if (!local.ok()) return local;
  const int64_t* first = agreement_.data();
  for (size_t r = 1; r < num_ranks; ++r) {
    const int64_t* other = agreement_.data() + r * kHeaderFields;
    if (std::equal(first, first + kLocalError, other)) continue;
    return FailedPrecondition("ranks disagree on the collective call: rank 0 makes " +
                              Describe(first) + ", rank " + std::to_string(r) + " makes " +
                              Describe(other) +
                              "; every rank makes the same collective calls in the same order");
  }
  for (size_t r = 0; r < num_ranks; ++r) {
    const int64_t code = agreement_[r * kHeaderFields + kLocalError];
    if (code == 0) continue;
    return Status(static_cast<StatusCode>(code),
                  "rank " + std::to_string(r) + " refused its " +
                      Describe(agreement_.data() + r * kHeaderFields) + " (" +
                      std::string(StatusCodeName(static_cast<StatusCode>(code))) +
                      ": its own error says why); every rank abandons the call");
  }
  by_expert_.resize(num_experts * num_ranks);
  for (size_t i = 0; i < by_expert_.size(); ++i) {
    by_expert_[i] = static_cast<int32_t>(agreement_[counts_at + i]);
  }
  return Status::Ok();
}

}  // namespace keel
