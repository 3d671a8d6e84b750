// The configuration's keys and sections: one table (common/config_keys.cc) from which config.cc
// parses, validates, writes and documents every key. A key names its dotted YAML path, the
// KeelConfig member it fills, its bounds or choices, its unit and its documentation.
#pragma once

#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/config.h"

namespace keel::config_table {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Names of EstimatorKind values, in the enum's order.
inline constexpr std::string_view kEstimatorKindNames[] = {"last", "window", "ema"};
static_assert(std::size(kEstimatorKindNames) == static_cast<size_t>(EstimatorKind::kEma) + 1);

// Sizes have upper bounds (keel/limits.hpp), so that a typo fails here rather than as an
// exhausted memory later.
inline constexpr double kMaxModelWidth = 1 << 20;  // hidden and FFN sizes, elements

// Where a key's value lives inside a KeelConfig; the alternative is the key's type.
using FieldRef = std::variant<int*, double*, bool*, std::string*, EstimatorKind*>;

// One configuration key. Numbers must lie within [min, max] (bounds excluded when marked);
// strings and enums must be one of `choices`.
struct ConfigKey {
  std::string_view path;  // dotted YAML path, "policy.flexmoe.balance_ratio_trigger"
  FieldRef (*field)(KeelConfig&);
  double min = -kInf;
  bool min_exclusive = false;
  double max = kInf;
  bool max_exclusive = false;
  std::span<const std::string_view> choices = {};
  // Allowed besides `choices`: names a program adds at run time (registered policies).
  std::vector<std::string> (*added_choices)() = nullptr;
  std::string_view unit = {};
  std::string_view doc = {};
};

// A map in the YAML file.
struct ConfigSection {
  std::string_view path;
  std::string_view doc;
};

// Every key, grouped by section.
std::span<const ConfigKey> ConfigKeys();
// Every map in the YAML file, in the order the writers print them: a parent comes before its
// children and its children follow it directly.
std::span<const ConfigSection> ConfigSections();
// The key at `path`, or null.
const ConfigKey* FindKey(std::string_view path);
// Whether `path` is a section.
bool IsSection(std::string_view path);

enum class ValueType { kInt, kDouble, kBool, kString, kEnum };
ValueType TypeOf(const ConfigKey& key);

constexpr std::string_view ParentOf(std::string_view path) {
  size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}

constexpr std::string_view LastPart(std::string_view path) {
  size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

constexpr bool IsDescendant(std::string_view path, std::string_view ancestor) {
  return ancestor.empty() || (path.size() > ancestor.size() && path.starts_with(ancestor) &&
                              path[ancestor.size()] == '.');
}

}  // namespace keel::config_table
