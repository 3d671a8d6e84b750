// Whole-file reads and crash-safe writes.
#include "common/file.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <system_error>

namespace keel {

Result<std::string> ReadFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return NotFound(path + ": cannot open: " + std::generic_category().message(errno));
  }
  std::string text;
  if (std::fseek(file, 0, SEEK_END) == 0) {
    const long size = std::ftell(file);
    if (size > 0) text.reserve(static_cast<size_t>(size));
    std::rewind(file);
  }
  char buffer[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, got);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return IoError(path + ": read failed");
  return text;
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  std::FILE* file = std::fopen(temporary.c_str(), "wb");
  if (file == nullptr) {
    return IoError(temporary + ": cannot create: " + std::generic_category().message(errno));
  }
  bool ok = std::fwrite(contents.data(), 1, contents.size(), file) == contents.size();
  ok = std::fclose(file) == 0 && ok;
  if (!ok) {
    std::remove(temporary.c_str());
    return IoError(temporary + ": write failed (disk full?)");
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = std::generic_category().message(errno);
    std::remove(temporary.c_str());
    return IoError(path + ": cannot rename " + temporary + " into place: " + reason);
  }
  return Status::Ok();
}

}  // namespace keel
