// The Keel trace format: a JSON Lines reader and writer, the Trace helpers, format names and the
// format-guessing ReadTrace that dispatches to the importers (monitor/trace_import.h).
// Format reference: docs/traces.md.
#include "monitor/trace.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "common/file.h"
#include "common/json.h"
#include "common/number_text.h"
#include "monitor/trace_files.h"
#include "monitor/trace_import.h"

namespace keel {
namespace {

constexpr int kKeelTraceVersion = 1;

// Largest double below which every integer is exact; counts past it are written as doubles.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

struct FormatName {
  TraceFormat format;
  std::string_view name;
};
constexpr FormatName kFormatNames[] = {
    {TraceFormat::kAuto, "auto"},         {TraceFormat::kKeel, "keel"},
    {TraceFormat::kSmartMoe, "smartmoe"}, {TraceFormat::kEsft, "esft"},
    {TraceFormat::kOlmoe, "olmoe"},       {TraceFormat::kMegatron, "megatron"},
};

std::string KnownFormatList() {
  std::string list;
  for (const FormatName& entry : kFormatNames) {
    if (!list.empty()) list += ", ";
    list += entry.name;
  }
  return list;
}

}  // namespace

Result<TraceCountLimit> TraceCounts() {
  KEEL_ASSIGN_OR_RETURN(const uint64_t bytes, InputLimitBytes(InputLimit::kTraceCountBytes));
  const InputLimitInfo& info = InputLimitOf(InputLimit::kTraceCountBytes);
  TraceCountLimit limit;
  limit.counts = static_cast<int64_t>(std::min<uint64_t>(bytes / 8, uint64_t{1} << 62));
  limit.text = "the " + std::to_string(limit.counts) + " counts (" + DescribeBytes(bytes) +
               ") a trace may hold (set " + std::string(info.variable) + " to raise it)";
  return limit;
}

Status CheckTraceShape(int64_t num_layers, int64_t num_experts, int64_t num_sources,
                       int64_t num_steps) {
  if (num_layers > kMaxLayers) {
    return InvalidArgument("num_layers " + std::to_string(num_layers) + " is more than " +
                           std::to_string(kMaxLayers));
  }
  if (num_experts > kMaxExperts) {
    return InvalidArgument("num_experts " + std::to_string(num_experts) + " is more than " +
                           std::to_string(kMaxExperts));
  }
  if (num_sources > kMaxRanks) {
    return InvalidArgument("num_sources " + std::to_string(num_sources) + " is more than " +
                           std::to_string(kMaxRanks));
  }
  // Each factor is at most 2^16 here, so the product per step fits; the steps are checked by
  // division.
  const int64_t per_step = num_layers * num_experts * std::max<int64_t>(num_sources, 1);
  KEEL_ASSIGN_OR_RETURN(const TraceCountLimit limit, TraceCounts());
  if (per_step > limit.counts || (per_step > 0 && num_steps > limit.counts / per_step)) {
    const std::string shape =
        "num_layers x num_sources x num_experts = " + std::to_string(num_layers) + " x " +
        std::to_string(num_sources) + " x " + std::to_string(num_experts);
    return InvalidArgument(num_steps <= 1 ? shape + " counts per step, more than " + limit.text
                                          : std::to_string(num_steps) + " steps of " + shape +
                                                " counts, more than " + limit.text);
  }
  return Status::Ok();
}

namespace {

// Reads an integer member of the header; errors name the key and the value as written.
Result<int64_t> HeaderInt(const nlohmann::json& header, const char* key, const std::string& where,
                          int64_t min_value) {
  auto it = header.find(key);
  if (it == header.end()) return InvalidArgument(where + ": header has no \"" + key + "\"");
  Result<int64_t> value =
      JsonInteger(*it, std::string("header \"") + key + "\"", min_value, int64_t{1} << 30);
  if (!value.ok()) return value.status().WithContext(where);
  return value;
}

// The counts a trace being read holds so far, and the most it may hold.
struct HeldCounts {
  int64_t counts = 0;
  TraceCountLimit limit;
};

Result<HeldCounts> StartHolding(int64_t counts) {
  KEEL_ASSIGN_OR_RETURN(TraceCountLimit limit, TraceCounts());
  return HeldCounts{counts, std::move(limit)};
}

// Adds `more` to the counts `held`; an error past the limit, before they are allocated.
Status HoldCounts(size_t more, HeldCounts& held, const std::string& where) {
  held.counts += static_cast<int64_t>(more);
  if (held.counts <= held.limit.counts) return Status::Ok();
  return InvalidArgument(where +
                         ": the trace holds more counts (steps x layers x sources x experts, and "
                         "the sequences' layers x experts) than " +
                         held.limit.text);
}

// A step line's "sequences": [{"group": "law", "tokens": 64, "layers": [[E counts] x L]}, ...].
// `held`: the counts the trace holds so far.
Result<std::vector<TraceSequence>> ParseSequences(const nlohmann::json& list,
                                                  const std::string& where, const Trace& trace,
                                                  HeldCounts& held) {
  if (!list.is_array()) return InvalidArgument(where + ": \"sequences\" is not an array");
  std::vector<TraceSequence> sequences;
  sequences.reserve(list.size());
  for (const nlohmann::json& item : list) {
    const std::string name = where + ": sequence " + std::to_string(sequences.size());
    if (!item.is_object()) return InvalidArgument(name + " is not a JSON object");
    TraceSequence sequence;
    if (auto group = item.find("group"); group != item.end()) {
      if (!group->is_string()) return InvalidArgument(name + ": \"group\" is not a string");
      sequence.group = group->get<std::string>();
    }
    auto tokens = item.find("tokens");
    if (tokens == item.end() || !tokens->is_number_integer() || tokens->get<int64_t>() < 0 ||
        tokens->get<int64_t>() > static_cast<int64_t>(kMaxTokenCount)) {
      return InvalidArgument(name + ": \"tokens\" is missing or not an integer in [0, 1e15]" +
                             (tokens == item.end() ? std::string() : ": " + tokens->dump()));
    }
    sequence.tokens = tokens->get<int64_t>();
    auto layers = item.find("layers");
    if (layers == item.end() || !layers->is_array() ||
        static_cast<int>(layers->size()) != trace.num_layers) {
      return InvalidArgument(name + ": \"layers\" must be an array of num_layers (" +
                             std::to_string(trace.num_layers) + ") rows");
    }
    const size_t sequence_counts = static_cast<size_t>(trace.num_layers) * trace.num_experts;
    KEEL_RETURN_IF_ERROR(HoldCounts(sequence_counts, held, name));
    sequence.counts.reserve(sequence_counts);
    int layer = 0;
    for (const nlohmann::json& row : *layers) {
      if (!row.is_array() || static_cast<int>(row.size()) != trace.num_experts) {
        return InvalidArgument(name + ": layer " + std::to_string(layer) + " must hold " +
                               std::to_string(trace.num_experts) + " counts (num_experts)");
      }
      for (const nlohmann::json& count : row) {
        const double value = count.is_number() ? count.get<double>() : -1.0;
        if (!(value >= 0.0 && value <= kMaxTokenCount)) {
          return InvalidArgument(name + ": layer " + std::to_string(layer) + " expert " +
                                 std::to_string(sequence.counts.size() % trace.num_experts) +
                                 " is not a count in [0, 1e15]: " + count.dump());
        }
        sequence.counts.push_back(value);
      }
      ++layer;
    }
    sequences.push_back(std::move(sequence));
  }
  return sequences;
}

// Parses one step line into `trace`. `where` is "path:line"; `held`: the counts the trace holds
// so far.
Status ParseStepLine(std::string_view line, const std::string& where, Trace& trace,
                     HeldCounts& held) {
  Result<nlohmann::json> parsed = ParseJson(line, "not a JSON object (truncated file?)");
  if (!parsed.ok()) return parsed.status().WithContext(where);
  const nlohmann::json& step = *parsed;
  if (!step.is_object()) return InvalidArgument(where + ": a step line must be a JSON object");
  auto step_id = step.find("step");
  if (step_id == step.end()) return InvalidArgument(where + ": \"step\" is missing");
  // Steps are a time series: ids from 0 up, each after the one before.
  const Result<int64_t> parsed_id = JsonInteger(*step_id, "step", 0);
  if (!parsed_id.ok()) return parsed_id.status().WithContext(where);
  const int64_t id = *parsed_id;
  if (!trace.step_ids.empty() && id <= trace.step_ids.back()) {
    return InvalidArgument(where + ": step " + std::to_string(id) + " does not follow step " +
                           std::to_string(trace.step_ids.back()) +
                           " (step ids must increase line by line)");
  }
  auto layers = step.find("layers");
  if (layers == step.end() || !layers->is_array()) {
    return InvalidArgument(where + ": \"layers\" is missing or not an array");
  }
  if (static_cast<int>(layers->size()) != trace.num_layers) {
    return InvalidArgument(where + ": step has " + std::to_string(layers->size()) +
                           " layers, header says num_layers " + std::to_string(trace.num_layers));
  }
  const size_t row_size = static_cast<size_t>(trace.row_size());
  KEEL_RETURN_IF_ERROR(HoldCounts(row_size * trace.num_layers, held, where));
  std::vector<double> values;
  values.reserve(row_size * trace.num_layers);
  int layer = 0;
  for (const nlohmann::json& row : *layers) {
    if (!row.is_array() || row.size() != row_size) {
      return InvalidArgument(
          where + ": layer " + std::to_string(layer) + " has " +
          (row.is_array() ? std::to_string(row.size()) + " counts" : std::string("no array")) +
          ", expected " + std::to_string(row_size) +
          (trace.num_sources > 0 ? " (num_sources * num_experts)" : " (num_experts)"));
    }
    int index = 0;
    for (const nlohmann::json& count : row) {
      if (!count.is_number()) {
        return InvalidArgument(where + ": layer " + std::to_string(layer) + " entry " +
                               std::to_string(index) + " is not a number: " + count.dump());
      }
      double value = count.get<double>();
      if (!(value >= 0.0 && value <= kMaxTokenCount)) {
        return InvalidArgument(where + ": layer " + std::to_string(layer) + " entry " +
                               std::to_string(index) +
                               " is not a count in [0, 1e15]: " + count.dump());
      }
      values.push_back(value);
      ++index;
    }
    ++layer;
  }
  auto sequences = step.find("sequences");
  if (sequences != step.end()) {
    if (!trace.steps.empty() && trace.sequences.empty()) {
      return InvalidArgument(where +
                             ": \"sequences\" on this step but not on the steps before "
                             "(a trace records sequences on every step or on none)");
    }
    KEEL_ASSIGN_OR_RETURN(std::vector<TraceSequence> parsed,
                          ParseSequences(*sequences, where, trace, held));
    trace.sequences.push_back(std::move(parsed));
  } else if (!trace.sequences.empty()) {
    return InvalidArgument(where +
                           ": \"sequences\" is missing (the steps before have it; a "
                           "trace records sequences on every step or on none)");
  }
  trace.step_ids.push_back(id);
  trace.steps.push_back(std::move(values));
  return Status::Ok();
}

void AppendCount(std::string& out, double value) {
  char buffer[32];
  std::to_chars_result result;
  if (value == std::floor(value) && std::fabs(value) < kMaxExactInteger) {
    result = std::to_chars(buffer, buffer + sizeof(buffer), static_cast<int64_t>(value));
  } else {
    result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  }
  out.append(buffer, result.ptr);
}

}  // namespace

std::vector<double> Trace::ExpertCounts(int step, int layer) const {
  std::span<const double> row = layer_row(step, layer);
  if (num_sources == 0) return {row.begin(), row.end()};
  std::vector<double> counts(num_experts, 0.0);
  for (int source = 0; source < num_sources; ++source) {
    for (int expert = 0; expert < num_experts; ++expert) {
      counts[expert] += row[static_cast<size_t>(source) * num_experts + expert];
    }
  }
  return counts;
}

Status Trace::Validate() const {
  if (num_layers <= 0)
    return InvalidArgument("trace: num_layers " + std::to_string(num_layers) + " must be positive");
  if (num_experts <= 0) {
    return InvalidArgument("trace: num_experts " + std::to_string(num_experts) +
                           " must be positive");
  }
  if (num_sources < 0) {
    return InvalidArgument("trace: num_sources " + std::to_string(num_sources) +
                           " must be 0 or positive");
  }
  KEEL_RETURN_IF_ERROR(
      CheckTraceShape(num_layers, num_experts, num_sources, static_cast<int64_t>(steps.size()))
          .WithContext("trace"));
  if (step_ids.size() != steps.size()) {
    return InvalidArgument("trace: " + std::to_string(step_ids.size()) + " step ids for " +
                           std::to_string(steps.size()) + " steps");
  }
  const size_t expected = static_cast<size_t>(num_layers) * row_size();
  for (size_t step = 0; step < steps.size(); ++step) {
    if (steps[step].size() != expected) {
      return InvalidArgument("trace: step " + std::to_string(step) + " has " +
                             std::to_string(steps[step].size()) + " counts, expected " +
                             std::to_string(expected) + " (num_layers * row size)");
    }
    for (size_t i = 0; i < expected; ++i) {
      double value = steps[step][i];
      if (!(value >= 0.0 && value <= kMaxTokenCount)) {
        return InvalidArgument("trace: step " + std::to_string(step) + " layer " +
                               std::to_string(i / row_size()) + " entry " +
                               std::to_string(i % row_size()) + " is not a count in [0, 1e15] (" +
                               NumberText(value) + ")");
      }
    }
  }
  if (sequences.empty()) return Status::Ok();
  if (sequences.size() != steps.size()) {
    return InvalidArgument("trace: sequences for " + std::to_string(sequences.size()) +
                           " steps, the trace has " + std::to_string(steps.size()));
  }
  const size_t sequence_counts = static_cast<size_t>(num_layers) * num_experts;
  KEEL_ASSIGN_OR_RETURN(HeldCounts held,
                        StartHolding(static_cast<int64_t>(steps.size() * expected)));
  for (const std::vector<TraceSequence>& of_step : sequences) {
    KEEL_RETURN_IF_ERROR(HoldCounts(of_step.size() * sequence_counts, held, "trace"));
  }
  for (size_t step = 0; step < sequences.size(); ++step) {
    for (size_t i = 0; i < sequences[step].size(); ++i) {
      const TraceSequence& sequence = sequences[step][i];
      const std::string where =
          "trace: step " + std::to_string(step) + " sequence " + std::to_string(i);
      if (sequence.tokens < 0 || sequence.tokens > kMaxTokenCount) {
        return InvalidArgument(where + ": tokens " + std::to_string(sequence.tokens) +
                               " is not in [0, 1e15]");
      }
      if (sequence.counts.size() != sequence_counts) {
        return InvalidArgument(where + " has " + std::to_string(sequence.counts.size()) +
                               " counts, expected " + std::to_string(sequence_counts) +
                               " (num_layers * num_experts)");
      }
      for (size_t c = 0; c < sequence_counts; ++c) {
        const double value = sequence.counts[c];
        if (!(value >= 0.0 && value <= kMaxTokenCount)) {
          return InvalidArgument(where + " layer " + std::to_string(c / num_experts) + " expert " +
                                 std::to_string(c % num_experts) +
                                 " is not a count in [0, 1e15] (" + NumberText(value) + ")");
        }
      }
    }
  }
  return Status::Ok();
}

Result<TraceFormat> ParseTraceFormat(std::string_view name) {
  for (const FormatName& entry : kFormatNames) {
    if (entry.name == name) return entry.format;
  }
  return InvalidArgument("unknown trace format '" + std::string(name) +
                         "'; known formats: " + KnownFormatList());
}

std::string_view TraceFormatName(TraceFormat format) {
  for (const FormatName& entry : kFormatNames) {
    if (entry.format == format) return entry.name;
  }
  return "unknown";
}

namespace {

Result<Trace> ReadTraceAs(const std::string& path, TraceFormat format) {
  switch (format) {
    case TraceFormat::kKeel:
      return ReadKeelTrace(path);
    case TraceFormat::kSmartMoe:
      return ImportSmartMoeTrace(path);
    case TraceFormat::kEsft:
      return ImportEsftTrace(path);
    case TraceFormat::kOlmoe:
      return ImportOlmoeTrace(path);
    case TraceFormat::kMegatron:
      return ImportMegatronTrace(path);
    case TraceFormat::kAuto:
      break;
  }
  return Internal("ReadTrace: unhandled format");
}

}  // namespace

Result<Trace> ReadTrace(const std::string& path, TraceFormat format) {
  if (format != TraceFormat::kAuto) return ReadTraceAs(path, format);
  KEEL_ASSIGN_OR_RETURN(const TraceFormat guessed, DetectTraceFormat(path));
  Result<Trace> trace = ReadTraceAs(path, guessed);
  if (!trace.ok()) return trace.status().WithContext(GuessedFormatContext(guessed));
  return trace;
}

std::string GuessedFormatContext(TraceFormat guessed) {
  return "read as " + std::string(TraceFormatName(guessed)) +
         " (the format guessed from the path; --format chooses another)";
}

Result<Trace> ReadKeelTrace(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::string text, trace_files::ReadTraceFile(path));
  KEEL_ASSIGN_OR_RETURN(const uint64_t max_line, InputLimitBytes(InputLimit::kTraceLineBytes));
  Trace trace;
  std::string_view rest = text;
  int line_number = 0;
  bool have_header = false;
  KEEL_ASSIGN_OR_RETURN(HeldCounts held, StartHolding(0));  // the steps read so far
  while (!rest.empty()) {
    size_t end = rest.find('\n');
    std::string_view line = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;  // blank line
    const std::string where = path + ":" + std::to_string(line_number);
    KEEL_RETURN_IF_ERROR(trace_files::CheckLineLength(line, where, max_line));
    if (!have_header) {
      Result<nlohmann::json> parsed = ParseJson(line, "header is not JSON");
      if (!parsed.ok()) return parsed.status().WithContext(where);
      const nlohmann::json& header = *parsed;
      if (!header.is_object() || !header.contains("keel_trace")) {
        return InvalidArgument(where + ": first line must be a Keel header object with " +
                               "\"keel_trace\": " + std::to_string(kKeelTraceVersion));
      }
      KEEL_ASSIGN_OR_RETURN(int64_t version, HeaderInt(header, "keel_trace", where, 1));
      if (version != kKeelTraceVersion) {
        return InvalidArgument(where + ": keel_trace version " + std::to_string(version) +
                               " is not supported (this build reads version " +
                               std::to_string(kKeelTraceVersion) + ")");
      }
      KEEL_ASSIGN_OR_RETURN(int64_t layers, HeaderInt(header, "num_layers", where, 1));
      KEEL_ASSIGN_OR_RETURN(int64_t experts, HeaderInt(header, "num_experts", where, 1));
      KEEL_ASSIGN_OR_RETURN(int64_t sources, HeaderInt(header, "num_sources", where, 0));
      KEEL_RETURN_IF_ERROR(CheckTraceShape(layers, experts, sources).WithContext(where));
      trace.num_layers = static_cast<int>(layers);
      trace.num_experts = static_cast<int>(experts);
      trace.num_sources = static_cast<int>(sources);
      auto description = header.find("description");
      if (description != header.end()) {
        if (!description->is_string()) {
          return InvalidArgument(where + ": header \"description\" must be a string");
        }
        trace.description = description->get<std::string>();
      }
      have_header = true;
      continue;
    }
    KEEL_RETURN_IF_ERROR(ParseStepLine(line, where, trace, held));
  }
  if (!have_header) return InvalidArgument(path + ": empty file, expected a Keel header line");
  return trace;
}

Result<std::string> KeelTraceHeaderLine(const Trace& shape) {
  std::string out = "{\"keel_trace\": " + std::to_string(kKeelTraceVersion) + ", \"description\": ";
  try {
    out += nlohmann::json(shape.description)
               .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const nlohmann::json::exception& error) {
    return InvalidArgument(std::string("cannot encode description: ") + error.what());
  }
  out += ", \"num_layers\": " + std::to_string(shape.num_layers) +
         ", \"num_experts\": " + std::to_string(shape.num_experts) +
         ", \"num_sources\": " + std::to_string(shape.num_sources) + "}";
  out += '\n';
  return out;
}

void AppendKeelTraceStepLine(const Trace& shape, int64_t step_id, std::span<const double> counts,
                             std::string& out, const std::vector<TraceSequence>* sequences) {
  const size_t row_size = static_cast<size_t>(shape.row_size());
  out += "{\"step\": ";
  char id[24];
  out.append(id, std::to_chars(id, id + sizeof(id), step_id).ptr);
  out += ", \"layers\": [";
  for (int layer = 0; layer < shape.num_layers; ++layer) {
    out += layer == 0 ? "[" : ", [";
    for (size_t i = 0; i < row_size; ++i) {
      if (i > 0) out += ", ";
      AppendCount(out, counts[layer * row_size + i]);
    }
    out += ']';
  }
  out += ']';
  if (sequences != nullptr) {
    out += ", \"sequences\": [";
    for (size_t s = 0; s < sequences->size(); ++s) {
      const TraceSequence& sequence = (*sequences)[s];
      out += s == 0 ? "{\"group\": " : ", {\"group\": ";
      out += nlohmann::json(sequence.group)
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      out += ", \"tokens\": " + std::to_string(sequence.tokens) + ", \"layers\": [";
      for (int layer = 0; layer < shape.num_layers; ++layer) {
        out += layer == 0 ? "[" : ", [";
        for (int e = 0; e < shape.num_experts; ++e) {
          if (e > 0) out += ", ";
          AppendCount(out, sequence.counts[static_cast<size_t>(layer) * shape.num_experts + e]);
        }
        out += ']';
      }
      out += "]}";
    }
    out += ']';
  }
  out += "}\n";
}

Status WriteKeelTrace(const Trace& trace, const std::string& path) {
  KEEL_RETURN_IF_ERROR(trace.Validate().WithContext(path));
  Result<std::string> header = KeelTraceHeaderLine(trace);
  if (!header.ok()) return header.status().WithContext(path);
  std::string out = std::move(header).value();
  for (int step = 0; step < trace.num_steps(); ++step) {
    AppendKeelTraceStepLine(trace, trace.step_ids[step], trace.steps[step], out,
                            trace.has_sequences() ? &trace.sequences[step] : nullptr);
  }
  return WriteFileAtomically(path, out);
}

}  // namespace keel
