// Bounded reads of every input file, crash-safe writes, opens that never block, and the checks
// that keep what a program writes from replacing what it reads. Every file Keel reads (config,
// `keel plan` input, strategy pool, trace, checkpoint) comes through ReadFile or InputFile.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/status.hpp"

namespace keel {

// An owned file descriptor, closed when this goes out of scope.
class Descriptor {
 public:
  Descriptor() = default;
  explicit Descriptor(int fd) : fd_(fd) {}
  Descriptor(Descriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Descriptor& operator=(Descriptor&& other) noexcept;
  ~Descriptor() { Reset(); }

  int get() const { return fd_; }
  // Gives the descriptor up: the caller closes what this returns.
  int Release() { return std::exchange(fd_, -1); }
  void Reset();

 private:
  int fd_ = -1;
};

// The limits on what Keel reads, one per kind of input, so that a device, an endless stream or a
// file far larger than any of its kind is refused instead of read until memory runs out. Each
// has a default and an environment variable that overrides it, the same for the CLI, the C API
// and the Python package (docs/config.md, "Input limits").
enum class InputLimit {
  kConfigBytes,        // a config file
  kPlanInputBytes,     // `keel plan --input` (a file or stdin)
  kStrategyPoolBytes,  // a strategy pool (`--pool`)
  kTraceFileBytes,     // one file of a trace: a Keel trace, each importer's file, a .tar.xz
  kArchiveBytes,       // what one .tar.xz trace expands to
  kTraceLineBytes,     // one line of a line-based trace (Keel, Megatron, SmartMoE, ESFT)
  kTraceCountBytes,    // the counts a trace holds in memory, 8 bytes each
};

struct InputLimitInfo {
  InputLimit limit;
  std::string_view variable;  // the environment variable that overrides it
  uint64_t default_bytes;
  std::string_view subject;  // what it bounds, completing "the limit for ..."
  std::string_view doc;      // which inputs, for the reference
};

// Every limit, in the order of the enum: the one table that docs/config.md is generated from.
std::span<const InputLimitInfo> InputLimits();
const InputLimitInfo& InputLimitOf(InputLimit limit);

// The limit in force: the variable's value when it is set, else the default. The value is a whole
// number of bytes, optionally followed by K, M or G (KiB, MiB, GiB); anything else is
// InvalidArgument naming the variable and the value, never a limit silently ignored.
Result<uint64_t> InputLimitBytes(InputLimit limit);

// Set to 1, lets ReadFile read pipes, FIFOs and character devices as streams, bounded by the same
// limits; otherwise only regular files are read ("-" for stdin, where a flag accepts it, is always
// a stream).
inline constexpr std::string_view kAllowStreamsVariable = "KEEL_ALLOW_STREAMS";

// "1.5 GiB", "64 MiB", "812 bytes": sizes in messages.
std::string DescribeBytes(uint64_t bytes);

// How ReadFile and InputFile::Open bound a read and name the file in messages.
struct ReadOptions {
  InputLimit limit = InputLimit::kTraceFileBytes;  // the kind of input, whose limit applies
  // Nonzero: at most this many bytes instead of `limit`, for a file whose size the reader knows
  // (an expert file); `subject` then says what that size is.
  uint64_t max_bytes = 0;
  std::string_view subject = {};
  // The flag or key that named the path ("--config", "--input"): messages start
  // "--config 'PATH': ", or "PATH: " when empty.
  std::string_view argument = {};
  bool dash_is_stdin = false;  // "-" reads standard input
};

// The whole of `path`, refused before it is read when it is larger than the limit and while it
// is read when it grows past it. It is opened without blocking (a FIFO with no writer does not
// hang the open) and must be a regular file, unless KEEL_ALLOW_STREAMS=1 or it is stdin. Errors:
// NotFound (missing), InvalidArgument (a folder, a FIFO, a device, too large; naming the path,
// the size, the limit and how to raise it), IoError (a read that failed).
Result<std::string> ReadFile(const std::string& path, const ReadOptions& options);

// An input file opened and checked as ReadFile does, for readers that want less than all of it
// (the first line) or hand it to another program (an archive to xz).
class InputFile {
 public:
  static Result<InputFile> Open(const std::string& path, const ReadOptions& options);

  // The descriptor, blocking, at the start of the file; this object closes it (stdin excepted).
  int fd() const { return fd_; }
  // Every remaining byte, at most the limit (InvalidArgument beyond it).
  Result<std::string> ReadAll();
  // The bytes before the first '\n' (or the end), at most `max_bytes` of them.
  Result<std::string> ReadFirstLine(size_t max_bytes);

 private:
  InputFile(Descriptor owned, int fd, std::string who, uint64_t max_bytes, std::string limit_text)
      : owned_(std::move(owned)),
        fd_(fd),
        who_(std::move(who)),
        max_bytes_(max_bytes),
        limit_text_(std::move(limit_text)) {}
  Descriptor owned_;  // empty for stdin
  int fd_ = -1;
  bool regular_ = true;  // a regular file, whose size was known when it was opened
  uint64_t size_ = 0;    // that size
  std::string who_;      // "--config 'PATH'" or "PATH", for messages
  uint64_t max_bytes_ = 0;
  std::string limit_text_;  // "the limit of 1 MiB for a config file (KEEL_MAX_CONFIG_BYTES ...)"
};

// Opens `path` for writing (open(2) `flags`, such as O_CREAT | O_TRUNC, are added to O_WRONLY)
// without blocking forever: a FIFO that no process reads fails with InvalidArgument naming the
// path, once no reader has opened it for kFifoReaderWaitSeconds (a reader started just before,
// as in `cat FIFO &`, gets that long to open it). The descriptor returned is blocking and
// close-on-exec.
inline constexpr int kFifoReaderWaitSeconds = 2;
Result<Descriptor> OpenForWriting(const std::string& path, int flags);

// Writes `contents` to a temporary file next to `path` and renames it over `path`, so a failure
// never leaves a half-written file and never destroys the previous one. A link to a regular file
// stays a link (its target is replaced); a path that names something other than a regular file or
// a folder (a FIFO, a device such as /dev/stdout) is written through, as any program would, and
// opened as OpenForWriting does: a FIFO that no process reads is an error, not a wait forever.
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
