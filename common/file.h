// Whole-file reads and crash-safe writes, shared by the trace reader, importers and tools.
#pragma once

#include <string>
#include <string_view>

#include "keel/status.hpp"

namespace keel {

// The bytes of `path`; NotFound names the path and the system's reason.
Result<std::string> ReadFile(const std::string& path);

// Writes `contents` to a temporary file next to `path` and renames it over `path`, so a failure
// never leaves a half-written file and never destroys the previous one. A link to a regular file
// stays a link (its target is replaced); a path that names something other than a regular file or
// a folder (a FIFO, a device such as /dev/stdout) is written through, as any program would.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

}  // namespace keel
