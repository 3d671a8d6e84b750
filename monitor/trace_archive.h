// Trace archives (.tar.xz) extracted under a size limit into a temporary folder that is removed on
// every way out: a return, an error, and SIGINT, SIGTERM or SIGHUP, which also stop the programs
// that extract it. Internal to monitor/ (the SmartMoE importer).
#pragma once

#include <string>

#include "keel/status.hpp"

namespace keel::trace_files {

// A folder made with mkdtemp under $TMPDIR (default /tmp), removed with everything in it when
// this goes out of scope. While it exists, SIGINT, SIGTERM and SIGHUP remove it too, where their
// action is the default one (ending the process): the first folder made installs a handler that
// stops ExtractTarXz's programs, removes every such folder and then lets the signal end the
// process as it would have. A program that handles these signals itself keeps its handlers; its
// own unwinding removes the folder. The handler knows up to 16 folders at once; a folder beyond
// them is removed by its destructor only.
class TemporaryFolder {
 public:
  static Result<TemporaryFolder> Create();
  TemporaryFolder(TemporaryFolder&& other) noexcept;
  TemporaryFolder& operator=(TemporaryFolder&&) = delete;
  TemporaryFolder(const TemporaryFolder&) = delete;
  ~TemporaryFolder();
  const std::string& path() const { return path_; }

 private:
  TemporaryFolder(std::string path, int slot) : path_(std::move(path)), slot_(slot) {}
  std::string path_;
  int slot_ = -1;  // where the signal handler finds it; -1 when it does not
};

// Extracts the .tar.xz `archive` into `folder` (a TemporaryFolder's) without a shell: `xz -dc`
// decompresses the archive, Keel counts the bytes and hands them to `tar -xf -`. The archive must
// be a regular file within KEEL_MAX_TRACE_BYTES (common/file.h). Once more than
// KEEL_MAX_ARCHIVE_BYTES have come out of it, both programs are stopped and the result is
// InvalidArgument naming the archive and the limit; what was extracted stays for the caller's
// TemporaryFolder to remove. Both programs are stopped and reaped on every way out, and since
// every byte passes through Keel, they end by themselves (xz on a broken pipe, tar at the end of
// its input) even if Keel is killed outright.
Status ExtractTarXz(const std::string& archive, const std::string& folder);

}  // namespace keel::trace_files
