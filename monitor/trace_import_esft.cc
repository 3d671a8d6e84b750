// ESFT's per-sequence expert ids (expert_weights_{layer}.txt of one task, or every task's folder
// mixed) into a keel::Trace with its sequences.
#include "monitor/trace_import.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "common/random.h"
#include "monitor/trace.h"
#include "monitor/trace_files.h"

namespace keel {

using trace_files::FolderEntry;
using trace_files::IsEsftTaskFolder;
using trace_files::IsFolder;
using trace_files::ListFolder;
using trace_files::NumberBetween;
using trace_files::ReadTraceFile;
using trace_files::SplitLines;
namespace fs = std::filesystem;

namespace {

// Adds one sequence's expert ids (before the double tab) into counts[layer * E + id].
Status ParseEsftLine(std::string_view line, const std::string& where, int num_experts,
                     double* layer_counts, size_t* ids_read) {
  size_t split = line.find("\t\t");
  if (split == std::string_view::npos) {
    return InvalidArgument(where + ": expected '<expert ids>\\t\\t<gate weights>'");
  }
  std::string_view ids = line.substr(0, split);
  std::string_view weights = line.substr(split + 2);
  size_t num_ids = 0;
  const char* cursor = ids.data();
  const char* end = ids.data() + ids.size();
  while (cursor < end) {
    // Read at its full width, so that an id beyond 64 bits is out of range, as it is.
    const char* token_end = std::find(cursor, end, '\t');
    const std::string token(cursor, token_end);
    int64_t id = 0;
    auto [next, error] = std::from_chars(cursor, token_end, id);
    if (next != token_end || (error != std::errc() && error != std::errc::result_out_of_range)) {
      return InvalidArgument(where + ": expert id " + std::to_string(num_ids) + " ('" + token +
                             "') is not an integer");
    }
    if (error == std::errc::result_out_of_range || id < 0 || id >= num_experts) {
      return InvalidArgument(where + ": expert id " + token + " outside 0.." +
                             std::to_string(num_experts - 1));
    }
    layer_counts[id] += 1.0;
    ++num_ids;
    cursor = token_end < end ? token_end + 1 : token_end;
  }
  // The weights are not counted as load, but a file whose weights are not probabilities is not
  // the gate output it claims to be.
  size_t num_weights = 0;
  cursor = weights.data();
  end = weights.data() + weights.size();
  while (cursor < end) {
    const char* token_end = std::find(cursor, end, '\t');
    double weight = 0;
    auto [next, error] = std::from_chars(cursor, token_end, weight);
    if (error != std::errc() || next != token_end || !std::isfinite(weight) || weight < 0) {
      return InvalidArgument(where + ": gate weight " + std::to_string(num_weights) + " ('" +
                             std::string(cursor, token_end) +
                             "') is not a finite non-negative number");
    }
    ++num_weights;
    cursor = token_end < end ? token_end + 1 : token_end;
  }
  if (num_weights != num_ids) {
    return InvalidArgument(where + ": " + std::to_string(num_ids) + " expert ids but " +
                           std::to_string(num_weights) + " gate weights");
  }
  *ids_read = num_ids;
  return Status::Ok();
}

// The ESFT task folders inside `path` (results/expert_scores/), sorted by name.
std::vector<FolderEntry> EsftTaskFolders(const std::string& path) {
  std::vector<FolderEntry> tasks;
  for (const FolderEntry& entry : ListFolder(path)) {
    if (entry.is_directory && IsEsftTaskFolder(entry.path)) tasks.push_back(entry);
  }
  std::sort(tasks.begin(), tasks.end(),
            [](const FolderEntry& a, const FolderEntry& b) { return a.name < b.name; });
  return tasks;
}

// Whether `sequences` sequences and `steps` steps of `layers` x `num_experts` counts each stay
// within the counts a trace may hold (TraceCounts); checked before they are allocated.
Status CheckEsftCounts(size_t sequences, size_t steps, int layers, int num_experts,
                       const std::string& where) {
  const auto rows = static_cast<double>(sequences + steps);
  KEEL_ASSIGN_OR_RETURN(const TraceCountLimit limit, TraceCounts());
  if (rows * layers * num_experts <= static_cast<double>(limit.counts)) return Status::Ok();
  return InvalidArgument(where + ": " + std::to_string(sequences) + " sequences" +
                         (steps > 0 ? " in " + std::to_string(steps) + " steps" : std::string()) +
                         " of " + std::to_string(layers) + " layers x " +
                         std::to_string(num_experts) + " experts hold more counts than " +
                         limit.text);
}

// One ESFT task: every sequence with its counts per (layer, expert) and its tokens. `held`: the
// sequences of the tasks before.
Result<std::vector<TraceSequence>> ReadEsftTask(const std::string& path, const std::string& group,
                                                const EsftImportOptions& options, int* num_layers,
                                                size_t held) {
  std::map<int64_t, std::string> layer_files;
  for (const FolderEntry& entry : ListFolder(path)) {
    KEEL_ASSIGN_OR_RETURN(std::optional<int64_t> layer,
                          NumberBetween(entry.name, "expert_weights_", ".txt"));
    if (layer) layer_files[*layer] = entry.path;
  }
  if (layer_files.empty()) return NotFound(path + ": no expert_weights_{layer}.txt files");
  int64_t expected_layer = 1;
  for (const auto& [layer, file] : layer_files) {
    if (layer != expected_layer) {
      return NotFound(path + ": expert_weights_" + std::to_string(expected_layer) +
                      ".txt is missing (MoE layers must be numbered 1..L without gaps)");
    }
    ++expected_layer;
  }
  const int layers = static_cast<int>(layer_files.size());
  if (*num_layers != 0 && *num_layers != layers) {
    return InvalidArgument(path + ": " + std::to_string(layers) +
                           " layers, the tasks before have " + std::to_string(*num_layers));
  }
  *num_layers = layers;
  const size_t layer_stride = static_cast<size_t>(options.num_experts);
  std::vector<TraceSequence> sequences;
  std::string first_file;
  for (const auto& [layer, file] : layer_files) {
    KEEL_ASSIGN_OR_RETURN(std::string text, ReadTraceFile(file));
    KEEL_ASSIGN_OR_RETURN(std::vector<std::string_view> lines, SplitLines(text, file));
    if (layer == 1) {
      first_file = file;
      if (lines.empty()) return InvalidArgument(file + ": no sequences");
      KEEL_RETURN_IF_ERROR(
          CheckEsftCounts(held + lines.size(), 0, layers, options.num_experts, file));
      sequences.resize(lines.size());
      for (TraceSequence& sequence : sequences) {
        sequence.group = group;
        sequence.counts.assign(layer_stride * layers, 0.0);
      }
    } else if (lines.size() != sequences.size()) {
      return InvalidArgument(file + ": " + std::to_string(lines.size()) + " sequences, but " +
                             first_file + " has " + std::to_string(sequences.size()));
    }
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string where = file + ":" + std::to_string(i + 1);
      size_t ids = 0;
      KEEL_RETURN_IF_ERROR(ParseEsftLine(lines[i], where, options.num_experts,
                                         sequences[i].counts.data() + (layer - 1) * layer_stride,
                                         &ids));
      if (ids % static_cast<size_t>(options.top_k) != 0) {
        return InvalidArgument(where + ": " + std::to_string(ids) +
                               " expert ids is not a multiple of top_k " +
                               std::to_string(options.top_k));
      }
      const auto tokens = static_cast<int64_t>(ids / options.top_k);
      if (layer == 1) {
        sequences[i].tokens = tokens;
      } else if (tokens != sequences[i].tokens) {
        return InvalidArgument(where + ": " + std::to_string(tokens) + " tokens, but " +
                               first_file + " line " + std::to_string(i + 1) + " has " +
                               std::to_string(sequences[i].tokens));
      }
    }
  }
  return sequences;
}

}  // namespace

Result<Trace> ImportEsftTrace(const std::string& path, const EsftImportOptions& options) {
  if (options.sequences_per_step < 1) {
    return InvalidArgument("esft: sequences_per_step " +
                           std::to_string(options.sequences_per_step) + " must be at least 1");
  }
  if (options.num_experts < 1 || options.num_experts > kMaxExperts) {
    return InvalidArgument("esft: num_experts " + std::to_string(options.num_experts) +
                           " must be in [1, " + std::to_string(kMaxExperts) + "]");
  }
  if (options.top_k < 1 || options.top_k > options.num_experts) {
    return InvalidArgument("esft: top_k " + std::to_string(options.top_k) + " must be in [1, " +
                           std::to_string(options.num_experts) + "]");
  }
  if (!IsFolder(path)) {
    return NotFound(path + ": not a folder of expert_weights_{layer}.txt files (ESFT trace)");
  }
  // One task's folder, or the folder of every task: then the tasks' sequences are mixed.
  std::vector<FolderEntry> tasks;
  const bool mixed = !IsEsftTaskFolder(path) && !EsftTaskFolders(path).empty();
  if (mixed) {
    tasks = EsftTaskFolders(path);
  } else {
    tasks.push_back({fs::path(path).filename().string(), path, true});
  }
  Trace trace;
  trace.num_experts = options.num_experts;
  trace.num_sources = 0;
  std::vector<TraceSequence> sequences;
  std::string names;
  for (const FolderEntry& task : tasks) {
    KEEL_ASSIGN_OR_RETURN(
        std::vector<TraceSequence> read,
        ReadEsftTask(task.path, task.name, options, &trace.num_layers, sequences.size()));
    names += (names.empty() ? "" : ", ") + task.name + " " + std::to_string(read.size());
    for (TraceSequence& sequence : read) sequences.push_back(std::move(sequence));
  }
  if (mixed) {
    // Real batches mix tasks: a seeded Fisher-Yates shuffle (splitmix64), the same everywhere.
    uint64_t state = options.mix_seed;
    for (size_t i = sequences.size(); i > 1; --i) {
      std::swap(sequences[i - 1], sequences[SplitMix64(state) % i]);
    }
  }
  const size_t per_step = static_cast<size_t>(options.sequences_per_step);
  KEEL_RETURN_IF_ERROR(CheckEsftCounts(sequences.size(),
                                       (sequences.size() + per_step - 1) / per_step,
                                       trace.num_layers, trace.num_experts, path));
  const size_t row = static_cast<size_t>(trace.num_layers) * trace.num_experts;
  for (size_t first = 0; first < sequences.size(); first += per_step) {
    std::vector<double> counts(row, 0.0);
    std::vector<TraceSequence> step;
    for (size_t i = first; i < std::min(sequences.size(), first + per_step); ++i) {
      for (size_t c = 0; c < row; ++c) counts[c] += sequences[i].counts[c];
      step.push_back(std::move(sequences[i]));
    }
    trace.step_ids.push_back(static_cast<int64_t>(first));
    trace.steps.push_back(std::move(counts));
    if (options.keep_sequences) trace.sequences.push_back(std::move(step));
  }
  trace.description =
      "esft: " + path + " (" + std::to_string(sequences.size()) + " sequences" +
      (mixed ? " of " + names + ", mixed with seed " + std::to_string(options.mix_seed)
             : std::string()) +
      ", " + std::to_string(options.sequences_per_step) + " per step; layer l = MoE layer l+1)";
  KEEL_RETURN_IF_ERROR(trace.Validate());
  return trace;
}

}  // namespace keel
