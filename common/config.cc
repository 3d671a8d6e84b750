// PLACEHOLDER: replaced by the real config table and parser.
#include "common/config.h"
namespace keel {
Result<KeelConfig> ParseConfig(std::string_view, std::string_view) { return KeelConfig{}; }
Result<KeelConfig> LoadConfigFile(const std::string&) { return KeelConfig{}; }
Status ValidateConfig(const KeelConfig&) { return Status::Ok(); }
std::string ConfigReferenceMarkdown() { return ""; }
std::string ConfigHelpText() { return ""; }
std::string_view EstimatorKindName(EstimatorKind) { return "ema"; }
}  // namespace keel
