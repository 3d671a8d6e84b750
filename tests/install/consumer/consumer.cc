// A trainer's smallest use of installed Keel: two thread-ranks route, reduce and step through the
// engine on the static placement, the planner answers DeepSeek's EPLB example, and a bad config
// is refused with the key named. Exits non-zero, saying why, when anything differs.
#include <keel/keel.h>
#include <keel/config.hpp>
#include <keel/engine.hpp>
#include <keel/local_group.hpp>
#include <keel/plan.hpp>
#include <keel/version.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

int failures = 0;

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: %s\n", what.c_str());
    ++failures;
  }
}

// One rank: 4 experts, 2 per rank, each token to expert (token % 4); every row adds 1 to its
// expert's float gradient, so every home ends with the number of rows its expert got.
void RunRank(keel::LocalGroup& group, int rank, std::vector<float>& home_gradients) {
  auto communicator = group.Join(rank);
  Check(communicator.ok(), "Join: " + communicator.status().ToString());
  if (!communicator.ok()) return;
  keel::EngineOptions options;
  options.config_yaml =
      "topology: {num_nodes: 1, gpus_per_node: 2}\n"
      "slots: {persistent_per_rank: 2, transient_per_rank: 0}\n"
      "policy: {name: static}\n";
  options.num_layers = 1;
  options.num_experts = 4;
  options.top_k = 1;
  options.shape.weight_bytes = sizeof(float);
  options.shape.gradient_bytes = sizeof(float);
  options.shape.optimizer_bytes = sizeof(float);
  options.communicator = communicator->get();
  options.local_group = &group;
  auto engine = keel::Engine::Create(options);
  Check(engine.ok(), "Engine::Create: " + engine.status().ToString());
  if (!engine.ok()) return;
  std::vector<float> weights(2, 0.0f), gradients(2, 0.0f), optimizer(2, 0.0f);
  for (int slot = 0; slot < 2; ++slot) {
    Check(
        (*engine)->RegisterSlot(0, slot, {&weights[slot], &gradients[slot], &optimizer[slot]}).ok(),
        "RegisterSlot");
  }
  std::vector<int32_t> ids(8);
  for (int t = 0; t < 8; ++t) ids[t] = t % 4;
  auto route = (*engine)->Route(0, ids);
  Check(route.ok(), "Route: " + route.status().ToString());
  if (!route.ok()) return;
  Check(route->send_counts.size() == 2, "send_counts has 2 entries");
  Check(route->send_counts[0] == 4 && route->send_counts[1] == 4, "4 rows to each rank");
  for (int slot = 0; slot < 2; ++slot) {
    for (int source = 0; source < 2; ++source) {
      gradients[slot] += static_cast<float>(route->recv_counts[source * 2 + slot]);
    }
  }
  Check((*engine)->ReduceGradients().ok(), "ReduceGradients");
  Check((*engine)->StepEnd().ok(), "StepEnd");
  for (const keel::HomeSlot& home : (*engine)->HomeSlots(0)) {
    home_gradients[home.expert] = gradients[home.local_slot];
  }
  const keel::LayerPlacement placement = (*engine)->placement(0);
  Check(placement.phy2log == std::vector<int32_t>({0, 1, 2, 3}), "static phy2log");
}

}  // namespace

int main() {
  auto group = keel::LocalGroup::Create(2);
  Check(group.ok(), "LocalGroup::Create");
  if (!group.ok()) return 1;
  std::vector<float> home_gradients(4, -1.0f);
  std::thread other([&] { RunRank(**group, 1, home_gradients); });
  RunRank(**group, 0, home_gradients);
  other.join();
  for (int e = 0; e < 4; ++e) {
    Check(home_gradients[e] == 4.0f, "expert " + std::to_string(e) + " gradient " +
                                         std::to_string(home_gradients[e]) + ", expected 4");
  }

  // DeepSeek's EPLB example (its README): 2 nodes, 8 GPUs, 16 replicas, 4 groups.
  keel::PlanRequest request;
  request.policy = "eplb";
  request.num_layers = 1;
  request.num_experts = 12;
  request.weight = {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86};
  request.num_replicas = 16;
  request.num_groups = 4;
  request.num_nodes = 2;
  request.num_gpus = 8;
  auto plan = keel::PlanPlacement(request);
  Check(plan.ok(), "PlanPlacement: " + plan.status().ToString());
  if (plan.ok()) {
    Check(
        plan->phy2log == std::vector<int32_t>({5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1}),
        "EPLB example's phy2log");
  }

  auto bad = keel::Config::FromYaml("policy:\n  name: roundrobin\n", "mine.yaml");
  Check(!bad.ok() && bad.status().message().find("mine.yaml:2") != std::string::npos &&
            bad.status().message().find("roundrobin") != std::string::npos,
        "a bad policy name is refused with its line: " + bad.status().ToString());
  Check(std::string(keel_version()) == keel::kVersion, "keel_version() matches keel::kVersion");

  if (failures > 0) return 1;
  std::printf("consumer: installed Keel %s works\n", keel::kVersion);
  return 0;
}
