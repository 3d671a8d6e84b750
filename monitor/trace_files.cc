// What the trace importers share (monitor/trace_files.h).
#include "monitor/trace_files.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <utility>

extern char** environ;

namespace keel::trace_files {

namespace fs = std::filesystem;

std::vector<std::string_view> SplitLines(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
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

Result<TemporaryFolder> TemporaryFolder::Create() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-trace-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) {
    return IoError(pattern + ": mkdtemp failed: " + std::generic_category().message(errno));
  }
  return TemporaryFolder(pattern);
}

TemporaryFolder::~TemporaryFolder() {
  if (path_.empty()) return;
  std::error_code ignored;
  fs::remove_all(path_, ignored);
}

Status ExtractTarXz(const std::string& archive, const std::string& folder) {
  std::vector<std::string> args = {"tar", "-xJf", archive, "-C", folder};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int spawn_error = posix_spawnp(&pid, "tar", nullptr, nullptr, argv.data(), environ);
  if (spawn_error != 0) {
    return IoError(archive + ": cannot run tar: " + std::generic_category().message(spawn_error));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return IoError(archive + ": waiting for tar failed");
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    // Almost always a truncated or corrupt archive: bad input, like any other bad trace.
    return InvalidArgument(archive + ": `tar -xJf` failed (exit status " +
                           std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) +
                           "): the archive is truncated, corrupt or not .tar.xz (or xz is not "
                           "installed)");
  }
  return Status::Ok();
}

bool IsEsftTaskFolder(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(fs::path(path) / "expert_weights_1.txt", error);
}

}  // namespace keel::trace_files
