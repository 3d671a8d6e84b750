// The names `policy.name` accepts: the built-in placement policies, then those a program added
// with keel::RegisterPolicy (keel/policy.hpp), in the order they were added. Kept here, below
// the config, so that the config can check a name without knowing how policies are built.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace keel {

// The built-in policies, in the order reports list them (docs/policies.md).
inline constexpr std::string_view kBuiltinPolicyNames[] = {
    "static", "eplb", "flexmoe",  "smartmoe", "fastermoe",
    "velb",   "lplb", "swiftmoe", "trtllm",   "keel"};

// Adds a registered policy's name; false (nothing added) when the name is already known.
// Thread-safe.
bool AddPolicyName(std::string_view name);

// The names added with AddPolicyName, in the order they were added. Thread-safe.
std::vector<std::string> AddedPolicyNames();

// True for a built-in or added name. Thread-safe.
bool IsPolicyName(std::string_view name);

}  // namespace keel
