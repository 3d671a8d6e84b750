// Trace archives extracted under a size limit into temporary folders that signals remove too
// (monitor/trace_archive.h).
#include "monitor/trace_archive.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "common/file.h"

extern char** environ;

namespace keel::trace_files {
namespace {

// What the signal handler cleans up. A handler can reach only what is global; it reads these
// with atomics alone, never a lock or an allocation.
constexpr int kSlots = 16;

struct FolderSlot {
  std::atomic<int> state{0};  // kFree, kFilling, kHeld
  char path[PATH_MAX] = {};
};
constexpr int kFree = 0;
constexpr int kFilling = 1;
constexpr int kHeld = 2;

FolderSlot g_folders[kSlots];
std::atomic<pid_t> g_children[kSlots];

constexpr int kCleanupSignals[] = {SIGINT, SIGTERM, SIGHUP};

// Below the temporary folder, how deep the handler follows folders (the SmartMoE archive has
// two levels); deeper ones stay. Each level holds a small buffer on the handler's stack.
constexpr int kMaxRemoveDepth = 16;

// Removes `name` in the folder `parent` and, for a folder, everything in it, with system calls
// alone: safe in a signal handler. True when it is gone.
bool RemoveTreeAt(int parent, const char* name, int depth);

// Removes every entry of the open folder `folder`. Entries are removed while the folder is
// listed, so it is listed again until a pass removes nothing.
void RemoveEntries(int folder, int depth) {
  alignas(8) char buffer[1024];
  for (bool removed = true; removed;) {
    removed = false;
    if (::lseek(folder, 0, SEEK_SET) != 0) return;
    ssize_t got = 0;
    while ((got = ::getdents64(folder, buffer, sizeof(buffer))) > 0) {
      for (ssize_t at = 0; at < got;) {
        const auto* entry = reinterpret_cast<const struct dirent64*>(buffer + at);
        at += entry->d_reclen;
        const char* name = entry->d_name;
        if (std::strcmp(name, ".") == 0 || std::strcmp(name, "..") == 0) continue;
        removed |= RemoveTreeAt(folder, name, depth);
      }
    }
  }
}

bool RemoveTreeAt(int parent, const char* name, int depth) {
  if (::unlinkat(parent, name, 0) == 0) return true;
  if (errno == ENOENT) return false;
  if (errno != EISDIR && errno != EPERM) return false;
  if (depth < kMaxRemoveDepth) {
    const int folder = ::openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (folder >= 0) {
      RemoveEntries(folder, depth + 1);
      ::close(folder);
    }
  }
  return ::unlinkat(parent, name, AT_REMOVEDIR) == 0;
}

void OnCleanupSignal(int signal) {
  for (std::atomic<pid_t>& child : g_children) {
    const pid_t pid = child.exchange(0);
    if (pid <= 0) continue;
    ::kill(pid, SIGKILL);
    // Reaped before its folder goes, so that nothing writes into the folder being removed.
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  for (FolderSlot& folder : g_folders) {
    if (folder.state.load() != kHeld) continue;
    RemoveTreeAt(AT_FDCWD, folder.path, 0);
  }
  // The signal then does what it would have done: end the process. It is blocked while this
  // handler runs, so it arrives as soon as the handler returns.
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  ::sigemptyset(&default_action.sa_mask);
  ::sigaction(signal, &default_action, nullptr);
  ::raise(signal);
}

// Installs OnCleanupSignal for each cleanup signal whose action is the default one, once.
void InstallCleanupHandler() {
  static std::once_flag installed;
  std::call_once(installed, [] {
    for (int signal : kCleanupSignals) {
      struct sigaction current {};
      if (::sigaction(signal, nullptr, &current) != 0) continue;
      if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) continue;
      struct sigaction cleanup {};
      cleanup.sa_handler = OnCleanupSignal;
      ::sigfillset(&cleanup.sa_mask);
      cleanup.sa_flags = SA_RESTART;
      ::sigaction(signal, &cleanup, nullptr);
    }
  });
}

int HoldFolder(const std::string& path) {
  if (path.size() >= PATH_MAX) return -1;
  for (int slot = 0; slot < kSlots; ++slot) {
    int free = kFree;
    if (!g_folders[slot].state.compare_exchange_strong(free, kFilling)) continue;
    std::memcpy(g_folders[slot].path, path.c_str(), path.size() + 1);
    g_folders[slot].state.store(kHeld);
    return slot;
  }
  return -1;
}

int HoldChild(pid_t pid) {
  for (int slot = 0; slot < kSlots; ++slot) {
    pid_t free = 0;
    if (g_children[slot].compare_exchange_strong(free, pid)) return slot;
  }
  return -1;
}

std::string Reason(int error) { return std::generic_category().message(error); }

// A program ExtractTarXz runs, known to the signal handler while it runs, and killed and reaped
// when this goes out of scope before Wait has reaped it.
class Child {
 public:
  // Runs `args` (found on PATH) with `input` as its stdin and, unless -1, `output` as its stdout;
  // `quiet` sends its stderr to /dev/null.
  static Result<Child> Spawn(std::vector<std::string> args, int input, int output,
                             bool quiet = false) {
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, input, STDIN_FILENO);
    if (output >= 0) posix_spawn_file_actions_adddup2(&actions, output, STDOUT_FILENO);
    if (quiet) posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
    // The program starts with no signal blocked and SIGPIPE at its default (a Python host ignores
    // it), so that xz ends when nobody reads it any more.
    posix_spawnattr_t attributes;
    posix_spawnattr_init(&attributes);
    sigset_t none;
    ::sigemptyset(&none);
    posix_spawnattr_setsigmask(&attributes, &none);
    sigset_t defaults;
    ::sigemptyset(&defaults);
    ::sigaddset(&defaults, SIGPIPE);
    posix_spawnattr_setsigdefault(&attributes, &defaults);
    posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    pid_t pid = 0;
    const int error = posix_spawnp(&pid, argv[0], &actions, &attributes, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attributes);
    if (error != 0) return IoError("cannot run " + args[0] + ": " + Reason(error));
    return Child(args[0], pid, HoldChild(pid));
  }

  Child(Child&& other) noexcept
      : name_(std::move(other.name_)), pid_(other.pid_), slot_(other.slot_) {
    other.pid_ = 0;
    other.slot_ = -1;
  }
  Child& operator=(Child&&) = delete;
  Child(const Child&) = delete;
  ~Child() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    (void)Wait();
  }

  // Waits for the program to end; its exit status, or "killed by signal N".
  std::string Wait() {
    // Forgotten by the handler first: once reaped, its pid may be another process's.
    if (slot_ >= 0) g_children[slot_].store(0);
    slot_ = -1;
    int status = 0;
    pid_t reaped = 0;
    while ((reaped = ::waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
    }
    pid_ = 0;
    if (reaped < 0) return name_ + " could not be waited for";
    if (WIFEXITED(status)) {
      return WEXITSTATUS(status) == 0
                 ? std::string()
                 : name_ + " exit status " + std::to_string(WEXITSTATUS(status));
    }
    return name_ + " killed by signal " + std::to_string(WTERMSIG(status));
  }

 private:
  Child(std::string name, pid_t pid, int slot) : name_(std::move(name)), pid_(pid), slot_(slot) {}
  std::string name_;
  pid_t pid_ = 0;
  int slot_ = -1;
};

// Sends all of `data` to tar; false when tar no longer reads (it ended).
bool SendAll(int socket, const char* data, size_t size) {
  while (size > 0) {
    // MSG_NOSIGNAL: a tar that ended early is an error to report, not a SIGPIPE for Keel.
    const ssize_t sent = ::send(socket, data, size, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += sent;
    size -= static_cast<size_t>(sent);
  }
  return true;
}

// What the index of the .xz file open at `archive` says it expands to (`xz --robot --list`);
// nothing when xz cannot list it (not an .xz file: the extraction says so).
std::optional<uint64_t> ListedSize(int archive) {
  int pipe_ends[2];
  if (::pipe2(pipe_ends, O_CLOEXEC) != 0) return std::nullopt;
  Descriptor listing(pipe_ends[0]);
  Descriptor xz_output(pipe_ends[1]);
  // --list needs a path it can seek in: /dev/stdin opens the archive again.
  Result<Child> xz =
      Child::Spawn({"xz", "--robot", "--list", "/dev/stdin"}, archive, xz_output.get(), true);
  if (!xz.ok()) return std::nullopt;
  xz_output.Reset();
  std::string text;
  char buffer[4096];
  ssize_t got = 0;
  while (text.size() < (1 << 20) && ((got = ::read(listing.get(), buffer, sizeof(buffer))) > 0 ||
                                     (got < 0 && errno == EINTR))) {
    if (got > 0) text.append(buffer, static_cast<size_t>(got));
  }
  listing.Reset();
  if (!xz->Wait().empty()) return std::nullopt;
  // "totals\t<streams>\t<blocks>\t<compressed>\t<uncompressed>\t..."
  const size_t totals = text.find("totals\t");
  if (totals == std::string::npos) return std::nullopt;
  std::string_view fields = std::string_view(text).substr(totals);
  for (int skip = 0; skip < 4; ++skip) {
    const size_t tab = fields.find('\t');
    if (tab == std::string_view::npos) return std::nullopt;
    fields.remove_prefix(tab + 1);
  }
  uint64_t size = 0;
  const auto [end, error] = std::from_chars(fields.data(), fields.data() + fields.size(), size);
  if (error != std::errc()) return std::nullopt;
  return size;
}

Status ArchiveTooLarge(const std::string& archive, uint64_t max_bytes, std::string_view how) {
  const InputLimitInfo& info = InputLimitOf(InputLimit::kArchiveBytes);
  return InvalidArgument(archive + ": " + std::string(how) + " the limit of " +
                         DescribeBytes(max_bytes) + " for " + std::string(info.subject) + " (set " +
                         std::string(info.variable) + " to raise it)");
}

}  // namespace

Result<TemporaryFolder> TemporaryFolder::Create() {
  InstallCleanupHandler();
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-trace-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    return IoError(pattern + ": mkdtemp failed: " + Reason(errno));
  }
  const int slot = HoldFolder(pattern);
  return TemporaryFolder(std::move(pattern), slot);
}

TemporaryFolder::TemporaryFolder(TemporaryFolder&& other) noexcept
    : path_(std::move(other.path_)), slot_(other.slot_) {
  other.path_.clear();
  other.slot_ = -1;
}

TemporaryFolder::~TemporaryFolder() {
  if (slot_ >= 0) g_folders[slot_].state.store(kFree);
  if (path_.empty()) return;
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

Status ExtractTarXz(const std::string& archive, const std::string& folder) {
  KEEL_ASSIGN_OR_RETURN(const uint64_t max_bytes, InputLimitBytes(InputLimit::kArchiveBytes));
  KEEL_ASSIGN_OR_RETURN(InputFile input,
                        InputFile::Open(archive, {.limit = InputLimit::kTraceFileBytes}));
  // Refused at once, before anything is written, when the archive says it is too large. The
  // count below holds an archive whose index lies.
  if (const std::optional<uint64_t> listed = ListedSize(input.fd());
      listed && *listed > max_bytes) {
    return ArchiveTooLarge(archive, max_bytes,
                           "expands to " + DescribeBytes(*listed) + ", more than");
  }
  int pipe_ends[2];
  if (::pipe2(pipe_ends, O_CLOEXEC) != 0) return IoError("pipe failed: " + Reason(errno));
  Descriptor decompressed(pipe_ends[0]);
  Descriptor xz_output(pipe_ends[1]);
  // A socket rather than a pipe towards tar: send() with MSG_NOSIGNAL reports a tar that ended.
  int socket_ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, socket_ends) != 0) {
    return IoError("socketpair failed: " + Reason(errno));
  }
  Descriptor to_tar(socket_ends[0]);
  Descriptor tar_input(socket_ends[1]);
  KEEL_ASSIGN_OR_RETURN(Child xz, Child::Spawn({"xz", "-dc"}, input.fd(), xz_output.get()));
  KEEL_ASSIGN_OR_RETURN(
      Child tar,
      Child::Spawn({"tar", "-xf", "-", "-C", folder, "--no-same-owner"}, tar_input.get(), -1));
  // The programs hold these ends now; each sees the end of its input only once Keel closes its own.
  xz_output.Reset();
  tar_input.Reset();

  uint64_t total = 0;
  bool tar_reads = true;
  std::vector<char> buffer(1 << 16);
  while (true) {
    const ssize_t got = ::read(decompressed.get(), buffer.data(), buffer.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return IoError(archive + ": reading from xz failed: " + Reason(errno));
    if (got == 0) break;
    total += static_cast<uint64_t>(got);
    if (total > max_bytes) {
      // The destructors stop both programs; the caller's TemporaryFolder removes their output.
      return ArchiveTooLarge(archive, max_bytes, "expands to more than");
    }
    // A tar that ended (at the archive's end marker, or on an error its status tells) gets no
    // more; the rest is still read, within the limit, so that xz checks the whole archive.
    if (tar_reads && !SendAll(to_tar.get(), buffer.data(), static_cast<size_t>(got))) {
      tar_reads = false;
      to_tar.Reset();
    }
  }
  to_tar.Reset();
  decompressed.Reset();
  const std::string tar_failure = tar.Wait();
  const std::string xz_failure = xz.Wait();
  if (!tar_failure.empty() || !xz_failure.empty()) {
    // Almost always a truncated or corrupt archive: bad input, like any other bad trace.
    const std::string failures =
        xz_failure + (!xz_failure.empty() && !tar_failure.empty() ? ", " : "") + tar_failure;
    return InvalidArgument(archive + ": `xz -dc | tar -xf -` failed (" + failures +
                           "): the archive is truncated, corrupt or not .tar.xz");
  }
  return Status::Ok();
}

}  // namespace keel::trace_files
