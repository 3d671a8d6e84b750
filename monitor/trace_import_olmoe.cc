// OLMoE's per-domain expert counts (expert_counts_derived.json: per model and kind, each domain's
// counts per layer and expert) into a keel::Trace, one step per domain.
#include "monitor/trace_import.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/json.h"
#include "monitor/trace_files.h"

namespace keel {

using trace_files::IsFolder;
using trace_files::ReadTraceFile;
namespace fs = std::filesystem;

Result<Trace> ImportOlmoeTrace(const std::string& path, const OlmoeImportOptions& options) {
  std::string file = path;
  if (IsFolder(path)) {
    file = (fs::path(path) / "expert_counts_derived.json").string();
  }
  KEEL_ASSIGN_OR_RETURN(std::string text, ReadTraceFile(file));
  Result<nlohmann::json> parsed = ParseJson(text);
  if (!parsed.ok()) return parsed.status().WithContext(file);
  const nlohmann::json& root = *parsed;
  auto list_keys = [](const nlohmann::json& object) {
    std::string keys;
    for (auto it = object.begin(); it != object.end(); ++it) {
      keys += (keys.empty() ? "" : ", ") + it.key();
    }
    return keys;
  };
  if (!root.is_object() || !root.contains("models") || !root["models"].is_object()) {
    return InvalidArgument(file + ": expected an object with \"models\"");
  }
  const nlohmann::json& models = root["models"];
  if (!models.contains(options.model)) {
    return NotFound(file + ": model '" + options.model +
                    "' not found; models: " + list_keys(models));
  }
  const nlohmann::json& kinds = models[options.model];
  if (!kinds.is_object() || !kinds.contains(options.kind)) {
    return NotFound(file + ": model '" + options.model + "' has no kind '" + options.kind +
                    "'; kinds: " + (kinds.is_object() ? list_keys(kinds) : std::string()));
  }
  const nlohmann::json& domains = kinds[options.kind];
  if (!domains.is_object() || domains.empty()) {
    return InvalidArgument(file + ": models." + options.model + "." + options.kind +
                           " must map domains to [[count per expert] per layer]");
  }
  std::string layer_names;
  if (root.contains("layers") && root["layers"].is_array()) {
    for (const nlohmann::json& layer : root["layers"]) {
      layer_names += (layer_names.empty() ? "" : ",") + layer.dump();
    }
  }
  Trace trace;
  trace.num_sources = 0;
  // nlohmann::json keeps object keys sorted, so domains come in sorted order.
  for (auto it = domains.begin(); it != domains.end(); ++it) {
    const std::string where =
        file + ": models." + options.model + "." + options.kind + "." + it.key();
    const nlohmann::json& layers = it.value();
    if (!layers.is_array() || layers.empty() || !layers[0].is_array() || layers[0].empty()) {
      return InvalidArgument(where + " must be [[count per expert] per layer]");
    }
    if (trace.steps.empty()) {
      trace.num_layers = static_cast<int>(layers.size());
      trace.num_experts = static_cast<int>(layers[0].size());
    }
    if (static_cast<int>(layers.size()) != trace.num_layers) {
      return InvalidArgument(where + " has " + std::to_string(layers.size()) +
                             " layers, expected " + std::to_string(trace.num_layers));
    }
    std::vector<double> counts;
    counts.reserve(static_cast<size_t>(trace.num_layers) * trace.num_experts);
    for (size_t layer = 0; layer < layers.size(); ++layer) {
      const nlohmann::json& row = layers[layer];
      if (!row.is_array() || static_cast<int>(row.size()) != trace.num_experts) {
        return InvalidArgument(where + ": layer " + std::to_string(layer) + " has " +
                               std::to_string(row.is_array() ? row.size() : 0) +
                               " counts, expected " + std::to_string(trace.num_experts));
      }
      for (size_t expert = 0; expert < row.size(); ++expert) {
        const nlohmann::json& count = row[expert];
        if (!count.is_number() || !(count.get<double>() >= 0.0)) {
          return InvalidArgument(where + ": layer " + std::to_string(layer) + " expert " +
                                 std::to_string(expert) +
                                 " is not a non-negative number: " + count.dump());
        }
        counts.push_back(count.get<double>());
      }
    }
    trace.step_ids.push_back(trace.num_steps());
    trace.steps.push_back(std::move(counts));
    trace.description += (trace.description.empty() ? "" : ",") + it.key();
  }
  trace.description = "olmoe: " + options.model + " " + options.kind + " from " + file +
                      "; model layers [" + layer_names +
                      "]; one step per domain: " + trace.description;
  KEEL_RETURN_IF_ERROR(trace.Validate());
  return trace;
}

}  // namespace keel
