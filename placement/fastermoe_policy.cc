// PLACEHOLDER: replaced by the real `fastermoe` policy.
#include "placement/policy.h"
namespace keel {
std::unique_ptr<Policy> MakeFasterMoePolicy(const PolicyContext&) { return nullptr; }
}  // namespace keel
