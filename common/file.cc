// Whole-file reads, crash-safe writes, and the checks that keep outputs apart from inputs.
#include "common/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

namespace {

namespace fs = std::filesystem;

// The absolute path `given` names, with `.`, `..` and links resolved as far as it exists. A link
// that dangles is followed too: opening it for writing creates its target.
fs::path ResolvePath(const std::string& given) {
  std::error_code error;
  fs::path path = fs::absolute(given, error);
  if (error) path = given;
  constexpr int kMaxLinks = 40;  // Linux's own limit on links followed in one lookup
  for (int hop = 0; hop < kMaxLinks; ++hop) {
    if (!fs::is_symlink(fs::symlink_status(path, error))) break;
    const fs::path target = fs::read_symlink(path, error);
    if (error) break;
    path = target.is_absolute() ? target : path.parent_path() / target;
  }
  fs::path resolved = fs::weakly_canonical(path, error);
  return error ? path.lexically_normal() : resolved;
}

// What a path names, for telling whether two paths are one file.
struct FileIdentity {
  bool exists = false;  // links followed
  bool folder = false;
  bool written_through = false;  // exists and is neither a regular file nor a folder
  dev_t device = 0;
  ino_t inode = 0;
  fs::path resolved;
};

FileIdentity Identify(const std::string& path) {
  FileIdentity identity;
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    identity.exists = true;
    identity.folder = S_ISDIR(info.st_mode);
    identity.written_through = !S_ISREG(info.st_mode) && !S_ISDIR(info.st_mode);
    identity.device = info.st_dev;
    identity.inode = info.st_ino;
  }
  identity.resolved = ResolvePath(path);
  return identity;
}

bool SameFile(const FileIdentity& a, const FileIdentity& b) {
  if (a.exists && b.exists) return a.device == b.device && a.inode == b.inode;
  return a.resolved == b.resolved;
}

// Whether `file` lies somewhere below `folder`.
bool Inside(const FileIdentity& folder, const FileIdentity& file) {
  const auto [in_folder, in_file] = std::mismatch(folder.resolved.begin(), folder.resolved.end(),
                                                  file.resolved.begin(), file.resolved.end());
  return in_folder == folder.resolved.end() && in_file != file.resolved.end();
}

std::string Describe(const NamedPath& named) { return named.name + " '" + named.path + "'"; }

}  // namespace

Status CheckOutputsApart(const std::vector<NamedPath>& inputs,
                         const std::vector<NamedPath>& outputs) {
  std::vector<std::pair<const NamedPath*, FileIdentity>> read;
  for (const NamedPath& input : inputs) {
    if (input.path.empty() || input.path == "-") continue;
    read.emplace_back(&input, Identify(input.path));
  }
  std::vector<std::pair<const NamedPath*, FileIdentity>> written;
  for (const NamedPath& output : outputs) {
    if (output.path.empty()) continue;
    FileIdentity identity = Identify(output.path);
    if (identity.written_through) continue;
    for (const auto& [input, input_identity] : read) {
      if (SameFile(identity, input_identity)) {
        return InvalidArgument(Describe(output) + " and " + Describe(*input) +
                               " name the same file: writing " + output.name +
                               " would replace the input (give " + output.name + " another path)");
      }
      if (input_identity.folder && identity.exists && Inside(input_identity, identity)) {
        return InvalidArgument(Describe(output) + " is a file inside the input folder " +
                               Describe(*input) + ": writing " + output.name +
                               " would replace part of the input (write it outside that folder)");
      }
    }
    if (identity.folder) {
      return InvalidArgument(Describe(output) + " is a folder; name a file to write");
    }
    for (const auto& [other, other_identity] : written) {
      if (SameFile(identity, other_identity)) {
        return InvalidArgument(Describe(output) + " and " + Describe(*other) +
                               " name the same file: one output would replace the other (give "
                               "each its own path)");
      }
    }
    written.emplace_back(&output, std::move(identity));
  }
  return Status::Ok();
}

Status CheckOutputFolder(std::string_view argument, const std::string& dir) {
  if (dir.empty()) {
    return InvalidArgument(std::string(argument) +
                           " is empty: name the folder to write into (an empty path would put "
                           "its files at the filesystem root)");
  }
  if (ResolvePath(dir) == fs::path("/")) {
    return InvalidArgument(std::string(argument) + " '" + dir +
                           "' is the filesystem root: name a folder of its own");
  }
  return Status::Ok();
}

}  // namespace keel
