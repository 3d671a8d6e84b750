// What the trace importers (monitor/trace_import*.cc) share: lines of text, numbers in file names,
// folders and .tar.xz archives. Internal to monitor/.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/status.hpp"

namespace keel::trace_files {

// Splits text into lines (without '\n' or a trailing '\r'); trailing empty lines are dropped.
std::vector<std::string_view> SplitLines(std::string_view text);

bool EndsWith(std::string_view text, std::string_view suffix);

// Parses `<prefix><digits><suffix>` and returns the number; nothing when `name` has another
// shape; an error when its digits do not fit in 64 bits (a file that would otherwise be skipped
// without a word).
Result<std::optional<int64_t>> NumberBetween(std::string_view name, std::string_view prefix,
                                             std::string_view suffix);

// The entries of a folder, without exceptions; an unreadable folder lists as empty.
struct FolderEntry {
  std::string name;
  std::string path;
  bool is_directory = false;
};
std::vector<FolderEntry> ListFolder(const std::string& folder);

bool IsFolder(const std::string& path);

// A folder made with mkdtemp and removed, with everything in it, when this goes out of scope.
class TemporaryFolder {
 public:
  static Result<TemporaryFolder> Create();
  TemporaryFolder(TemporaryFolder&& other) noexcept : path_(std::move(other.path_)) {
    other.path_.clear();
  }
  TemporaryFolder& operator=(TemporaryFolder&&) = delete;
  TemporaryFolder(const TemporaryFolder&) = delete;
  ~TemporaryFolder();
  const std::string& path() const { return path_; }

 private:
  explicit TemporaryFolder(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Runs `tar -xJf archive -C folder` without a shell, so no path needs quoting.
Status ExtractTarXz(const std::string& archive, const std::string& folder);

// True for a folder that holds expert_weights_1.txt: one ESFT task (the ESFT importer and format
// detection both ask).
bool IsEsftTaskFolder(const std::string& path);

}  // namespace keel::trace_files
