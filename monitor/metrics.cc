// Keel's Prometheus metrics: families are registered once with every per-layer and per-rank
// series, so updates only touch cached atomic series; ScrapeServer serves their text.
#include "monitor/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <chrono>
#include <exception>

#include "keel/version.hpp"
#include "monitor/scrape_server.h"
#include "placement/load.h"
#include "placement/placement.h"
#include "placement/routing.h"

namespace keel {
namespace {

// Per-expert token counts per step: powers of two from 1 to 2^24 tokens.
prometheus::Histogram::BucketBoundaries ExpertLoadBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (int power = 0; power <= 24; ++power) buckets.push_back(static_cast<double>(1 << power));
  return buckets;
}

// Planner runs range from microseconds (static) to seconds (large EPLB instances).
const prometheus::Histogram::BucketBoundaries kPlannerBuckets = {
    1e-5, 2.5e-5, 1e-4, 2.5e-4, 1e-3, 2.5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1, 2.5, 10};
// Migrations range from one small replica (milliseconds) to home moves of big experts (minutes).
const prometheus::Histogram::BucketBoundaries kMigrationBuckets = {
    1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};

const char* BoolText(bool value) { return value ? "true" : "false"; }

std::string Index(int i) { return std::to_string(i); }

double Max(std::span<const double> values) {
  return values.empty() ? 0.0 : *std::max_element(values.begin(), values.end());
}

}  // namespace

bool PerExpertSeriesEnabled(const MonitorConfig& config, int this_rank) {
  return config.per_expert == "aggregated" && this_rank == config.aggregating_rank;
}

MetricsLayout MetricsLayout::FromConfig(const KeelConfig& config, int num_layers, int num_experts,
                                        int this_rank) {
  MetricsLayout layout;
  layout.num_layers = num_layers;
  layout.num_ranks = config.num_ranks();
  layout.num_experts = num_experts;
  layout.per_expert_series = PerExpertSeriesEnabled(config.monitor, this_rank);
  return layout;
}

std::string_view PlanOutcomeName(PlanOutcome outcome) {
  switch (outcome) {
    case PlanOutcome::kMade:
      return "made";
    case PlanOutcome::kApplied:
      return "applied";
    case PlanOutcome::kSkipped:
      return "skipped";
    case PlanOutcome::kRejected:
      return "rejected";
  }
  return "unknown";
}

std::string_view MigrationOutcomeName(MigrationOutcome outcome) {
  switch (outcome) {
    case MigrationOutcome::kOk:
      return "ok";
    case MigrationOutcome::kFailed:
      return "failed";
    case MigrationOutcome::kAborted:
      return "aborted";
  }
  return "unknown";
}

Result<std::unique_ptr<Metrics>> Metrics::Create(const MetricsLayout& layout) {
  if (layout.num_layers < 1 || layout.num_ranks < 1 || layout.num_experts < 1) {
    return InvalidArgument("metrics layout needs positive sizes, got " +
                           std::to_string(layout.num_layers) + " layers, " +
                           std::to_string(layout.num_ranks) + " ranks, " +
                           std::to_string(layout.num_experts) + " experts");
  }
  try {
    return std::unique_ptr<Metrics>(new Metrics(layout));
  } catch (const std::exception& error) {
    return Internal(std::string("cannot register metrics: ") + error.what());
  }
}

Metrics::Metrics(const MetricsLayout& layout)
    : layout_(layout), registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  prometheus::Registry& registry = *registry_;
  const int layers = layout.num_layers;

  BuildGauge()
      .Name("keel_build_info")
      .Help("Keel build: version and compiled-in backends; always 1")
      .Register(registry)
      .Add({{"version", kVersion},
            {"cuda", BoolText(kWithCuda)},
            {"nccl", BoolText(kWithNccl)},
            {"ucx", BoolText(kWithUcx)}})
      .Set(1);

  steps_ = &BuildCounter()
                .Name("keel_steps_total")
                .Help("Training steps the monitor has seen end")
                .Register(registry)
                .Add({});

  auto& routed = BuildCounter()
                     .Name("keel_routed_tokens_total")
                     .Help("Token copies (tokens x top-k) computed by a rank in a layer")
                     .Register(registry);
  for (int layer = 0; layer < layers; ++layer) {
    for (int rank = 0; rank < layout.num_ranks; ++rank) {
      routed_tokens_.push_back(&routed.Add({{"layer", Index(layer)}, {"rank", Index(rank)}}));
    }
  }

  if (layout.per_expert_series) {
    auto& experts = BuildCounter()
                        .Name("keel_expert_tokens_total")
                        .Help(
                            "Token copies routed to a logical expert of a layer (exported by "
                            "the aggregating rank only)")
                        .Register(registry);
    for (int layer = 0; layer < layers; ++layer) {
      for (int expert = 0; expert < layout.num_experts; ++expert) {
        expert_tokens_.push_back(
            &experts.Add({{"layer", Index(layer)}, {"expert", Index(expert)}}));
      }
    }
  }

  auto& imbalance = BuildGauge()
                        .Name("keel_layer_imbalance_ratio")
                        .Help(
                            "Max rank load / mean rank load of a layer (1 is perfect); source "
                            "last_step or estimate")
                        .Register(registry);
  auto& balancedness = BuildGauge()
                           .Name("keel_layer_balancedness")
                           .Help("Mean rank load / max rank load of a layer (1 is perfect)")
                           .Register(registry);
  auto& gap = BuildGauge()
                  .Name("keel_layer_lower_bound_gap_ratio")
                  .Help(
                      "Last step's max rank load / lower bound max(T/G, max_e load_e / "
                      "min(G, r_max)); 1 is optimal")
                  .Register(registry);
  auto& expert_load = BuildHistogram()
                          .Name("keel_expert_load_tokens")
                          .Help(
                              "Per-expert token copies per step: one observation per expert "
                              "and step")
                          .Register(registry);
  auto& replicas = BuildGauge()
                       .Name("keel_layer_replicas")
                       .Help("Persistent expert copies beyond each expert's first in a layer")
                       .Register(registry);
  auto& transients = BuildGauge()
                         .Name("keel_layer_transient_replicas")
                         .Help("Transient replicas filled for a layer in the last step")
                         .Register(registry);
  const auto buckets = ExpertLoadBuckets();
  for (int layer = 0; layer < layers; ++layer) {
    const std::string l = Index(layer);
    imbalance_last_.push_back(&imbalance.Add({{"layer", l}, {"source", "last_step"}}));
    imbalance_estimate_.push_back(&imbalance.Add({{"layer", l}, {"source", "estimate"}}));
    balancedness_last_.push_back(&balancedness.Add({{"layer", l}, {"source", "last_step"}}));
    balancedness_estimate_.push_back(&balancedness.Add({{"layer", l}, {"source", "estimate"}}));
    lower_bound_gap_.push_back(&gap.Add({{"layer", l}}));
    expert_load_.push_back(&expert_load.Add({{"layer", l}}, buckets));
    replicas_.push_back(&replicas.Add({{"layer", l}}));
    transient_replicas_.push_back(&transients.Add({{"layer", l}}));
    // A layer that has not routed yet reads as balanced rather than as 0.
    imbalance_last_.back()->Set(1);
    imbalance_estimate_.back()->Set(1);
    balancedness_last_.back()->Set(1);
    balancedness_estimate_.back()->Set(1);
    lower_bound_gap_.back()->Set(1);
  }

  epoch_ = &BuildGauge()
                .Name("keel_placement_epoch")
                .Help("Id of the placement in force")
                .Register(registry)
                .Add({});
  plans_ = &BuildCounter()
                .Name("keel_plans_total")
                .Help("Plans by outcome (made, applied, skipped, rejected) and reason")
                .Register(registry);
  plans_->Add({{"outcome", "made"}, {"reason", "none"}});
  plans_->Add({{"outcome", "applied"}, {"reason", "none"}});
  planner_duration_ = &BuildHistogram()
                           .Name("keel_planner_duration_seconds")
                           .Help("Wall time of one planner run over all layers")
                           .Register(registry)
                           .Add({}, kPlannerBuckets);
  watchdog_trips_ = &BuildCounter()
                         .Name("keel_watchdog_trips_total")
                         .Help("Background jobs that ran past their limit, by job (planner)")
                         .Register(registry);
  watchdog_trips_->Add({{"what", "planner"}});
  planner_last_run_ = &BuildGauge()
                           .Name("keel_planner_last_run_timestamp_seconds")
                           .Help("Unix time of the last planner run")
                           .Register(registry)
                           .Add({});

  auto& migrations = BuildCounter()
                         .Name("keel_migrations_total")
                         .Help("Finished migrations by outcome (ok, failed, aborted)")
                         .Register(registry);
  for (MigrationOutcome outcome :
       {MigrationOutcome::kOk, MigrationOutcome::kFailed, MigrationOutcome::kAborted}) {
    migrations_.push_back(
        &migrations.Add({{"outcome", std::string(MigrationOutcomeName(outcome))}}));
  }
  migration_bytes_ = &BuildCounter()
                          .Name("keel_migration_bytes_total")
                          .Help("Expert state bytes moved, by transport (local, ucx, nccl)")
                          .Register(registry);
  // Transports this build has start at 0, so rate() works before the first migration.
  migration_bytes_->Add({{"transport", "local"}});
  if (kWithUcx) migration_bytes_->Add({{"transport", "ucx"}});
  if (kWithNccl) migration_bytes_->Add({{"transport", "nccl"}});
  migration_duration_ = &BuildHistogram()
                             .Name("keel_migration_duration_seconds")
                             .Help("Wall time of one migration, start to commit or abort")
                             .Register(registry)
                             .Add({}, kMigrationBuckets);
  migrations_in_flight_ = &BuildGauge()
                               .Name("keel_migrations_in_flight")
                               .Help("Migrations started and not yet finished")
                               .Register(registry)
                               .Add({});
  migration_exposed_ = &BuildCounter()
                            .Name("keel_migration_exposed_seconds_total")
                            .Help("Seconds training stalled waiting for migrations")
                            .Register(registry)
                            .Add({});
  dropped_samples_ = &BuildCounter()
                          .Name("keel_monitor_dropped_samples_total")
                          .Help(
                              "Routing batches the load monitor dropped because its queue was "
                              "full")
                          .Register(registry)
                          .Add({});
}

// The server's page reads the registry: it stops before anything else goes.
Metrics::~Metrics() { server_.reset(); }

Status Metrics::Serve(std::string_view address) {
  if (server_) {
    return FailedPrecondition("metrics are already served on " + bound_address_ +
                              "; cannot also serve on '" + std::string(address) + "'");
  }
  if (address.empty()) return Status::Ok();
  KEEL_ASSIGN_OR_RETURN(ListenAddress listen, ParseListenAddress(address));
  ScrapeServerParams params;
  params.address = std::move(listen);
  params.page = [this] { return Serialize(); };
  KEEL_ASSIGN_OR_RETURN(server_, ScrapeServer::Start(std::move(params)));
  bound_address_ = server_->bound_address();
  bound_port_ = server_->bound_port();
  return Status::Ok();
}

std::string Metrics::Serialize() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

bool Metrics::ObserveLayerStep(const LayerStepObservation& observation) {
  const int layer = observation.layer;
  const size_t ranks = static_cast<size_t>(layout_.num_ranks);
  const size_t experts = static_cast<size_t>(layout_.num_experts);
  if (layer < 0 || layer >= layout_.num_layers || observation.rank_tokens.size() != ranks ||
      observation.expert_tokens.size() != experts ||
      (!observation.estimated_rank_tokens.empty() &&
       observation.estimated_rank_tokens.size() != ranks)) {
    return false;
  }
  for (size_t rank = 0; rank < ranks; ++rank) {
    const double tokens = observation.rank_tokens[rank];
    if (tokens > 0) routed_tokens_[layer * ranks + rank]->Increment(tokens);
  }
  prometheus::Histogram& histogram = *expert_load_[layer];
  for (size_t expert = 0; expert < experts; ++expert) {
    const double tokens = observation.expert_tokens[expert];
    histogram.Observe(tokens);
    if (!expert_tokens_.empty() && tokens > 0) {
      expert_tokens_[layer * experts + expert]->Increment(tokens);
    }
  }

  const double imbalance = Imbalance(observation.rank_tokens);
  imbalance_last_[layer]->Set(imbalance);
  balancedness_last_[layer]->Set(1.0 / imbalance);
  if (!observation.estimated_rank_tokens.empty()) {
    const double estimate = Imbalance(observation.estimated_rank_tokens);
    imbalance_estimate_[layer]->Set(estimate);
    balancedness_estimate_[layer]->Set(1.0 / estimate);
  }

  const int r_max = std::clamp(observation.max_copies_per_expert, 1, layout_.num_ranks);
  const double lower_bound = LoadLowerBound(observation.expert_tokens, layout_.num_ranks, r_max);
  // The bound holds by construction; max() only absorbs rounding of fractional quotas.
  const double gap = lower_bound > 0 ? Max(observation.rank_tokens) / lower_bound : 1.0;
  lower_bound_gap_[layer]->Set(std::max(1.0, gap));
  return true;
}

void Metrics::EndStep() { steps_->Increment(); }

void Metrics::SetEpoch(int64_t epoch) { epoch_->Set(static_cast<double>(epoch)); }

void Metrics::RecordPlan(PlanOutcome outcome, std::string_view reason) {
  plans_->Add({{"outcome", std::string(PlanOutcomeName(outcome))}, {"reason", std::string(reason)}})
      .Increment();
}

void Metrics::RecordPlannerRun(double seconds) {
  planner_duration_->Observe(seconds);
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  planner_last_run_->Set(std::chrono::duration<double>(now).count());
}

void Metrics::RecordWatchdogTrip(std::string_view what) {
  watchdog_trips_->Add({{"what", std::string(what)}}).Increment();
}

void Metrics::RecordMigration(MigrationOutcome outcome, std::string_view transport, double bytes,
                              double seconds, double exposed_seconds) {
  migrations_[static_cast<size_t>(outcome)]->Increment();
  if (bytes > 0) migration_bytes_->Add({{"transport", std::string(transport)}}).Increment(bytes);
  migration_duration_->Observe(seconds);
  if (exposed_seconds > 0) migration_exposed_->Increment(exposed_seconds);
}

void Metrics::SetMigrationsInFlight(int count) { migrations_in_flight_->Set(count); }

void Metrics::SetReplicas(int layer, int persistent, int transient) {
  if (layer < 0 || layer >= layout_.num_layers) return;
  replicas_[layer]->Set(persistent);
  transient_replicas_[layer]->Set(transient);
}

void Metrics::ObserveLayerRouting(int layer, const Placement& placement, const StepRouting& routing,
                                  std::span<const double> expert_tokens,
                                  std::span<const double> estimated_rank_tokens,
                                  int max_copies_per_expert) {
  LayerStepObservation observation;
  observation.layer = layer;
  observation.rank_tokens = routing.rank_tokens;
  observation.expert_tokens = expert_tokens;
  observation.estimated_rank_tokens = estimated_rank_tokens;
  observation.max_copies_per_expert = max_copies_per_expert;
  ObserveLayerStep(observation);
  int persistent = 0;
  for (int copies : placement.logcnt()) persistent += std::max(0, copies - 1);
  SetReplicas(layer, persistent, static_cast<int>(routing.transients.size()));
}

void Metrics::AddDroppedSamples(uint64_t count) {
  if (count > 0) dropped_samples_->Increment(static_cast<double>(count));
}

}  // namespace keel
