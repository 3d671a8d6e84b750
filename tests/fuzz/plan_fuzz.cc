// libFuzzer target: `keel plan`'s JSON input, then the plan itself with the policy the first byte
// picks. Any input must come back as a plan or as an error; a plan must give every expert at least
// one slot in every layer, and only experts that exist.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/json.h"
#include "keel/plan.hpp"
#include "tools/plan_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const char* const kPolicies[] = {"eplb", "keel", "static", "flexmoe", "lplb", "velb"};
  const char* policy = kPolicies[data[0] % (sizeof kPolicies / sizeof kPolicies[0])];
  const keel::Result<nlohmann::json> input =
      keel::ParseJson(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  if (!input.ok()) return 0;
  keel::Result<keel::PlanRequest> request = keel::tools::ParsePlanInput(*input);
  if (!request.ok()) return 0;
  request->policy = policy;
  keel::Result<keel::PlanResult> plan = keel::PlanPlacement(*request);
  if (!plan.ok()) return 0;
  for (int layer = 0; layer < plan->num_layers; ++layer) {
    std::vector<int> copies(plan->num_experts, 0);
    for (int slot = 0; slot < plan->num_replicas; ++slot) {
      const int expert = plan->phy2log[static_cast<size_t>(layer) * plan->num_replicas + slot];
      if (expert == -1) continue;
      if (expert < 0 || expert >= plan->num_experts) std::abort();
      ++copies[expert];
    }
    for (int count : copies) {
      if (count < 1) std::abort();
    }
  }
  return 0;
}
