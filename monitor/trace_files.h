// What the trace readers (monitor/trace*.cc) share: bounded reads of a trace's files, lines of
// text, numbers in file names and folders. Internal to monitor/.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/status.hpp"

namespace keel::trace_files {

// One file of a trace, read whole as common/file.h's ReadFile does: a regular file of at most
// KEEL_MAX_TRACE_BYTES.
Result<std::string> ReadTraceFile(const std::string& path);

// Splits `text`, the contents of `path`, into lines (without '\n' or a trailing '\r'); trailing
// empty lines are dropped. A line longer than KEEL_MAX_LINE_BYTES is InvalidArgument naming the
// file and line (CheckLineLength).
Result<std::vector<std::string_view>> SplitLines(std::string_view text, std::string_view path);

// InvalidArgument naming `where` ("file:line") when `line` holds more than `max_bytes`, the line
// limit in force (InputLimitBytes(InputLimit::kTraceLineBytes)).
Status CheckLineLength(std::string_view line, std::string_view where, uint64_t max_bytes);

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

// True for a folder that holds expert_weights_1.txt: one ESFT task (the ESFT importer and format
// detection both ask).
bool IsEsftTaskFolder(const std::string& path);

}  // namespace keel::trace_files
