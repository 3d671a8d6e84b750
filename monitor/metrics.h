// Keel's Prometheus metrics (prometheus-cpp): one registry holding every family the engine, the
// load monitor and `keel replay --serve-metrics` export, an optional HTTP server for scrapes
// (ScrapeServer), and the text exposition for tests. Names and labels are listed in
// docs/monitor.md; dashboards query them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"

namespace prometheus {
class Counter;
template <typename T>
class Family;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace keel {

// The shape the metrics describe, fixed at construction so every per-layer and per-rank series
// exists from the first scrape (rate() and absent() then behave) and the hot update paths only
// touch cached pointers.
struct MetricsLayout {
  int num_layers = 1;
  int num_ranks = 1;
  int num_experts = 1;
  // Export keel_expert_tokens_total{layer,expert}: true only on the one aggregating rank when
  // monitor.per_expert is "aggregated" (see PerExpertSeriesEnabled).
  bool per_expert_series = false;

  // From a config: ranks from the topology, per_expert_series from the monitor section and
  // `this_rank`.
  static MetricsLayout FromConfig(const KeelConfig& config, int num_layers, int num_experts,
                                  int this_rank);
};

// monitor.per_expert == "aggregated" and `this_rank` is monitor.aggregating_rank: 256 experts x 60
// layers stay one exporter's 15k series instead of every rank's.
bool PerExpertSeriesEnabled(const MonitorConfig& config, int this_rank);

// One layer's step as the monitor or the replay saw it.
struct LayerStepObservation {
  int layer = 0;
  std::span<const double> rank_tokens;    // [num_ranks] token copies each rank computed
  std::span<const double> expert_tokens;  // [num_experts] token copies routed to each expert
  // [num_ranks] rank loads the estimator expects next; empty = no estimate yet.
  std::span<const double> estimated_rank_tokens;
  // r_max of the lower bound: the most ranks one expert's tokens can be spread over.
  int max_copies_per_expert = 1;
};

class Placement;
class ScrapeServer;
struct StepRouting;

enum class PlanOutcome { kMade, kApplied, kSkipped, kRejected };
enum class MigrationOutcome { kOk, kFailed, kAborted };

std::string_view PlanOutcomeName(PlanOutcome outcome);            // made | applied | ...
std::string_view MigrationOutcomeName(MigrationOutcome outcome);  // ok | failed | aborted

// Thread-safe: every method may be called from any thread (prometheus-cpp metrics are atomic;
// per-layer series are looked up in vectors built by the constructor).
class Metrics {
 public:
  // Fails on a layout with a non-positive size.
  static Result<std::unique_ptr<Metrics>> Create(const MetricsLayout& layout);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  const MetricsLayout& layout() const { return layout_; }

  // Serves /metrics on `address` (`[v6addr]:port`, `host:port` or `port`, as ParseListenAddress
  // reads it; "" does nothing) from a ScrapeServer thread. Port 0 picks a free port: see
  // bound_address(). Fails, naming the address, when it is malformed or cannot be bound;
  // calling it twice is a FailedPrecondition.
  Status Serve(std::string_view address);
  // "127.0.0.1:PORT" or "[::1]:PORT" with the port actually bound; "" when not serving.
  std::string bound_address() const { return bound_address_; }
  int bound_port() const { return bound_port_; }

  // The Prometheus text exposition of every family, as a scrape would return it.
  std::string Serialize() const;

  // keel_routed_tokens_total, keel_expert_tokens_total (when enabled), the imbalance,
  // balancedness and lower-bound-gap gauges, and one keel_expert_load_tokens observation per
  // expert. Spans of the wrong size and out-of-range layers are ignored (returns false).
  bool ObserveLayerStep(const LayerStepObservation& observation);
  // keel_steps_total += 1.
  void EndStep();

  void SetEpoch(int64_t epoch);
  // keel_plans_total{outcome, reason}; reason "none" for made and applied.
  void RecordPlan(PlanOutcome outcome, std::string_view reason = "none");
  // One planner run (all layers): duration histogram and last-run timestamp (now).
  void RecordPlannerRun(double seconds);
  // keel_watchdog_trips_total{what}: a background job (what = "planner") ran past its limit.
  void RecordWatchdogTrip(std::string_view what);
  // A finished migration: outcome count, bytes moved over `transport` (local | ucx | nccl),
  // duration and the seconds training stalled for it.
  void RecordMigration(MigrationOutcome outcome, std::string_view transport, double bytes,
                       double seconds, double exposed_seconds);
  void SetMigrationsInFlight(int count);
  // Persistent copies beyond each expert's first, and this step's transient replicas.
  void SetReplicas(int layer, int persistent, int transient);
  void AddDroppedSamples(uint64_t count);

  // One layer's step as every observer reports it (the engine, the replay's live export, the
  // load monitor): ObserveLayerStep with the rank loads of `routing`, `expert_tokens` and the
  // estimate (empty: none), and SetReplicas from `placement` and the routing's transients.
  void ObserveLayerRouting(int layer, const Placement& placement, const StepRouting& routing,
                           std::span<const double> expert_tokens,
                           std::span<const double> estimated_rank_tokens,
                           int max_copies_per_expert);

 private:
  explicit Metrics(const MetricsLayout& layout);

  MetricsLayout layout_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<ScrapeServer> server_;
  std::string bound_address_;
  int bound_port_ = 0;

  // Cached series; the families own them and live in registry_.
  prometheus::Counter* steps_ = nullptr;
  std::vector<prometheus::Counter*> routed_tokens_;  // [layer * num_ranks + rank]
  std::vector<prometheus::Counter*> expert_tokens_;  // [layer * num_experts + expert] or empty
  std::vector<prometheus::Gauge*> imbalance_last_;   // [layer]
  std::vector<prometheus::Gauge*> imbalance_estimate_;
  std::vector<prometheus::Gauge*> balancedness_last_;
  std::vector<prometheus::Gauge*> balancedness_estimate_;
  std::vector<prometheus::Gauge*> lower_bound_gap_;
  std::vector<prometheus::Histogram*> expert_load_;
  std::vector<prometheus::Gauge*> replicas_;
  std::vector<prometheus::Gauge*> transient_replicas_;
  prometheus::Gauge* epoch_ = nullptr;
  // Reasons are open-ended, so their series are added on first use.
  prometheus::Family<prometheus::Counter>* plans_ = nullptr;
  prometheus::Family<prometheus::Counter>* watchdog_trips_ = nullptr;
  prometheus::Histogram* planner_duration_ = nullptr;
  prometheus::Gauge* planner_last_run_ = nullptr;
  std::vector<prometheus::Counter*> migrations_;  // [MigrationOutcome]
  prometheus::Family<prometheus::Counter>* migration_bytes_ = nullptr;
  prometheus::Histogram* migration_duration_ = nullptr;
  prometheus::Gauge* migrations_in_flight_ = nullptr;
  prometheus::Counter* migration_exposed_ = nullptr;
  prometheus::Counter* dropped_samples_ = nullptr;
};

}  // namespace keel
