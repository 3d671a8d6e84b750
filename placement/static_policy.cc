// `static`: contiguous experts per rank, never changes (the DeepSpeed / Megatron baseline).
#include "placement/policy.h"

namespace keel {
namespace {

class StaticPolicy final : public Policy {
 public:
  explicit StaticPolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "static"; }
  Result<Placement> Replan(const LayerView& view) override { return *view.current; }
};

}  // namespace

std::unique_ptr<Policy> MakeStaticPolicy(const PolicyContext& context) {
  return std::make_unique<StaticPolicy>(context);
}

}  // namespace keel
