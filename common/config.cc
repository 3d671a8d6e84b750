// KeelConfig from YAML and back: the YAML reader, the validator, docs/config.md, --help and
// `keel config --defaults` all walk one table of keys (common/config_keys.h: each key's type,
// default, range, unit and meaning), so they cannot disagree.
#include "common/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "common/config_keys.h"
#include "common/file.h"
#include "common/json.h"
#include "common/listen_address.h"
#include "common/policy_names.h"
#include "keel/limits.hpp"

namespace keel {

namespace {

// The key table (common/config_keys.h) that this file parses, checks and writes.
using config_table::ConfigKey;
using config_table::ConfigKeys;
using config_table::ConfigSection;
using config_table::ConfigSections;
using config_table::FieldRef;
using config_table::FindKey;
using config_table::IsSection;
using config_table::kEstimatorKindNames;
using config_table::kMaxModelWidth;
using config_table::LastPart;
using config_table::ParentOf;
using config_table::TypeOf;
using config_table::ValueType;

// Shortest text that reads back to the same double, with ".0" on whole numbers so that a float
// key never looks like an int.
std::string FormatDouble(double value) {
  char buffer[64];
  auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  if (error != std::errc()) return std::to_string(value);
  std::string text(buffer, end);
  if (std::isfinite(value) && text.find_first_of(".eE") == std::string::npos) text += ".0";
  return text;
}

// Range bounds read as plain numbers: "> 0", "in [0, 1)", "in [1e-9, 1e9]".
std::string FormatBound(double bound) {
  char buffer[64];
  auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), bound);
  if (error != std::errc()) return std::to_string(bound);
  std::string text(buffer, end);
  // to_chars writes exponents as "e+09" and "e-09"; a bound reads better as "e9" and "e-9".
  if (const size_t e = text.find('e'); e != std::string::npos) {
    size_t digits = e + 1;
    if (text[digits] == '+') {
      text.erase(digits, 1);
    } else if (text[digits] == '-') {
      ++digits;
    }
    while (digits + 1 < text.size() && text[digits] == '0') text.erase(digits, 1);
  }
  return text;
}

// The range a key's values must lie within: the table's, narrowed for an int key to what an int
// holds, so that messages and documents name the bound that applies.
struct KeyRange {
  double min;
  bool min_exclusive;
  double max;
  bool max_exclusive;
};

KeyRange RangeOf(const ConfigKey& key) {
  KeyRange range{key.min, key.min_exclusive, key.max, key.max_exclusive};
  if (TypeOf(key) == ValueType::kInt) {
    if (!(range.min >= INT_MIN)) range = {INT_MIN, false, range.max, range.max_exclusive};
    if (!(range.max <= INT_MAX)) range = {range.min, range.min_exclusive, INT_MAX, false};
  }
  return range;
}

// ">= 0", "> 0", "in [0, 1)", "in [1, 2147483647]"; empty when the key has no range.
std::string RangeText(const ConfigKey& key) {
  const KeyRange range = RangeOf(key);
  bool has_min = std::isfinite(range.min);
  bool has_max = std::isfinite(range.max);
  if (has_min && has_max) {
    return "in " + std::string(range.min_exclusive ? "(" : "[") + FormatBound(range.min) + ", " +
           FormatBound(range.max) + (range.max_exclusive ? ")" : "]");
  }
  if (has_min) return (range.min_exclusive ? "> " : ">= ") + FormatBound(range.min);
  if (has_max) return (range.max_exclusive ? "< " : "<= ") + FormatBound(range.max);
  return "";
}

std::string ChoicesText(const ConfigKey& key, std::string_view quote) {
  std::string text;
  for (size_t i = 0; i < key.choices.size(); ++i) {
    if (i > 0) text += ", ";
    text += quote;
    text += key.choices[i];
    text += quote;
  }
  return text;
}

std::string_view TypeName(ValueType type) {
  switch (type) {
    case ValueType::kInt:
      return "int";
    case ValueType::kDouble:
      return "float";
    case ValueType::kBool:
      return "bool";
    case ValueType::kString:
      return "string";
    case ValueType::kEnum:
      return "enum";
  }
  return "?";
}

// "int, >= 1", "float, in [0, 1)", "enum: one of last, window, ema", "bool".
std::string TypeText(const ConfigKey& key, std::string_view quote) {
  ValueType type = TypeOf(key);
  std::string text(TypeName(type));
  if (type == ValueType::kEnum) return text + ": one of " + ChoicesText(key, quote);
  std::string range = RangeText(key);
  if (!range.empty()) text += ", " + range;
  return text;
}

// Why `text` cannot be a free-form value (a path, an address), or "": control characters and
// bytes that are not UTF-8 would not survive a round trip through YAML, nor mean a real path.
std::string TextProblem(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte == 0x7f) {
      return "has a control character (byte " + std::to_string(byte) + ") at position " +
             std::to_string(i);
    }
    if (byte < 0x80) {
      ++i;
      continue;
    }
    // A lead byte 110xxxxx, 1110xxxx or 11110xxx and as many bytes 10xxxxxx, in shortest form,
    // at most U+10FFFF and no surrogate.
    const std::string invalid = "is not valid UTF-8 at position " + std::to_string(i);
    const int extra = (byte >> 5) == 0x6 ? 1 : (byte >> 4) == 0xe ? 2 : (byte >> 3) == 0x1e ? 3 : 0;
    if (extra == 0 || text.size() - i <= static_cast<size_t>(extra)) return invalid;
    uint32_t code = byte & (0x3f >> extra);
    for (int k = 1; k <= extra; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next >> 6) != 0x2) return invalid;
      code = (code << 6) | (next & 0x3f);
    }
    constexpr uint32_t kSmallest[] = {0, 0x80, 0x800, 0x10000};
    if (code < kSmallest[extra] || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) {
      return invalid;
    }
    i += static_cast<size_t>(extra) + 1;
  }
  return "";
}

// A free-form string as a double-quoted YAML scalar, so that "" and values like "on" or "8080"
// read back as the same string; control characters (which TextProblem refuses) are shown as \xNN.
std::string QuotedYamlString(std::string_view text) {
  std::string quoted = "\"";
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      constexpr char kHex[] = "0123456789abcdef";
      quoted += {'\\', 'x', kHex[byte >> 4], kHex[byte & 0xf]};
      continue;
    }
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += c;
  }
  return quoted + "\"";
}

std::string FormatValue(const ConfigKey& key, const KeelConfig& config) {
  KeelConfig copy = config;
  FieldRef ref = key.field(copy);
  if (auto* value = std::get_if<int*>(&ref)) return std::to_string(**value);
  if (auto* value = std::get_if<double*>(&ref)) return FormatDouble(**value);
  if (auto* value = std::get_if<bool*>(&ref)) return **value ? "true" : "false";
  if (auto* value = std::get_if<std::string*>(&ref)) {
    return key.choices.empty() ? QuotedYamlString(**value) : **value;
  }
  return std::string(EstimatorKindName(*std::get<EstimatorKind*>(ref)));
}

// Empty when `value` lies within the key's range, else "is out of range (must be >= 1)".
std::string RangeProblem(const ConfigKey& key, double value) {
  const KeyRange range = RangeOf(key);
  bool below = range.min_exclusive ? value <= range.min : value < range.min;
  bool above = range.max_exclusive ? value >= range.max : value > range.max;
  if (!below && !above) return "";
  return "is out of range (must be " + RangeText(key) + ")";
}

std::string ChoiceProblem(const ConfigKey& key, std::string_view value) {
  for (std::string_view choice : key.choices) {
    if (choice == value) return "";
  }
  std::string allowed = ChoicesText(key, "");
  if (key.added_choices != nullptr) {
    for (const std::string& choice : key.added_choices()) {
      if (choice == value) return "";
      allowed += ", " + choice;
    }
  }
  return "is not allowed (must be one of " + allowed + ")";
}

// ---------------------------------------------------------------------------------------------
// Reading YAML

// Where the values came from, for messages: the source name and each key's line.
struct ParseOrigin {
  std::string source;
  std::map<std::string, int, std::less<>> key_lines;  // dotted path -> 1-based line

  // "configs/x.yaml:7: " or "configs/x.yaml: " when the line is unknown.
  std::string Where(int line) const {
    if (source.empty()) return line > 0 ? "line " + std::to_string(line) + ": " : "";
    return line > 0 ? source + ":" + std::to_string(line) + ": " : source + ": ";
  }
  std::string WhereKey(std::string_view path) const {
    auto it = key_lines.find(path);
    return Where(it == key_lines.end() ? 0 : it->second);
  }
};

int LineOf(const YAML::Node& node) {
  YAML::Mark mark = node.Mark();
  return mark.line >= 0 ? mark.line + 1 : 0;
}

std::string DescribeNode(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Null:
      return "nothing";
    case YAML::NodeType::Scalar:
      return node.Scalar().empty() ? "''" : node.Scalar();
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing";
}

std::string ShownValue(std::string_view text) {
  return text.empty() ? std::string("''") : std::string(text);
}

// Whether `text` is an integer, whole; `out_of_range` when it is one beyond 64 bits.
bool ParseInteger(std::string_view text, long long& out, bool& out_of_range) {
  out_of_range = false;
  if (text.starts_with('+')) text.remove_prefix(1);
  if (text.empty()) return false;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), out);
  out_of_range = error == std::errc::result_out_of_range && end == text.data() + text.size();
  return error == std::errc() && end == text.data() + text.size();
}

bool ParseNumber(std::string_view text, double& out) {
  if (text.starts_with('+')) text.remove_prefix(1);
  if (text.empty()) return false;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), out);
  return error == std::errc() && end == text.data() + text.size() && std::isfinite(out);
}

bool ParseBool(std::string_view text, bool& out) {
  if (text == "true" || text == "True" || text == "TRUE") {
    out = true;
    return true;
  }
  if (text == "false" || text == "False" || text == "FALSE") {
    out = false;
    return true;
  }
  return false;
}

constexpr std::string_view kCoreTag = "tag:yaml.org,2002:";

// Why the way `node` is written makes it no value of `key`'s type, or "". A quoted scalar ("4",
// '4') and one tagged !!str are strings in YAML, so an int, float or bool key refuses them as a
// JSON reader refuses "4" for an integer; a tag names the one type the scalar may be read as.
std::string TagProblem(const ConfigKey& key, const YAML::Node& node) {
  const ValueType type = TypeOf(key);
  const std::string& tag = node.Tag();
  if (tag == "?") return "";  // plain: its type is the key's
  const std::string_view expected = type == ValueType::kInt      ? "an integer"
                                    : type == ValueType::kDouble ? "a number"
                                    : type == ValueType::kBool   ? "true or false"
                                                                 : "a string";
  const bool is_string = type == ValueType::kString || type == ValueType::kEnum;
  if (tag == "!") {
    if (is_string) return "";
    return "is a quoted string, not " + std::string(expected) + " (write " + node.Scalar() +
           " without quotes)";
  }
  if (std::string_view(tag).starts_with(kCoreTag)) {
    const std::string_view core = std::string_view(tag).substr(kCoreTag.size());
    if ((type == ValueType::kInt && core == "int") ||
        (type == ValueType::kDouble && (core == "float" || core == "int")) ||
        (type == ValueType::kBool && core == "bool") || (is_string && core == "str")) {
      return "";
    }
    return "is tagged !!" + std::string(core) + ", not " + std::string(expected);
  }
  return "has the tag " + tag + ", which Keel does not read (expected " + std::string(expected) +
         ")";
}

// Sets one key from its YAML value, checking type, range and choices.
Status SetKey(const ConfigKey& key, const YAML::Node& node, int line, const ParseOrigin& origin,
              KeelConfig& config) {
  auto fail = [&](std::string_view value, std::string_view problem) {
    return InvalidArgument(origin.Where(line) + std::string(key.path) + ": " + std::string(value) +
                           " " + std::string(problem));
  };
  ValueType type = TypeOf(key);
  if (!node.IsScalar()) {
    std::string expected = type == ValueType::kInt      ? "an integer"
                           : type == ValueType::kDouble ? "a number"
                           : type == ValueType::kBool   ? "true or false"
                           : type == ValueType::kEnum   ? "one of " + ChoicesText(key, "")
                                                        : "a string";
    return InvalidArgument(origin.Where(line) + std::string(key.path) + ": expected " + expected +
                           ", got " + DescribeNode(node));
  }
  const std::string& text = node.Scalar();
  if (std::string problem = TagProblem(key, node); !problem.empty()) {
    return fail(node.Tag() == "!" ? QuotedYamlString(text) : ShownValue(text), problem);
  }
  FieldRef ref = key.field(config);
  switch (type) {
    case ValueType::kInt: {
      long long value = 0;
      bool out_of_range = false;
      if (!ParseInteger(text, value, out_of_range)) {
        return fail(ShownValue(text), out_of_range
                                          ? "is out of range (must be " + RangeText(key) + ")"
                                          : std::string("is not an integer"));
      }
      std::string problem = RangeProblem(key, static_cast<double>(value));
      if (!problem.empty()) return fail(text, problem);
      *std::get<int*>(ref) = static_cast<int>(value);
      return Status::Ok();
    }
    case ValueType::kDouble: {
      double value = 0;
      if (!ParseNumber(text, value)) return fail(ShownValue(text), "is not a finite number");
      std::string problem = RangeProblem(key, value);
      if (!problem.empty()) return fail(text, problem);
      *std::get<double*>(ref) = value;
      return Status::Ok();
    }
    case ValueType::kBool: {
      bool value = false;
      if (!ParseBool(text, value)) {
        return fail(ShownValue(text), "is not a boolean (must be true or false)");
      }
      *std::get<bool*>(ref) = value;
      return Status::Ok();
    }
    case ValueType::kString:
    case ValueType::kEnum: {
      std::string problem = ChoiceProblem(key, text);
      if (!key.choices.empty() && !problem.empty()) return fail(ShownValue(text), problem);
      if (auto* value = std::get_if<std::string*>(&ref)) {
        **value = text;
      } else {
        auto it = std::find(std::begin(kEstimatorKindNames), std::end(kEstimatorKindNames), text);
        *std::get<EstimatorKind*>(ref) =
            static_cast<EstimatorKind>(it - std::begin(kEstimatorKindNames));
      }
      return Status::Ok();
    }
  }
  return Internal("config key " + std::string(key.path) + " has no type");
}

// The names a map at `section` may hold: its keys, then its subsections.
std::vector<std::string_view> ChildNames(std::string_view section) {
  std::vector<std::string_view> names;
  for (const ConfigKey& key : ConfigKeys()) {
    if (ParentOf(key.path) == section) names.push_back(LastPart(key.path));
  }
  for (const ConfigSection& child : ConfigSections()) {
    if (ParentOf(child.path) == section) names.push_back(LastPart(child.path));
  }
  return names;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

Status UnknownKey(std::string_view section, std::string_view name, int line,
                  const ParseOrigin& origin) {
  std::string path =
      section.empty() ? std::string(name) : std::string(section) + "." + std::string(name);
  std::vector<std::string_view> names = ChildNames(section);
  std::string message = origin.Where(line) + "unknown key '" + path + "'";
  std::string_view closest;
  // Suggest only near misses: a few edits, more for longer names.
  size_t best = std::max<size_t>(2, name.size() / 3) + 1;
  for (std::string_view candidate : names) {
    // A part of a longer name ("trigger" for "balance_ratio_trigger") counts as a near miss.
    bool part = name.size() >= 4 && (candidate.find(name) != std::string_view::npos ||
                                     name.find(candidate) != std::string_view::npos);
    size_t distance = part ? 1 : EditDistance(name, candidate);
    if (distance < best) {
      best = distance;
      closest = candidate;
    }
  }
  if (!closest.empty()) message += " (did you mean '" + std::string(closest) + "'?)";
  message += section.empty() ? "; valid top-level keys: "
                             : "; valid keys in '" + std::string(section) + "': ";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) message += ", ";
    message += names[i];
  }
  return InvalidArgument(std::move(message));
}

Status ParseSection(const YAML::Node& map, std::string_view section, ParseOrigin& origin,
                    KeelConfig& config) {
  std::map<std::string, int, std::less<>> seen;  // name -> line, to catch duplicates
  for (auto entry = map.begin(); entry != map.end(); ++entry) {
    YAML::Node key_node = entry->first;  // copies: the iterator hands out a temporary
    YAML::Node value = entry->second;
    int line = LineOf(key_node);
    if (!key_node.IsScalar()) {
      return InvalidArgument(origin.Where(line) + "a key in '" +
                             std::string(section.empty() ? "the top level" : section) + "' is " +
                             DescribeNode(key_node) + ", not a name");
    }
    const std::string& name = key_node.Scalar();
    std::string path = section.empty() ? name : std::string(section) + "." + name;
    auto [previous, inserted] = seen.emplace(name, line);
    if (!inserted) {
      return InvalidArgument(origin.Where(line) + path + ": key appears twice (first on line " +
                             std::to_string(previous->second) + ")");
    }
    if (const ConfigKey* key = FindKey(path)) {
      if (value.IsNull()) {
        return InvalidArgument(origin.Where(line) + path + ": has no value (expected " +
                               TypeText(*key, "") + "; leave the key out to keep the default)");
      }
      KEEL_RETURN_IF_ERROR(SetKey(*key, value, line, origin, config));
      origin.key_lines[path] = line;
    } else if (IsSection(path)) {
      if (value.IsNull()) continue;  // "policy:" with nothing under it keeps the defaults
      if (!value.IsMap()) {
        std::string names;
        for (std::string_view child : ChildNames(path)) {
          names += names.empty() ? "" : ", ";
          names += child;
        }
        return InvalidArgument(origin.Where(line) + path + ": expected a map of keys (" + names +
                               "), got " + DescribeNode(value));
      }
      KEEL_RETURN_IF_ERROR(ParseSection(value, path, origin, config));
    } else {
      return UnknownKey(section, name, line, origin);
    }
  }
  return Status::Ok();
}

// Range and choice checks of every key, then the constraints between keys.
Status Validate(const KeelConfig& config, const ParseOrigin& origin) {
  for (const ConfigKey& key : ConfigKeys()) {
    KeelConfig copy = config;
    FieldRef ref = key.field(copy);
    std::string problem;
    if (auto* value = std::get_if<int*>(&ref)) problem = RangeProblem(key, **value);
    if (auto* value = std::get_if<double*>(&ref)) {
      problem = std::isfinite(**value) ? RangeProblem(key, **value) : "is not a finite number";
    }
    if (auto* value = std::get_if<std::string*>(&ref)) {
      problem = key.choices.empty() ? TextProblem(**value) : ChoiceProblem(key, **value);
    }
    if (auto* value = std::get_if<EstimatorKind*>(&ref)) {
      auto index = static_cast<size_t>(**value);
      if (index >= std::size(kEstimatorKindNames)) problem = "is not a known estimator kind";
    }
    if (!problem.empty()) {
      std::string shown = std::holds_alternative<EstimatorKind*>(ref)
                              ? std::to_string(static_cast<int>(*std::get<EstimatorKind*>(ref)))
                              : ShownValue(FormatValue(key, config));
      return InvalidArgument(origin.WhereKey(key.path) + std::string(key.path) + ": " + shown +
                             " " + problem);
    }
  }

  // Names a constraint between keys at the line of the first of them that the file set.
  auto cross_error = [&](std::string_view first, std::string_view second, std::string message) {
    bool first_set = origin.key_lines.count(first) > 0;
    return InvalidArgument(origin.WhereKey(first_set ? first : second) + message);
  };

  const TopologyConfig& topology = config.topology;
  const int64_t num_ranks = int64_t{topology.num_nodes} * topology.gpus_per_node;
  if (num_ranks > kMaxRanks) {
    return cross_error("topology.num_nodes", "topology.gpus_per_node",
                       "topology.num_nodes x topology.gpus_per_node: " + std::to_string(num_ranks) +
                           " ranks, more than the " + std::to_string(kMaxRanks) + " Keel supports");
  }
  const int64_t slots_per_layer =
      num_ranks * (int64_t{config.slots.persistent_per_rank} + config.slots.transient_per_rank);
  if (slots_per_layer > kMaxSlotsPerLayer) {
    return cross_error(
        "slots.persistent_per_rank", "slots.transient_per_rank",
        "slots.persistent_per_rank + slots.transient_per_rank: " + std::to_string(slots_per_layer) +
            " slots per layer on " + std::to_string(num_ranks) + " ranks, more than 2^20");
  }
  if (config.monitor.aggregating_rank >= num_ranks) {
    return cross_error(
        "monitor.aggregating_rank", "topology.gpus_per_node",
        "monitor.aggregating_rank: " + std::to_string(config.monitor.aggregating_rank) +
            " is not a rank of the job (it has " + std::to_string(num_ranks) + " ranks)");
  }
  if (const std::string& address = config.monitor.metrics_address; !address.empty()) {
    if (Result<ListenAddress> parsed = ParseListenAddress(address); !parsed.ok()) {
      return InvalidArgument(origin.WhereKey("monitor.metrics_address") +
                             "monitor.metrics_address: " + parsed.status().message());
    }
  }
  const CostModelConfig& cost = config.cost_model;
  if (cost.home_move_bytes_per_parameter < cost.dtype_bytes) {
    return cross_error("cost_model.home_move_bytes_per_parameter", "cost_model.dtype_bytes",
                       "cost_model.home_move_bytes_per_parameter: " +
                           FormatDouble(cost.home_move_bytes_per_parameter) +
                           " is less than cost_model.dtype_bytes (" +
                           std::to_string(cost.dtype_bytes) +
                           "); moving a home moves at least the weights");
  }
  if (Result<std::vector<GemmEfficiencyPoint>> curve =
          ParseGemmEfficiencyCurve(cost.gemm_efficiency);
      !curve.ok()) {
    return InvalidArgument(origin.WhereKey("cost_model.gemm_efficiency") +
                           "cost_model.gemm_efficiency: " + curve.status().message());
  }
  // Shard and MP groups are consecutive ranks of one node.
  for (auto [path, degree] :
       {std::pair<std::string_view, int>{"strategy.shard_degree", config.strategy.shard_degree},
        {"strategy.mp_degree", config.strategy.mp_degree}}) {
    if (degree > 0 && topology.gpus_per_node % degree != 0) {
      return cross_error(path, "topology.gpus_per_node",
                         std::string(path) + ": " + std::to_string(degree) +
                             " does not divide topology.gpus_per_node (" +
                             std::to_string(topology.gpus_per_node) +
                             "); its groups must be ranks of one node");
    }
  }
  const KeelPolicyConfig& keel = config.policy.keel;
  const bool per_step = keel.spare_slots == "per_step";
  if (config.policy.name == "keel" && keel.transient_replicas && !per_step &&
      config.slots.transient_per_rank == 0) {
    return cross_error("policy.keel.transient_replicas", "slots.transient_per_rank",
                       "policy.keel.transient_replicas: true needs slots.transient_per_rank >= 1 "
                       "(it is 0), or policy.keel.spare_slots: per_step; set transient_replicas "
                       "to false or add a transient slot");
  }
  if (config.policy.name == "keel" && per_step && !keel.transient_replicas) {
    return cross_error("policy.keel.spare_slots", "policy.keel.transient_replicas",
                       "policy.keel.spare_slots: per_step needs policy.keel.transient_replicas: "
                       "true (it is false): the spare slots would stay empty");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Writing documentation

// Greedy word wrap of `text` into lines of at most `width` characters (longer words stay whole).
std::vector<std::string> WrapWords(std::string_view text, size_t width) {
  std::vector<std::string> lines;
  std::string line;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view word = text.substr(start, end - start);
    start = end + 1;
    if (word.empty()) continue;
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      lines.push_back(std::move(line));
      line.clear();
    }
    if (!line.empty()) line += ' ';
    line += word;
  }
  if (!line.empty()) lines.push_back(std::move(line));
  return lines;
}

void AppendWrapped(std::string& out, std::string_view text, std::string_view indent,
                   size_t width = 100) {
  size_t room = width > indent.size() + 20 ? width - indent.size() : 20;
  for (const std::string& line : WrapWords(text, room)) {
    out += indent;
    out += line;
    out += '\n';
  }
}

// "GB/s; float, > 0", "one of last, window, ema", "bool": the note after a value in YAML.
std::string ValueNote(const ConfigKey& key) {
  std::string type = TypeText(key, "");
  if (TypeOf(key) == ValueType::kEnum) type = "one of " + ChoicesText(key, "");
  return key.unit.empty() ? type : std::string(key.unit) + "; " + type;
}

std::string EscapeMarkdownCell(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

// How deep maps and sequences may nest in a config file. Its keys nest 3 levels
// (policy.flexmoe.balance_ratio_trigger); deeper text is refused where it goes past the limit,
// before YAML::Load builds it.
constexpr int kMaxYamlNesting = 64;

// What every input file goes through (common/file.h), before the table of limits.
std::string InputLimitsText() {
  return "Every file Keel reads must be a regular file: a folder, a FIFO or a device is refused "
         "by name, without blocking (set `" +
         std::string(kAllowStreamsVariable) +
         "=1` to read pipes and devices as streams; `keel plan --input -` reads stdin). Each "
         "kind of input has a size limit, checked before the file is read and again while it is "
         "read (a file that grows past it is refused too); an environment variable raises it, "
         "as a whole number of bytes or with K, M or G (`KEEL_MAX_TRACE_BYTES=4G`). Arrays and "
         "objects nest at most " +
         std::to_string(kMaxJsonNesting) + " levels in a JSON input, maps and sequences " +
         std::to_string(kMaxYamlNesting) +
         " in a config file; an expert file (`LoadExperts`) is read only up to the size the "
         "engine's shape gives it. An output that is a FIFO (`monitor.trace_path`, `--output`) "
         "must have a reader within " +
         std::to_string(kFifoReaderWaitSeconds) + " s, or the open fails instead of blocking.";
}

constexpr std::string_view kExampleYaml = R"(topology:
  num_nodes: 2
  gpus_per_node: 8
policy:
  name: flexmoe
  flexmoe:
    balance_ratio_trigger: 1.1
)";

// A config file is one YAML document: YAML::Load reads the first and drops the rest without a
// word. Refuses a second document (after "---", or any text after "..."), naming its line, and text
// the parser cannot get past (yaml-cpp then starts empty documents at the same place forever, so
// YAML::LoadAll never returns: ",!" and a control character is one such text). Refuses nesting
// deeper than kMaxYamlNesting, naming its line.
Status CheckOneDocument(std::string_view yaml_text, const ParseOrigin& origin) {
  // Where the text nests too deep: thrown out of the parser, which has no other way to stop.
  struct TooDeep {
    YAML::Mark mark;
  };
  // The parser's events carry the marks that loaded nodes lack: an empty document has none.
  class DocumentStarts : public YAML::EventHandler {
   public:
    std::vector<YAML::Mark> marks;
    void OnDocumentStart(const YAML::Mark& mark) override { marks.push_back(mark); }
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
    void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
    void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  const std::string&) override {}
    void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                         YAML::EmitterStyle::value) override {
      Enter(mark);
    }
    void OnSequenceEnd() override { --depth_; }
    void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t,
                    YAML::EmitterStyle::value) override {
      Enter(mark);
    }
    void OnMapEnd() override { --depth_; }

   private:
    void Enter(const YAML::Mark& mark) {
      if (++depth_ > kMaxYamlNesting) throw TooDeep{mark};
    }
    int depth_ = 0;
  };
  std::istringstream in{std::string(yaml_text)};
  YAML::Parser parser(in);
  DocumentStarts starts;
  try {
    while (starts.marks.size() < 2 && parser.HandleNextDocument(starts)) {
    }
  } catch (const TooDeep& deep) {
    return InvalidArgument(origin.Where(deep.mark.line + 1) +
                           "maps and sequences nest deeper than " +
                           std::to_string(kMaxYamlNesting) + " levels");
  }
  if (starts.marks.size() < 2) return Status::Ok();
  const YAML::Mark& first = starts.marks[0];
  const YAML::Mark& second = starts.marks[1];
  if (second.pos == first.pos) {
    return InvalidArgument(origin.Where(second.line + 1) +
                           "YAML syntax error: the parser cannot read past column " +
                           std::to_string(second.column + 1));
  }
  return InvalidArgument(origin.Where(second.line + 1) +
                         "a second YAML document starts here; a config file is one document "
                         "(after its end, '...', only comments may follow)");
}

}  // namespace

Result<std::vector<GemmEfficiencyPoint>> ParseGemmEfficiencyCurve(std::string_view text) {
  std::vector<GemmEfficiencyPoint> curve;
  auto trim = [](std::string_view part) {
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.front()))) {
      part.remove_prefix(1);
    }
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.back()))) {
      part.remove_suffix(1);
    }
    return part;
  };
  if (trim(text).empty()) return curve;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t comma = std::min(text.find(',', begin), text.size());
    const std::string_view entry = trim(text.substr(begin, comma - begin));
    begin = comma + 1;
    const std::string shown = "entry '" + std::string(entry) + "'";
    const size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      return InvalidArgument(shown + " is not columns:efficiency");
    }
    GemmEfficiencyPoint point;
    const std::string_view columns_text = trim(entry.substr(0, colon));
    const std::string_view efficiency_text = trim(entry.substr(colon + 1));
    // Whole text parsed, nothing left over.
    auto parse = [](std::string_view part, auto& value) {
      const auto [end, error] = std::from_chars(part.data(), part.data() + part.size(), value);
      return error == std::errc() && end == part.data() + part.size();
    };
    if (!parse(columns_text, point.columns) || point.columns < 1 ||
        point.columns > kMaxModelWidth) {
      return InvalidArgument(shown + ": columns must be a whole number in [1, 2^20]");
    }
    // At least 1/1000 of expert_tflops: the rates' lower bound (config_keys.cc) keeps prices
    // finite, and a measured GEMM is never slower than that.
    if (!parse(efficiency_text, point.efficiency) ||
        !(point.efficiency >= 0.001 && point.efficiency <= 4)) {
      return InvalidArgument(shown + ": efficiency must be a number in [0.001, 4]");
    }
    if (!curve.empty() && point.columns <= curve.back().columns) {
      return InvalidArgument(shown + ": columns must ascend (the entry before has " +
                             std::to_string(curve.back().columns) + ")");
    }
    curve.push_back(point);
  }
  return curve;
}

std::string_view EstimatorKindName(EstimatorKind kind) {
  auto index = static_cast<size_t>(kind);
  return index < std::size(kEstimatorKindNames) ? kEstimatorKindNames[index] : "unknown";
}

Result<KeelConfig> ParseConfig(std::string_view yaml_text, std::string_view source) {
  ParseOrigin origin;
  origin.source = std::string(source);
  KeelConfig config;
  try {
    // First, so that what it refuses is never built.
    KEEL_RETURN_IF_ERROR(CheckOneDocument(yaml_text, origin));
    const YAML::Node root = YAML::Load(std::string(yaml_text));
    if (root.IsMap()) {
      KEEL_RETURN_IF_ERROR(ParseSection(root, "", origin, config));
    } else if (!root.IsNull()) {
      std::string names;
      for (std::string_view child : ChildNames("")) {
        names += names.empty() ? "" : ", ";
        names += child;
      }
      return InvalidArgument(origin.Where(LineOf(root)) +
                             "expected a map of sections at the top level (" + names + "), got " +
                             DescribeNode(root));
    }
  } catch (const YAML::Exception& error) {
    int line = error.mark.line >= 0 ? error.mark.line + 1 : 0;
    return InvalidArgument(origin.Where(line) + "YAML syntax error: " + error.msg);
  } catch (const std::exception& error) {
    return InvalidArgument(origin.Where(0) + "cannot read YAML: " + error.what());
  }
  KEEL_RETURN_IF_ERROR(Validate(config, origin));
  return config;
}

Result<KeelConfig> LoadConfigFile(const std::string& path) {
  Result<std::string> text = ReadFile(path, {.limit = InputLimit::kConfigBytes});
  if (!text.ok()) return text.status().WithContext("config file");
  return ParseConfig(*text, path);
}

Status ValidateConfig(const KeelConfig& config) { return Validate(config, ParseOrigin{}); }

namespace {

// The sizes of a job and their products, each checked before anything of it is allocated
// (include/keel/limits.hpp): the last section of the reference.
std::string ConfigLimitsMarkdown() {
  const auto power = [](int64_t value) {
    int bits = 0;
    while ((int64_t{1} << bits) < value) ++bits;
    return (int64_t{1} << bits) == value ? "2^" + std::to_string(bits) : std::to_string(value);
  };
  const std::pair<std::string, std::string> rows[] = {
      {"MoE layers", std::to_string(kMaxLayers)},
      {"logical experts per layer", std::to_string(kMaxExperts)},
      {"ranks: `topology.num_nodes` x `topology.gpus_per_node`, a trace's sources, `keel trace "
       "info --ranks`; each layer's step has a ranks x ranks all-to-all matrix",
       std::to_string(kMaxRanks)},
      {"slots of one layer: ranks x (`slots.persistent_per_rank` + "
       "`slots.transient_per_rank`)",
       power(kMaxSlotsPerLayer)},
      {"slots of all layers: layers x slots of one layer (the engine's placements, `keel plan`'s "
       "phy2log)",
       power(kMaxSlots)},
      {"tokens in one count of a trace, a traffic matrix or a load", "1e15"},
      {"token counts a job holds: a trace's steps x layers x sources x experts (plus each "
       "sequence's layers x experts; `KEEL_MAX_TRACE_COUNT_BYTES` raises it for traces, below); "
       "the load estimates of the engine, and of each policy `keel replay` runs, layers x ranks "
       "x experts, times `estimator.window_steps` + 1 with the window estimator",
       power(kMaxCounts)},
      {"threads of one call (`keel replay --threads`)", std::to_string(kMaxThreads)},
  };
  std::string out =
      "\n## Limits\n\nThe largest job Keel takes. Every size above, and every product of sizes "
      "that Keel keeps a table of, is checked against these before anything is allocated, by "
      "the engine, `keel config --check`, the commands, the C API and the Python package alike; "
      "a larger job is refused with the sizes and the limit named (include/keel/limits.hpp). "
      "`keel plan` and each command's flags add their own, in docs/replay.md and the flags' "
      "`--help`.\n\n| what | at most |\n|---|---|\n";
  for (const auto& [what, most] : rows) out += "| " + what + " | " + most + " |\n";
  return out;
}

}  // namespace

std::string ConfigReferenceMarkdown() {
  const KeelConfig defaults;
  std::string out;
  out += "# Keel configuration reference\n\n";
  out +=
      "<!-- Generated by `keel config --markdown` from the key table in common/config_keys.cc; "
      "edit that table, not this file. -->\n\n";
  out +=
      "Keel reads its settings from one YAML file. This page names every key by its dotted "
      "path, such as `policy.flexmoe.balance_ratio_trigger`; in the file, each dot is one level "
      "of nesting:\n\n";
  out += "```yaml\n";
  out += kExampleYaml;
  out += "```\n\n";
  out +=
      "Keys left out keep their defaults, so an empty file is a complete configuration. An "
      "unknown key, a value of the wrong type or out of range, and a syntax error are all "
      "errors that name the key, the value and the line. Types are exact: a quoted value "
      "(`\"4\"`, `'true'`) or one tagged `!!str` is a string, which an int, float or bool key "
      "refuses. The file is one YAML document: a second one (`---`) or text after its end "
      "(`...`) is an error. `keel config --check FILE` checks a "
      "file; `keel config --defaults` prints every key at its default, with its meaning as a "
      "comment.\n";
  for (const ConfigSection& section : ConfigSections()) {
    out += "\n## `" + std::string(section.path) + "`\n\n";
    out += std::string(section.doc) + "\n";
    bool header = false;
    for (const ConfigKey& key : ConfigKeys()) {
      if (ParentOf(key.path) != section.path) continue;
      if (!header) {
        out += "\n| key | type | default | meaning |\n|---|---|---|---|\n";
        header = true;
      }
      std::string default_text = "`" + FormatValue(key, defaults) + "`";
      if (!key.unit.empty()) default_text += " " + std::string(key.unit);
      out += "| `" + std::string(key.path) + "` | " + EscapeMarkdownCell(TypeText(key, "`")) +
             " | " + default_text + " | " + EscapeMarkdownCell(key.doc) + " |\n";
    }
  }
  out += ConfigLimitsMarkdown();
  out += "\n## Input limits\n\n";
  out += InputLimitsText();
  out += "\n\n| environment variable | default | what it bounds |\n|---|---|---|\n";
  for (const InputLimitInfo& limit : InputLimits()) {
    out += "| `" + std::string(limit.variable) + "` | " + DescribeBytes(limit.default_bytes) +
           " | " + EscapeMarkdownCell(limit.doc) + " |\n";
  }
  return out;
}

std::string ConfigHelpText() {
  const KeelConfig defaults;
  std::string out =
      "Configuration keys (YAML; each dot in a key is one level of nesting, and keys left\n"
      "out keep their defaults):\n";
  for (const ConfigSection& section : ConfigSections()) {
    bool first = true;
    for (const ConfigKey& key : ConfigKeys()) {
      if (ParentOf(key.path) != section.path) continue;
      if (first) {
        out += "\n" + std::string(section.path) + ": " + std::string(section.doc) + "\n";
        first = false;
      }
      out += "  " + std::string(key.path) + " = " + FormatValue(key, defaults);
      if (!key.unit.empty()) out += " " + std::string(key.unit);
      out += "  (" + TypeText(key, "") + ")\n";
      AppendWrapped(out, key.doc, "      ");
    }
  }
  out += "\nInput limits (environment variables):\n";
  AppendWrapped(out, InputLimitsText(), "  ");
  out += "\n";
  for (const InputLimitInfo& limit : InputLimits()) {
    out += "  " + std::string(limit.variable) + " = " + DescribeBytes(limit.default_bytes) + "\n";
    AppendWrapped(out, limit.doc, "      ");
  }
  return out;
}

std::string ConfigToYaml(const KeelConfig& config) {
  std::string out =
      "# Keel configuration. Keys left out keep their defaults; `keel config --markdown` "
      "documents\n# every key.\n";
  for (const ConfigSection& section : ConfigSections()) {
    size_t depth = static_cast<size_t>(std::count(section.path.begin(), section.path.end(), '.'));
    std::string indent(2 * depth, ' ');
    out += "\n";
    AppendWrapped(out, section.doc, indent + "# ");
    out += indent + std::string(LastPart(section.path)) + ":\n";
    std::string key_indent(2 * (depth + 1), ' ');
    for (const ConfigKey& key : ConfigKeys()) {
      if (ParentOf(key.path) != section.path) continue;
      AppendWrapped(out, key.doc, key_indent + "# ");
      out += key_indent + std::string(LastPart(key.path)) + ": " + FormatValue(key, config) +
             "  # " + ValueNote(key) + "\n";
    }
  }
  return out;
}

// --- Config, the public handle -----------------------------------------------------------------

Config::Config() : typed_(std::make_unique<KeelConfig>()) {}
Config::Config(std::unique_ptr<KeelConfig> typed) : typed_(std::move(typed)) {}
Config::Config(const Config& other) : typed_(std::make_unique<KeelConfig>(*other.typed_)) {}
Config& Config::operator=(const Config& other) {
  *typed_ = *other.typed_;
  return *this;
}
// A moved-from handle keeps a config of its own: typed_ is never null.
Config::Config(Config&& other) noexcept : typed_(std::make_unique<KeelConfig>()) {
  std::swap(typed_, other.typed_);
}
Config& Config::operator=(Config&& other) noexcept {
  std::swap(typed_, other.typed_);
  return *this;
}
Config::~Config() = default;

Result<Config> Config::FromYaml(std::string_view yaml, std::string_view source) {
  KEEL_ASSIGN_OR_RETURN(KeelConfig typed, ParseConfig(yaml, source));
  return MakeConfig(std::move(typed));
}

Result<Config> Config::FromFile(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(KeelConfig typed, LoadConfigFile(path));
  return MakeConfig(std::move(typed));
}

std::string Config::Reference() { return ConfigHelpText(); }
std::string Config::ToYaml() const { return ConfigToYaml(*typed_); }
int Config::num_ranks() const { return typed_->num_ranks(); }
std::string Config::policy() const { return typed_->policy.name; }

const KeelConfig& TypedConfig(const Config& config) { return *config.typed_; }
Config MakeConfig(KeelConfig typed) {
  return Config(std::make_unique<KeelConfig>(std::move(typed)));
}

}  // namespace keel
