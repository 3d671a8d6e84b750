// The small topology the cost-model tests work their values by hand on: 2 nodes of 2 ranks,
// links of 1e11 B/s inside a node and 1e10 B/s between nodes.
#pragma once

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

}  // namespace keel
