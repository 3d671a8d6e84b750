// What only Keel's own programs give an engine: options of internal types, which the public
// EngineOptions (include/keel/engine.hpp) cannot name.
#pragma once

#include <memory>

#include "keel/engine.hpp"
#include "keel/status.hpp"
#include "monitor/metrics.h"

namespace keel {

class EngineFactory {
 public:
  // Engine::Create, recording into `metrics` (shared by the ranks of one process, as `keel demo`
  // does; only config.monitor.aggregating_rank records) instead of Metrics of the engine's own.
  // Null `metrics`: exactly Engine::Create.
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options, Metrics* metrics);
};

}  // namespace keel
