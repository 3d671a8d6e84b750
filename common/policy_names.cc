#include "common/policy_names.h"

#include <algorithm>
#include <mutex>

#include "keel/plan.hpp"

namespace keel {
namespace {

std::mutex& NamesMutex() {
  static std::mutex mutex;
  return mutex;
}

// Guarded by NamesMutex().
std::vector<std::string>& Added() {
  static std::vector<std::string> names;
  return names;
}

bool IsBuiltin(std::string_view name) {
  return std::find(std::begin(kBuiltinPolicyNames), std::end(kBuiltinPolicyNames), name) !=
         std::end(kBuiltinPolicyNames);
}

}  // namespace

bool AddPolicyName(std::string_view name) {
  if (IsBuiltin(name)) return false;
  std::lock_guard<std::mutex> lock(NamesMutex());
  std::vector<std::string>& added = Added();
  if (std::find(added.begin(), added.end(), name) != added.end()) return false;
  added.emplace_back(name);
  return true;
}

std::vector<std::string> AddedPolicyNames() {
  std::lock_guard<std::mutex> lock(NamesMutex());
  return Added();
}

bool IsPolicyName(std::string_view name) {
  if (IsBuiltin(name)) return true;
  std::lock_guard<std::mutex> lock(NamesMutex());
  const std::vector<std::string>& added = Added();
  return std::find(added.begin(), added.end(), name) != added.end();
}

std::vector<std::string> PolicyNames() {
  std::vector<std::string> names(std::begin(kBuiltinPolicyNames), std::end(kBuiltinPolicyNames));
  for (std::string& name : AddedPolicyNames()) names.push_back(std::move(name));
  return names;
}

}  // namespace keel
