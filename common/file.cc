// Bounded reads of every input file, crash-safe writes, opens that never block, and the checks
// that keep outputs apart from inputs.
#include "common/file.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <system_error>
#include <thread>
#include <utility>

#include "keel/limits.hpp"

namespace keel {

namespace {

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

// The defaults hold every input Keel has met with room to spare (the SmartMoE artifact expands to
// 144.5 MiB, and is a 25 MB Keel trace once converted) and stop a device or an endless stream long
// before memory runs out.
constexpr InputLimitInfo kInputLimits[] = {
    {InputLimit::kConfigBytes, "KEEL_MAX_CONFIG_BYTES", 1 * kMiB, "a config file",
     "A config file: `--config`, `keel config --check`, `Config.from_file`, the C API's "
     "`config_path`."},
    {InputLimit::kPlanInputBytes, "KEEL_MAX_PLAN_INPUT_BYTES", 64 * kMiB, "`keel plan` input",
     "`keel plan --input`, a file or stdin (`-`)."},
    {InputLimit::kStrategyPoolBytes, "KEEL_MAX_POOL_BYTES", 16 * kMiB, "a strategy pool",
     "A strategy pool (`keel replay --pool`)."},
    {InputLimit::kTraceFileBytes, "KEEL_MAX_TRACE_BYTES", 1 * kGiB, "a trace file",
     "One file of a trace: a Keel trace, every file an importer reads, a `.tar.xz` archive."},
    {InputLimit::kArchiveBytes, "KEEL_MAX_ARCHIVE_BYTES", 512 * kMiB, "an extracted archive",
     "What one `.tar.xz` trace expands to; beyond it, extraction stops and its temporary folder "
     "is removed."},
    {InputLimit::kTraceLineBytes, "KEEL_MAX_LINE_BYTES", 64 * kMiB, "a trace line",
     "One line of a line-based trace (Keel, Megatron, SmartMoE, ESFT)."},
    {InputLimit::kTraceCountBytes, "KEEL_MAX_TRACE_COUNT_BYTES", 8 * uint64_t{kMaxCounts},
     "the counts of a trace",
     "The counts a trace holds in memory, 8 bytes each: steps x layers x sources x experts, and "
     "the sequences' layers x experts (the default is 2^26 counts), checked by every reader, "
     "importer and the generator before they allocate them."},
};

std::string Reason(int error) { return std::generic_category().message(error); }

// "a FIFO (named pipe)" for what a stat says is not a regular file or a folder.
std::string_view FileTypeName(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

bool StreamsAllowed() {
  const char* value = std::getenv(std::string(kAllowStreamsVariable).c_str());
  return value != nullptr && std::string_view(value) == "1";
}

// Reads into `buffer`, retrying what a signal or a non-blocking descriptor (stdin as another
// program left it) interrupts; -1 with errno on failure.
ssize_t ReadSome(int fd, char* buffer, size_t size) {
  while (true) {
    const ssize_t got = ::read(fd, buffer, size);
    if (got >= 0) return got;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    pollfd ready{fd, POLLIN, 0};
    if (::poll(&ready, 1, -1) < 0 && errno != EINTR) return -1;
  }
}

Status WriteAll(int fd, std::string_view contents, const std::string& path) {
  while (!contents.empty()) {
    const ssize_t wrote = ::write(fd, contents.data(), contents.size());
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return IoError(path + ": write failed: " + Reason(errno));
    }
    contents.remove_prefix(static_cast<size_t>(wrote));
  }
  return Status::Ok();
}

}  // namespace

Descriptor& Descriptor::operator=(Descriptor&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void Descriptor::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::span<const InputLimitInfo> InputLimits() { return kInputLimits; }

const InputLimitInfo& InputLimitOf(InputLimit limit) {
  return kInputLimits[static_cast<size_t>(limit)];
}

Result<uint64_t> InputLimitBytes(InputLimit limit) {
  const InputLimitInfo& info = InputLimitOf(limit);
  const char* value = std::getenv(std::string(info.variable).c_str());
  if (value == nullptr || *value == '\0') return info.default_bytes;
  const std::string_view text = value;
  uint64_t number = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), number);
  std::string_view suffix(end, static_cast<size_t>(text.data() + text.size() - end));
  uint64_t unit = 1;
  if (suffix == "K" || suffix == "k") unit = kKiB;
  if (suffix == "M" || suffix == "m") unit = kMiB;
  if (suffix == "G" || suffix == "g") unit = kGiB;
  const bool bad_suffix = !suffix.empty() && unit == 1;
  if (error != std::errc() || bad_suffix || number == 0 ||
      number > std::numeric_limits<uint64_t>::max() / unit) {
    return InvalidArgument(std::string(info.variable) + "='" + std::string(text) +
                           "': expected the limit for " + std::string(info.subject) +
                           " as a positive whole number of bytes, optionally followed by K, M "
                           "or G (KiB, MiB, GiB), such as 2G");
  }
  return number * unit;
}

std::string DescribeBytes(uint64_t bytes) {
  const std::pair<uint64_t, const char*> units[] = {{kGiB, "GiB"}, {kMiB, "MiB"}, {kKiB, "KiB"}};
  for (const auto& [unit, name] : units) {
    if (bytes < unit) continue;
    char text[64];
    if (bytes % unit == 0) {
      std::snprintf(text, sizeof(text), "%llu %s", static_cast<unsigned long long>(bytes / unit),
                    name);
    } else {
      std::snprintf(text, sizeof(text), "%.1f %s (%llu bytes)",
                    static_cast<double>(bytes) / static_cast<double>(unit), name,
                    static_cast<unsigned long long>(bytes));
    }
    return text;
  }
  return std::to_string(bytes) + (bytes == 1 ? " byte" : " bytes");
}

Result<InputFile> InputFile::Open(const std::string& path, const ReadOptions& options) {
  const std::string who =
      options.argument.empty() ? path : std::string(options.argument) + " '" + path + "'";
  if (path.find('\0') != std::string::npos) {
    return InvalidArgument(who + ": the path holds a NUL character");
  }
  uint64_t max_bytes = options.max_bytes;
  std::string limit_text;
  if (max_bytes > 0) {
    limit_text = DescribeBytes(max_bytes) + ", " + std::string(options.subject);
  } else {
    Result<uint64_t> limit = InputLimitBytes(options.limit);
    if (!limit.ok()) return limit.status().WithContext(who);
    max_bytes = *limit;
    const InputLimitInfo& info = InputLimitOf(options.limit);
    limit_text = "the limit of " + DescribeBytes(max_bytes) + " for " + std::string(info.subject) +
                 " (set " + std::string(info.variable) + " to raise it)";
  }
  const bool from_stdin = options.dash_is_stdin && path == "-";
  const bool streams = from_stdin || StreamsAllowed();
  // Looked at before it is opened, so that a device is refused without being opened at all.
  struct stat info {};
  if (!from_stdin && ::stat(path.c_str(), &info) == 0 && !S_ISREG(info.st_mode) &&
      !S_ISDIR(info.st_mode) && !streams) {
    return InvalidArgument(who + ": is " + std::string(FileTypeName(info.st_mode)) +
                           ", not a regular file; Keel reads inputs from regular files (set " +
                           std::string(kAllowStreamsVariable) +
                           "=1 to read pipes and devices as streams, up to the same limits)");
  }
  Descriptor owned;
  if (!from_stdin) {
    // Non-blocking: a FIFO without a writer would block the open itself.
    owned = Descriptor(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
    if (owned.get() < 0) return NotFound(who + ": cannot open: " + Reason(errno));
  }
  const int fd = from_stdin ? STDIN_FILENO : owned.get();
  InputFile file(std::move(owned), fd, who, max_bytes, std::move(limit_text));
  if (::fstat(fd, &info) != 0) return IoError(who + ": cannot stat: " + Reason(errno));
  if (S_ISDIR(info.st_mode)) return InvalidArgument(who + ": is a folder, expected a file");
  file.regular_ = S_ISREG(info.st_mode);
  if (!file.regular_ && !streams) {
    return InvalidArgument(who + ": is " + std::string(FileTypeName(info.st_mode)) +
                           ", not a regular file");
  }
  if (file.regular_ && static_cast<uint64_t>(info.st_size) > max_bytes) {
    return InvalidArgument(who + ": " + DescribeBytes(static_cast<uint64_t>(info.st_size)) +
                           " is more than " + file.limit_text_);
  }
  file.size_ = file.regular_ ? static_cast<uint64_t>(info.st_size) : 0;
  if (!from_stdin) {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      return IoError(who + ": cannot make the descriptor blocking: " + Reason(errno));
    }
  }
  return file;
}

Result<std::string> InputFile::ReadAll() {
  std::string text;
  if (size_ > 0) text.reserve(static_cast<size_t>(size_));
  char buffer[1 << 16];
  while (true) {
    // One byte past the limit tells a file that holds more from one that ends there.
    const uint64_t room = max_bytes_ + 1 - text.size();
    const ssize_t got =
        ReadSome(fd_, buffer, static_cast<size_t>(std::min<uint64_t>(room, sizeof(buffer))));
    if (got < 0) return IoError(who_ + ": read failed: " + Reason(errno));
    if (got == 0) return text;
    text.append(buffer, static_cast<size_t>(got));
    if (text.size() > max_bytes_) {
      return InvalidArgument(who_ +
                             (regular_ ? ": grew while it was read, past " : ": holds more than ") +
                             limit_text_);
    }
  }
}

Result<std::string> InputFile::ReadFirstLine(size_t max_bytes) {
  std::string line;
  char buffer[4096];
  while (line.size() < max_bytes) {
    const ssize_t got = ReadSome(fd_, buffer, std::min(sizeof(buffer), max_bytes - line.size()));
    if (got < 0) return IoError(who_ + ": read failed: " + Reason(errno));
    if (got == 0) break;
    const std::string_view part(buffer, static_cast<size_t>(got));
    const size_t newline = part.find('\n');
    line.append(part.substr(0, newline));
    if (newline != std::string_view::npos) break;
  }
  return line;
}

Result<std::string> ReadFile(const std::string& path, const ReadOptions& options) {
  KEEL_ASSIGN_OR_RETURN(InputFile file, InputFile::Open(path, options));
  return file.ReadAll();
}

Result<Descriptor> OpenForWriting(const std::string& path, int flags) {
  if (path.find('\0') != std::string::npos) {
    return InvalidArgument(path + ": the path holds a NUL character");
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(kFifoReaderWaitSeconds);
  while (true) {
    // Non-blocking: opening a FIFO for writing blocks until a reader opens it; this way it fails
    // with ENXIO instead, and is tried again until the deadline.
    Descriptor fd(::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY | flags, 0666));
    if (fd.get() >= 0) {
      const int status = ::fcntl(fd.get(), F_GETFL);
      if (status < 0 || ::fcntl(fd.get(), F_SETFL, status & ~O_NONBLOCK) != 0) {
        return IoError(path + ": cannot make the descriptor blocking: " + Reason(errno));
      }
      return fd;
    }
    if (errno == EINTR) continue;
    const int error = errno;
    struct stat info {};
    // ENXIO from anything but a FIFO (a socket, a device without its driver) is final.
    if (error != ENXIO || ::stat(path.c_str(), &info) != 0 || !S_ISFIFO(info.st_mode)) {
      return IoError(path + ": " + Reason(error));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return InvalidArgument(path + ": a FIFO that no process reads (no reader opened it within " +
                             std::to_string(kFifoReaderWaitSeconds) +
                             " s; start its reader first)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

namespace {

// Opens `path` for writing as it is (a FIFO, a device) and writes `contents` to it.
Status WriteThrough(const std::string& path, std::string_view contents) {
  KEEL_ASSIGN_OR_RETURN(Descriptor fd, OpenForWriting(path, O_CREAT | O_TRUNC));
  const Status wrote = WriteAll(fd.get(), contents, path);
  if (::close(fd.Release()) != 0 && wrote.ok()) {
    return IoError(path + ": write failed: " + Reason(errno));
  }
  return wrote;
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
  // A fresh file (whatever was left under this name by an earlier process of the same id goes):
  // never a FIFO or a link someone put there, so the open cannot block or write elsewhere.
  ::unlink(temporary.c_str());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return IoError(temporary + ": cannot create: " + Reason(errno));
  Status wrote = WriteAll(fd, contents, temporary);
  if (::close(fd) != 0 && wrote.ok()) {
    wrote = IoError(temporary + ": write failed: " + Reason(errno));
  }
  if (!wrote.ok()) {
    std::remove(temporary.c_str());
    return IoError(wrote.message() + " (disk full?)");
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const std::string reason = Reason(errno);
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
