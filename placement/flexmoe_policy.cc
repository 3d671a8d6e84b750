// PLACEHOLDER: replaced by the real `flexmoe` policy.
#include "placement/policy.h"
namespace keel {
std::unique_ptr<Policy> MakeFlexMoePolicy(const PolicyContext&) { return nullptr; }
}  // namespace keel
