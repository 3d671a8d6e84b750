// What the trace importers share (monitor/trace_files.h).
#include "monitor/trace_files.h"

#include <charconv>
#include <filesystem>
#include <system_error>
#include <utility>

#include "common/file.h"

namespace keel::trace_files {

namespace fs = std::filesystem;

Result<std::string> ReadTraceFile(const std::string& path) {
  return ReadFile(path, {.limit = InputLimit::kTraceFileBytes});
}

Status CheckLineLength(std::string_view line, std::string_view where, uint64_t max_bytes) {
  if (line.size() <= max_bytes) return Status::Ok();
  const InputLimitInfo& info = InputLimitOf(InputLimit::kTraceLineBytes);
  return InvalidArgument(std::string(where) + ": a line of " + DescribeBytes(line.size()) +
                         " is longer than the limit of " + DescribeBytes(max_bytes) + " for " +
                         std::string(info.subject) + " (set " + std::string(info.variable) +
                         " to raise it)");
}

Result<std::vector<std::string_view>> SplitLines(std::string_view text, std::string_view path) {
  KEEL_ASSIGN_OR_RETURN(const uint64_t max_line, InputLimitBytes(InputLimit::kTraceLineBytes));
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.size() > max_line) {
      return CheckLineLength(line, std::string(path) + ":" + std::to_string(lines.size() + 1),
                             max_line);
    }
    lines.push_back(line);
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  while (!lines.empty() && lines.back().find_first_not_of(" \t") == std::string_view::npos) {
    lines.pop_back();
  }
  return lines;
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

Result<std::optional<int64_t>> NumberBetween(std::string_view name, std::string_view prefix,
                                             std::string_view suffix) {
  if (!name.starts_with(prefix) || !EndsWith(name, suffix)) return std::optional<int64_t>();
  std::string_view digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  int64_t value = 0;
  auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error == std::errc::result_out_of_range && end == digits.data() + digits.size()) {
    return InvalidArgument(std::string(name) + ": the number " + std::string(digits) +
                           " in the file name does not fit in 64 bits");
  }
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) {
    return std::optional<int64_t>();
  }
  return std::optional<int64_t>(value);
}

std::vector<FolderEntry> ListFolder(const std::string& folder) {
  std::vector<FolderEntry> entries;
  std::error_code error;
  fs::directory_iterator it(folder, error);
  for (; !error && it != fs::directory_iterator(); it.increment(error)) {
    std::error_code type_error;
    entries.push_back(
        {it->path().filename().string(), it->path().string(), it->is_directory(type_error)});
  }
  return entries;
}

bool IsFolder(const std::string& path) {
  std::error_code error;
  return fs::is_directory(path, error);
}

bool IsEsftTaskFolder(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(fs::path(path) / "expert_weights_1.txt", error);
}

}  // namespace keel::trace_files
