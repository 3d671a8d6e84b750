// The small topology the cost-model tests work their values by hand on: 2 nodes of 2 ranks,
// links of 1e11 B/s inside a node and 1e10 B/s between nodes; and the experts they price.
#pragma once

#include "common/config.h"
#include "placement/topology.h"

namespace keel {

inline Topology TwoNodesOfTwo() {
  TopologyConfig config;
  config.num_nodes = 2;
  config.gpus_per_node = 2;
  config.intra_node_gb_per_s = 100;
  config.inter_node_gb_per_s = 10;
  return Topology::Create(config).value();
}

// Row bytes 2000 (hidden 1000 x 2 bytes), as many per token, top-2 rows per token, 8e6 parameters
// per expert (weights 1.6e7 bytes, a home 1.12e8), 4.8e7 training FLOPs per row at 1e12 FLOP/s.
inline CostModelConfig HandModel() {
  CostModelConfig config;
  config.expert_tflops = 1.0;
  config.hidden_size = 1000;
  config.expert_ffn_size = 4000;
  config.expert_matrices = 2;
  config.dtype_bytes = 2;
  config.home_move_bytes_per_parameter = 14;
  config.train_flops_multiplier = 3;
  config.all_to_all_passes = 4;
  config.replica_sync_passes = 2;
  config.top_k = 2;
  return config;
}

}  // namespace keel
