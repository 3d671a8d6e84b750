// PLACEHOLDER: replaced by the real `eplb` policy.
#include "placement/policy.h"
namespace keel {
std::unique_ptr<Policy> MakeEplbPolicy(const PolicyContext&) { return nullptr; }
}  // namespace keel
