// PLACEHOLDER: replaced by the real EPLB.
#include "placement/eplb.h"
namespace keel {
Result<EplbOutput> RebalanceExperts(const EplbInput&) { return Unimplemented("eplb"); }
}  // namespace keel
