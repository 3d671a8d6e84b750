// A placement policy written outside Keel: `hot_copies` gives every spare slot to the expert with
// the most expected tokens per copy, places each new copy on the least-loaded rank that lacks the
// expert, and lets Keel split each step's tokens by exact quotas. It is registered by name and
// then replayed beside built-in policies on a synthetic trace, through Keel's public API alone.
//
// Usage: custom_policy > report.json   (the replay report, as `keel replay --report` writes it)
#include <keel/config.hpp>
#include <keel/policy.hpp>
#include <keel/replay.hpp>
#include <keel/trace.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace {

class HotCopies final : public keel::PlacementPolicy {
 public:
  explicit HotCopies(const keel::PolicyShape& shape) : shape_(shape) {}

  // Keep each expert's home copy (its optimizer state never moves) and plan the rest afresh.
  keel::Result<std::vector<int>> Replan(const keel::ReplanInput& input) override {
    const int per_rank = shape_.slots_per_rank;
    std::vector<int> phy2log(input.phy2log.size(), -1);
    std::vector<int> copies(shape_.num_experts, 1);
    std::vector<double> rank_load(shape_.num_ranks(), 0.0);
    for (int e = 0; e < shape_.num_experts; ++e) {
      const int home = input.home[e];
      int slot = home * per_rank;
      while (phy2log[slot] != -1) ++slot;
      phy2log[slot] = e;
    }
    auto per_copy = [&](int e) { return input.expert_load[e] / copies[e]; };
    auto holds = [&](int rank, int e) {
      return std::find(phy2log.begin() + rank * per_rank, phy2log.begin() + (rank + 1) * per_rank,
                       e) != phy2log.begin() + (rank + 1) * per_rank;
    };
    const long spare = std::count(phy2log.begin(), phy2log.end(), -1);
    for (long given = 0; given < spare; ++given) {
      int hot = 0;
      for (int e = 1; e < shape_.num_experts; ++e) {
        if (per_copy(e) > per_copy(hot)) hot = e;
      }
      int target = -1;
      for (int r = 0; r < shape_.num_ranks(); ++r) {
        const bool free = std::count(phy2log.begin() + r * per_rank,
                                     phy2log.begin() + (r + 1) * per_rank, -1) > 0;
        if (free && !holds(r, hot) && (target < 0 || rank_load[r] < rank_load[target])) {
          target = r;
        }
      }
      if (target < 0) break;
      int slot = target * per_rank;
      while (phy2log[slot] != -1) ++slot;
      phy2log[slot] = hot;
      ++copies[hot];
      rank_load[target] += per_copy(hot);
    }
    return phy2log;
  }

 private:
  keel::PolicyShape shape_;
};

}  // namespace

int main() {
  keel::PolicyRegistration registration;
  registration.name = "hot_copies";
  registration.create = [](const keel::PolicyShape& shape) {
    return std::make_unique<HotCopies>(shape);
  };
  registration.routing = keel::PolicyRouting::kQuotas;
  if (keel::Status status = keel::RegisterPolicy(std::move(registration)); !status.ok()) {
    std::fprintf(stderr, "custom_policy: %s\n", status.ToString().c_str());
    return 1;
  }

  keel::Result<keel::Trace> trace = keel::GenerateSyntheticTrace({});
  keel::Result<keel::Config> config = keel::Config::FromYaml(
      "topology: {num_nodes: 1, gpus_per_node: 8}\n"
      "slots: {persistent_per_rank: 5}\n"
      "policy: {name: hot_copies}\n");
  if (!trace.ok() || !config.ok()) {
    std::fprintf(stderr, "custom_policy: %s\n",
                 (!trace.ok() ? trace.status() : config.status()).ToString().c_str());
    return 1;
  }
  keel::ReplayRequest request;
  request.trace = &*trace;
  request.config = &*config;
  request.policies = {"static", "eplb", "hot_copies", "keel"};
  request.include_series = false;
  keel::Result<std::string> report = keel::ReplayToJson(request);
  if (!report.ok()) {
    std::fprintf(stderr, "custom_policy: %s\n", report.status().ToString().c_str());
    return 1;
  }
  std::puts(report->c_str());
  return 0;
}
