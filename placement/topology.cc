// Topology: validation of the rank/node layout and link bandwidths.
#include "placement/topology.h"

#include <cmath>
#include <string>

#include "common/number_text.h"

namespace keel {

Result<Topology> Topology::Create(const TopologyConfig& config) {
  if (config.num_nodes < 1) {
    return InvalidArgument("topology.num_nodes must be >= 1, got " +
                           std::to_string(config.num_nodes));
  }
  if (config.gpus_per_node < 1) {
    return InvalidArgument("topology.gpus_per_node must be >= 1, got " +
                           std::to_string(config.gpus_per_node));
  }
  if (!(config.intra_node_gb_per_s > 0) || !std::isfinite(config.intra_node_gb_per_s)) {
    return InvalidArgument("topology.intra_node_gb_per_s must be > 0, got " +
                           NumberText(config.intra_node_gb_per_s));
  }
  if (!(config.inter_node_gb_per_s > 0) || !std::isfinite(config.inter_node_gb_per_s)) {
    return InvalidArgument("topology.inter_node_gb_per_s must be > 0, got " +
                           NumberText(config.inter_node_gb_per_s));
  }
  return Topology(config.num_nodes, config.gpus_per_node, config.intra_node_gb_per_s * 1e9,
                  config.inter_node_gb_per_s * 1e9);
}

}  // namespace keel
