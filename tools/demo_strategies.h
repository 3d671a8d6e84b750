// `keel demo --strategy esp|parm|ppmoe`: the demo model trained with sharded experts instead of
// whole ones (docs/strategies.md). Each expert's FFN inner dimension is split over a group of
// consecutive ranks, each shard an FFN of its own (ffn / shards wide) whose partial outputs sum to
// the expert's output; a shard owns its slice of the weights, gradients and Adam state, so no
// copy needs a sync. The layouts are the replay's:
//   esp    experts dealt to groups of --shard-degree ranks; a row goes to the member of its
//          expert's group at the sender's own position, is all-gathered in the group, and the
//          partial outputs are reduce-scattered back to that member;
//   parm   the same over MP groups of --mp ranks that hold the same tokens, each sending only
//          its share (Parm's de-duplicated dispatch), then all-gathering the group's outputs;
//          without de-duplication (RankRunOptions::parm_dedup false) every member sends all of
//          the group's rows and the MP group all-reduces the partial outputs instead;
//   ppmoe  every expert sliced over the ranks of a node: the node's tokens are gathered, every
//          rank runs its slice for all of them, and the token outputs are summed back.
#pragma once

#include "keel/status.hpp"
#include "tools/demo_trainer.h"

namespace keel::tools {

// Collective over options.communicator, like RunRank, for options.config.strategy.name esp,
// parm or ppmoe (RunRank calls it for them); host memory, no sequences, no condensation. The
// engine is not used: layouts are fixed, and no copy needs a sync. The final weights are every
// expert's full weights, assembled from its shards.
Result<RankRunResult> RunShardedRank(const RankRunOptions& options);

}  // namespace keel::tools
