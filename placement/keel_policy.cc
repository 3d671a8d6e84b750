// PLACEHOLDER: replaced by the real `keel` policy.
#include "placement/policy.h"
namespace keel {
std::unique_ptr<Policy> MakeKeelPolicy(const PolicyContext&) { return nullptr; }
}  // namespace keel
