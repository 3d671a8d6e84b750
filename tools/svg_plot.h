// The picture of a replay, as a self-contained SVG with no dependencies: imbalance over steps per
// policy (line chart) above a heatmap of each expert's share of the tokens over steps, so a
// reader sees at once which policy stays balanced and what load it was balancing.
#pragma once

#include <string>

#include "keel/status.hpp"
#include "tools/replay.h"

namespace keel::tools {

// What the line chart draws per step for each of the report's policies (or strategies, in
// `keel replay --strategy`): mean imbalance over layers, or the simulated step time.
enum class PlotLines { kImbalance, kStepMilliseconds };

// The SVG document for `report`. Steps are averaged into at most ~600 columns.
std::string RenderReplaySvg(const ReplayReport& report, PlotLines lines = PlotLines::kImbalance);

// Renders and writes the SVG to `path` (atomically).
Status WriteReplaySvg(const ReplayReport& report, const std::string& path,
                      PlotLines lines = PlotLines::kImbalance);

}  // namespace keel::tools
