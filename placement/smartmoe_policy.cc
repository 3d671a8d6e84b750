// PLACEHOLDER: replaced by the real `smartmoe` policy.
#include "placement/policy.h"
namespace keel {
std::unique_ptr<Policy> MakeSmartMoePolicy(const PolicyContext&) { return nullptr; }
}  // namespace keel
