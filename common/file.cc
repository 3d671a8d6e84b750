// Whole-file reads and crash-safe writes.
#include "common/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <system_error>

namespace keel {

Result<std::string> ReadFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return NotFound(path + ": cannot open: " + std::generic_category().message(errno));
  }
  // A folder opens like a file on Linux, and its "size" is meaningless.
  struct stat info {};
  const bool known = fstat(fileno(file), &info) == 0;
  if (known && S_ISDIR(info.st_mode)) {
    std::fclose(file);
    return InvalidArgument(path + ": is a folder, expected a file");
  }
  std::string text;
  if (known && S_ISREG(info.st_mode) && info.st_size > 0) {
    text.reserve(static_cast<size_t>(info.st_size));
  }
  char buffer[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, got);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return IoError(path + ": read failed");
  return text;
}

namespace {

// Opens `path` for writing as it is (a FIFO, a device) and writes `contents` to it.
Status WriteThrough(const std::string& path, std::string_view contents) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) {
    return IoError(path + ": cannot open for writing: " + std::generic_category().message(errno));
  }
  bool ok = std::fwrite(contents.data(), 1, contents.size(), file) == contents.size();
  ok = std::fclose(file) == 0 && ok;
  if (!ok) return IoError(path + ": write failed: " + std::generic_category().message(errno));
  return Status::Ok();
}

}  // namespace

Status WriteFileAtomically(const std::string& given_path, std::string_view contents) {
  namespace fs = std::filesystem;
  std::error_code error;
  // What the path names, links followed: only a regular file (or nothing yet) is replaced.
  const fs::file_status status = fs::status(given_path, error);
  if (fs::exists(status) && !fs::is_regular_file(status) && !fs::is_directory(status)) {
    return WriteThrough(given_path, contents);
  }
  // A link to a regular file stays a link: its target is replaced.
  std::string path = given_path;
  if (fs::is_symlink(fs::symlink_status(given_path, error))) {
    const fs::path target = fs::canonical(given_path, error);
    if (!error) path = target.string();
  }
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
