// Helpers for tests that read Prometheus text exposition: series by "name{labels}" and a
// promtool check when the tool is installed.
#pragma once

#include <cstdio>
#include <map>
#include <sstream>
#include <string>

#include "tests/monitor/trace_test_util.h"

namespace keel::testing {

// "name{labels}" (exactly as exposed) -> value, for every sample line.
inline std::map<std::string, double> ParseExposition(const std::string& text) {
  std::map<std::string, double> series;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    series[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return series;
}

inline bool HasFamily(const std::string& text, const std::string& name) {
  return text.find("# TYPE " + name + " ") != std::string::npos;
}

inline bool HavePromtool() { return std::system("command -v promtool >/dev/null 2>&1") == 0; }

// Runs `promtool check metrics` on `text`; returns its output, "" when it passed.
inline std::string PromtoolProblems(const std::string& text) {
  ScratchFolder folder;
  const std::string input = folder.Write("metrics.txt", text);
  const std::string output = folder.File("promtool.txt");
  const int status =
      std::system(("promtool check metrics < '" + input + "' > '" + output + "' 2>&1").c_str());
  const std::string problems = ReadText(output);
  return status == 0 && problems.empty() ? "" : "promtool: " + problems;
}

}  // namespace keel::testing
