// Whole-file reads and crash-safe writes, shared by the trace reader, importers and tools, and
// the checks that keep what a program writes from replacing what it reads.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "keel/status.hpp"

namespace keel {

// The bytes of `path`; NotFound names the path and the system's reason.
Result<std::string> ReadFile(const std::string& path);

// Writes `contents` to a temporary file next to `path` and renames it over `path`, so a failure
// never leaves a half-written file and never destroys the previous one. A link to a regular file
// stays a link (its target is replaced); a path that names something other than a regular file or
// a folder (a FIFO, a device such as /dev/stdout) is written through, as any program would.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// A path a program reads or writes, with the flag or key that named it ("--trace",
// "monitor.trace_path") for messages. An empty path is one not given.
struct NamedPath {
  std::string name;
  std::string path;
};

// Refuses, before anything is written, an output that would replace one of `inputs` or another of
// `outputs`: InvalidArgument naming both flags and the path. Two paths are the same file when
// they name the same device and inode (links, hard links and other spellings included), or,
// when the file does not exist yet, the same absolute path once `.`, `..` and links are
// resolved. An output that names an existing file inside an input folder would replace part of
// that input and is refused too, and so is an output that is a folder. An output that exists and
// is neither a regular file nor a folder (a FIFO, /dev/null, /dev/stdout) is written through,
// never replaced, and is not compared. Empty paths and the input "-" (stdin) are skipped.
Status CheckOutputsApart(const std::vector<NamedPath>& inputs,
                         const std::vector<NamedPath>& outputs);

// Refuses an empty path and the filesystem root (however spelled: "/", "/tmp/..", "." in /) as
// a folder that Keel fills with files and folders of its own: InvalidArgument naming
// `argument`. An empty path would put them at the root.
Status CheckOutputFolder(std::string_view argument, const std::string& dir);

}  // namespace keel
