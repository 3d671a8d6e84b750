// Megatron-LM's router tracer (router_trace_rank*.jsonl: per step, layer and rank, each token's
// top-k expert ids or the counts per expert) into a keel::Trace.
#include "monitor/trace_import.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "common/json.h"
#include "monitor/trace.h"
#include "monitor/trace_files.h"

namespace keel {

using trace_files::EndsWith;
using trace_files::FolderEntry;
using trace_files::IsFolder;
using trace_files::ListFolder;
using trace_files::ReadTraceFile;
using trace_files::SplitLines;

namespace {

// Decoder layers first (by number), then multi-token-prediction layers by (head, layer).
struct MegatronLayerKey {
  int block = 0;  // 0 decoder, 1 mtp
  int64_t mtp_index = 0;
  int64_t layer = 0;
  auto operator<=>(const MegatronLayerKey&) const = default;
  std::string Name() const {
    return block == 0 ? std::to_string(layer)
                      : "mtp" + std::to_string(mtp_index) + "." + std::to_string(layer);
  }
};

struct MegatronRecordKey {
  int64_t step = 0;
  MegatronLayerKey layer;
  int64_t rank = 0;
  auto operator<=>(const MegatronRecordKey&) const = default;
};

// A record's step, layer, rank or MTP head number: an integer from 0 up.
Result<int64_t> RecordInt(const nlohmann::json& record, const char* key, const std::string& where,
                          std::optional<int64_t> fallback) {
  auto it = record.find(key);
  if (it == record.end()) {
    if (fallback) return *fallback;
    return InvalidArgument(where + ": record has no \"" + key + "\"");
  }
  Result<int64_t> value = JsonInteger(*it, std::string("\"") + key + "\"", 0);
  if (!value.ok()) return value.status().WithContext(where);
  return value;
}

// Adds one record's selections into `counts`, growing it to the largest expert id seen. `held`
// is the counts of all records so far: sparse ids cannot make them more than `limit`.
Status AddMegatronRecord(const nlohmann::json& record, const std::string& where,
                         std::vector<double>& counts, int64_t& held, const TraceCountLimit& limit) {
  // `expert` is in [0, kMaxExperts).
  auto add = [&](int64_t expert, double value) -> Status {
    if (static_cast<size_t>(expert) >= counts.size()) {
      held += expert + 1 - static_cast<int64_t>(counts.size());
      if (held > limit.counts) {
        return InvalidArgument(where + ": expert id " + std::to_string(expert) +
                               " takes the records' counts (a row up to the largest id per "
                               "step, layer and rank) past " +
                               limit.text);
      }
      counts.resize(expert + 1, 0.0);
    }
    counts[expert] += value;
    return Status::Ok();
  };
  auto top_indices = record.find("top_indices");
  if (top_indices != record.end()) {
    if (!top_indices->is_array()) {
      return InvalidArgument(where + ": \"top_indices\" must be [num_tokens][topk] integers");
    }
    size_t token = 0;
    for (const nlohmann::json& choices : *top_indices) {
      if (!choices.is_array()) {
        return InvalidArgument(where + ": top_indices[" + std::to_string(token) +
                               "] is not a list of expert ids");
      }
      for (const nlohmann::json& expert : choices) {
        Result<int64_t> id = JsonInteger(
            expert, "top_indices[" + std::to_string(token) + "]: expert id", 0, kMaxExperts - 1);
        if (!id.ok()) return id.status().WithContext(where);
        KEEL_RETURN_IF_ERROR(add(*id, 1.0));
      }
      ++token;
    }
    return Status::Ok();
  }
  auto expert_counts = record.find("expert_counts");
  if (expert_counts != record.end()) {
    if (!expert_counts->is_array()) {
      return InvalidArgument(where + ": \"expert_counts\" must be a list of numbers");
    }
    int64_t expert = 0;
    for (const nlohmann::json& count : *expert_counts) {
      if (!count.is_number() || !(count.get<double>() >= 0.0) ||
          !std::isfinite(count.get<double>())) {
        return InvalidArgument(where + ": expert_counts[" + std::to_string(expert) +
                               "] is not a non-negative number: " + count.dump());
      }
      if (expert >= kMaxExperts) {
        return InvalidArgument(where + ": expert_counts has more than " +
                               std::to_string(kMaxExperts) + " entries");
      }
      KEEL_RETURN_IF_ERROR(add(expert, count.get<double>()));
      ++expert;
    }
    return Status::Ok();
  }
  return InvalidArgument(where + ": record has neither \"top_indices\" nor \"expert_counts\"");
}

}  // namespace

Result<Trace> ImportMegatronTrace(const std::string& path, const MegatronImportOptions& options) {
  if (options.num_experts < 0 || options.num_experts > kMaxExperts) {
    return InvalidArgument("megatron: num_experts " + std::to_string(options.num_experts) +
                           " must be 0 (infer) or in [1, " + std::to_string(kMaxExperts) + "]");
  }
  std::vector<std::string> files;
  if (IsFolder(path)) {
    for (const FolderEntry& entry : ListFolder(path)) {
      if (entry.name.starts_with("router_trace_rank") && EndsWith(entry.name, ".jsonl")) {
        files.push_back(entry.path);
      }
    }
    std::sort(files.begin(), files.end());
    if (files.empty()) return NotFound(path + ": no router_trace_rank*.jsonl files");
  } else {
    files.push_back(path);
  }

  std::map<MegatronRecordKey, std::vector<double>> records;
  int64_t held = 0;  // counts in `records`
  KEEL_ASSIGN_OR_RETURN(const TraceCountLimit limit, TraceCounts());
  int records_read = 0;
  // Records of counts must all count the same experts; where the first of them is.
  std::optional<std::pair<size_t, std::string>> counts_length;
  for (const std::string& file : files) {
    KEEL_ASSIGN_OR_RETURN(std::string text, ReadTraceFile(file));
    KEEL_ASSIGN_OR_RETURN(std::vector<std::string_view> lines, SplitLines(text, file));
    for (size_t line = 0; line < lines.size(); ++line) {
      if (lines[line].find_first_not_of(" \t") == std::string_view::npos) continue;
      const std::string where = file + ":" + std::to_string(line + 1);
      Result<nlohmann::json> parsed = ParseJson(lines[line], "not a JSON object (truncated file?)");
      if (!parsed.ok()) return parsed.status().WithContext(where);
      const nlohmann::json& record = *parsed;
      if (!record.is_object()) return InvalidArgument(where + ": a record must be an object");
      MegatronRecordKey key;
      // "iteration" is accepted as a synonym of "step" for hand-written traces.
      auto step_field = record.contains("step") ? "step" : "iteration";
      KEEL_ASSIGN_OR_RETURN(key.step, RecordInt(record, step_field, where, std::nullopt));
      KEEL_ASSIGN_OR_RETURN(key.layer.layer, RecordInt(record, "layer", where, std::nullopt));
      KEEL_ASSIGN_OR_RETURN(key.rank, RecordInt(record, "rank", where, int64_t{0}));
      std::string block = "decoder";
      if (auto it = record.find("block"); it != record.end()) {
        if (!it->is_string()) {
          return InvalidArgument(where + ": \"block\" must be a string, got " + it->dump());
        }
        block = it->get<std::string>();
      }
      if (block == "mtp" || record.contains("mtp_idx")) {
        if (!options.include_mtp) continue;
        key.layer.block = 1;
        KEEL_ASSIGN_OR_RETURN(key.layer.mtp_index, RecordInt(record, "mtp_idx", where, 0));
      }
      if (!options.per_source) key.rank = 0;
      if (auto counts = record.find("expert_counts");
          !record.contains("top_indices") && counts != record.end() && counts->is_array()) {
        if (!counts_length) counts_length.emplace(counts->size(), where);
        if (counts->size() != counts_length->first) {
          return InvalidArgument(where + ": expert_counts has " + std::to_string(counts->size()) +
                                 " entries, the record at " + counts_length->second + " has " +
                                 std::to_string(counts_length->first));
        }
      }
      KEEL_RETURN_IF_ERROR(AddMegatronRecord(record, where, records[key], held, limit));
      ++records_read;
      if (options.progress && records_read % 1000 == 0) options.progress(records_read, 0);
    }
  }
  if (records.empty()) return InvalidArgument(path + ": no router records");

  std::map<int64_t, int> step_index;
  std::map<MegatronLayerKey, int> layer_index;
  std::map<int64_t, int> rank_index;
  size_t max_experts = 0;
  for (const auto& [key, counts] : records) {
    step_index.emplace(key.step, 0);
    layer_index.emplace(key.layer, 0);
    rank_index.emplace(key.rank, 0);
    max_experts = std::max(max_experts, counts.size());
  }
  if (options.num_experts > 0 && max_experts > static_cast<size_t>(options.num_experts)) {
    return InvalidArgument(path + ": expert id " + std::to_string(max_experts - 1) +
                           " is not below num_experts " + std::to_string(options.num_experts));
  }
  auto number = [](auto& index) {
    int next = 0;
    for (auto& [key, value] : index) value = next++;
  };
  number(step_index);
  number(layer_index);
  number(rank_index);

  Trace trace;
  trace.num_layers = static_cast<int>(layer_index.size());
  trace.num_experts = options.num_experts > 0 ? options.num_experts : static_cast<int>(max_experts);
  trace.num_sources = options.per_source ? static_cast<int>(rank_index.size()) : 0;
  // Every (step, layer, rank) the records name gets a row, recorded or not: sparse ids of steps,
  // layers and ranks multiply.
  KEEL_RETURN_IF_ERROR(CheckTraceShape(trace.num_layers, trace.num_experts, trace.num_sources,
                                       static_cast<int64_t>(step_index.size()))
                           .WithContext(path));
  for (const auto& [step, index] : step_index) trace.step_ids.push_back(step);
  const size_t row_size = static_cast<size_t>(trace.row_size());
  trace.steps.assign(step_index.size(), std::vector<double>(row_size * trace.num_layers, 0.0));
  for (const auto& [key, counts] : records) {
    double* row =
        trace.steps[step_index[key.step]].data() +
        static_cast<size_t>(layer_index[key.layer]) * row_size +
        (options.per_source ? static_cast<size_t>(rank_index[key.rank]) : 0) * trace.num_experts;
    for (size_t expert = 0; expert < counts.size(); ++expert) row[expert] += counts[expert];
  }
  std::string layers;
  for (const auto& [key, index] : layer_index) layers += (layers.empty() ? "" : ",") + key.Name();
  std::string ranks;
  for (const auto& [rank, index] : rank_index) {
    ranks += (ranks.empty() ? "" : ",") + std::to_string(rank);
  }
  trace.description = "megatron: " + path + "; model layers [" + layers + "]" +
                      (options.per_source ? "; sources = ranks [" + ranks + "]" : "; ranks summed");
  KEEL_RETURN_IF_ERROR(trace.Validate());
  return trace;
}

}  // namespace keel
