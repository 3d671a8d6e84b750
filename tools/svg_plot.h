// The picture of a replay, as a self-contained SVG with no dependencies: imbalance over steps per
// policy (line chart) above a heatmap of each expert's share of the tokens over steps, so a
// reader sees at once which policy stays balanced and what load it was balancing.
#pragma once

#include <string>

#include "keel/status.hpp"
#include "tools/replay.h"

namespace keel::tools {

// The SVG document for `report`. Steps are averaged into at most ~600 columns.
std::string RenderReplaySvg(const ReplayReport& report);

// Renders and writes the SVG to `path` (atomically).
Status WriteReplaySvg(const ReplayReport& report, const std::string& path);

}  // namespace keel::tools
