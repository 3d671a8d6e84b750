// Every way a trace is read, handed what is not a trace file within its limits: a FIFO, a device,
// a folder, a file beyond KEEL_MAX_TRACE_BYTES, a line beyond KEEL_MAX_LINE_BYTES, JSON nested too
// deep; each refused by name without blocking and without leaving a file behind. .tar.xz archives
// that expand past KEEL_MAX_ARCHIVE_BYTES (by their index, or by what comes out of them) are
// refused with their temporary folder removed and no program left running. A trace recorded into
// a FIFO that no process reads fails instead of blocking the run.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "monitor/trace.h"
#include "monitor/trace_recorder.h"
#include "tests/common/test_util.h"
#include "tests/monitor/trace_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::ScopedEnvironment;
using testing::ScratchFolder;
using testing::WithinSeconds;

// A read must end, with an answer, within this time: a hang guard, never a timing.
constexpr double kHangSeconds = 60;

// One way in: a format, and the file a bad input takes the place of (`member`); the reader is
// handed `member` itself, or the folder that holds it.
struct Reader {
  const char* name;
  TraceFormat format;
  std::string member;
  bool folder = false;    // the reader is handed the folder holding `member`
  bool json = false;      // its files are JSON: nesting applies
  bool lines = false;     // its files are read line by line: the line limit applies
  bool file_only = true;  // a folder in `member`'s place is refused as one (else read as a folder)
};

const Reader kReaders[] = {
    {.name = "keel",
     .format = TraceFormat::kKeel,
     .member = "t.jsonl",
     .json = true,
     .lines = true},
    {.name = "keel, guessed",
     .format = TraceFormat::kAuto,
     .member = "t.jsonl",
     .json = true,
     .lines = true,
     .file_only = false},
    {.name = "megatron file",
     .format = TraceFormat::kMegatron,
     .member = "router_trace_rank0.jsonl",
     .json = true,
     .lines = true,
     .file_only = false},
    {.name = "megatron folder",
     .format = TraceFormat::kMegatron,
     .member = "router_trace_rank0.jsonl",
     .folder = true,
     .json = true,
     .lines = true},
    {.name = "olmoe",
     .format = TraceFormat::kOlmoe,
     .member = "expert_counts_derived.json",
     .json = true,
     .file_only = false},
    {.name = "esft",
     .format = TraceFormat::kEsft,
     .member = "expert_weights_1.txt",
     .folder = true,
     .lines = true},
    {.name = "smartmoe",
     .format = TraceFormat::kSmartMoe,
     .member = "table_iter1_rank0.log",
     .folder = true,
     .lines = true},
    {.name = "smartmoe archive",
     .format = TraceFormat::kSmartMoe,
     .member = "moe_trace.tar.xz",
     .file_only = false},
};

// What is put where the reader's file should be, and what the refusal must say.
struct BadInput {
  const char* name;
  std::function<void(const std::string& path)> make;
  std::string text;
  std::optional<std::pair<std::string, std::string>> environment = std::nullopt;  // a lower limit
  bool json_only = false;
  bool lines_only = false;
  bool folder = false;  // puts a folder where a file should be
};

std::vector<BadInput> BadInputs() {
  const std::string stream = ", not a regular file; Keel reads inputs from regular files";
  return {
      {.name = "a FIFO with no writer",
       .make = [](const std::string& path) { ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0); },
       .text = "is a FIFO (named pipe)" + stream},
      {.name = "a link to /dev/zero",
       .make = [](const std::string& path) { fs::create_symlink("/dev/zero", path); },
       .text = "is a character device" + stream},
      {.name = "a link to /dev/urandom",
       .make = [](const std::string& path) { fs::create_symlink("/dev/urandom", path); },
       .text = "is a character device" + stream},
      {.name = "a folder",
       .make = [](const std::string& path) { fs::create_directories(path); },
       .text = "is a folder, expected a file",
       .folder = true},
      {.name = "a 2 GiB file (sparse)",
       .make =
           [](const std::string& path) {
             { std::ofstream create(path); }
             fs::resize_file(path, uint64_t{2} << 30);
           },
       .text = "2 GiB is more than the limit of 1 GiB for a trace file (set KEEL_MAX_TRACE_BYTES "
               "to raise it)"},
      {.name = "a file beyond a lowered limit",
       .make =
           [](const std::string& path) { std::ofstream(path) << std::string(5000, ' ') << "\n"; },
       .text = "4.9 KiB (5001 bytes) is more than the limit of 4 KiB for a trace file (set "
               "KEEL_MAX_TRACE_BYTES to raise it)",
       .environment = std::pair<std::string, std::string>{"KEEL_MAX_TRACE_BYTES", "4K"}},
      {.name = "a line beyond the line limit",
       .make =
           [](const std::string& path) { std::ofstream(path) << std::string(100, '1') << "\n"; },
       .text = ":1: a line of 100 bytes is longer than the limit of 64 bytes for a trace line (set "
               "KEEL_MAX_LINE_BYTES to raise it)",
       .environment = std::pair<std::string, std::string>{"KEEL_MAX_LINE_BYTES", "64"},
       .lines_only = true},
      {.name = "JSON nested 1,000 levels",
       .make =
           [](const std::string& path) {
             std::ofstream(path) << std::string(1000, '[') << std::string(1000, ']') << "\n";
           },
       .text = "arrays and objects nest deeper than 64 levels",
       .json_only = true},
  };
}

// The temporary folders (keel-trace-*) left in `tmp`.
int LeftoverFolders(const std::string& tmp) {
  int count = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(tmp)) {
    count += entry.path().filename().string().starts_with("keel-trace-");
  }
  return count;
}

// No child process is left, reaped or not.
void ExpectNoChildren() {
  int status = 0;
  const pid_t child = ::waitpid(-1, &status, WNOHANG);
  EXPECT_EQ(child, -1) << "a child process was left behind";
  EXPECT_EQ(errno, ECHILD);
}

TEST(TraceInputLimitsTest, EveryReaderRefusesWhatIsNotATraceFileWithinItsLimits) {
  ScratchFolder tmp;
  ScopedEnvironment tmpdir("TMPDIR", tmp.path());
  for (const Reader& reader : kReaders) {
    for (const BadInput& bad : BadInputs()) {
      if ((bad.json_only && !reader.json) || (bad.lines_only && !reader.lines) ||
          (bad.folder && !reader.file_only)) {
        continue;
      }
      SCOPED_TRACE(std::string(reader.name) + ": " + bad.name);
      ScratchFolder folder;
      const std::string member = folder.File("in/" + reader.member);
      fs::create_directories(folder.File("in"));
      bad.make(member);
      std::optional<ScopedEnvironment> limit;
      if (bad.environment) limit.emplace(bad.environment->first, bad.environment->second);
      const std::string path = reader.folder ? folder.File("in") : member;
      const Result<Trace> trace =
          WithinSeconds(kHangSeconds, std::string("ReadTrace ") + reader.name + ": " + bad.name,
                        [&] { return ReadTrace(path, reader.format); });
      ASSERT_FALSE(trace.ok());
      EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument) << trace.status().ToString();
      EXPECT_NE(trace.status().message().find(member), std::string::npos)
          << trace.status().ToString();
      EXPECT_NE(trace.status().message().find(bad.text), std::string::npos)
          << trace.status().ToString();
      EXPECT_EQ(LeftoverFolders(tmp.path()), 0) << "a temporary folder was left behind";
      ExpectNoChildren();
    }
  }
}

// Writes moe_trace/table_iter1_rank0.log of `bytes` bytes (zeros: they compress to almost
// nothing) into a .tar.xz, with xz's own format (an index that tells the size) or the legacy
// .lzma format (no index: only the count while extracting can tell).
std::string WriteArchive(const ScratchFolder& folder, size_t bytes, bool with_index) {
  folder.Write("src/moe_trace/table_iter1_rank0.log", std::string(bytes, '\0'));
  const std::string archive = folder.File("moe_trace.tar.xz");
  const std::string command = "tar -cf - -C '" + folder.File("src") + "' moe_trace | xz " +
                              (with_index ? "" : "--format=lzma ") + "> '" + archive + "'";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  fs::remove_all(folder.File("src"));
  return archive;
}

// An archive that expands past KEEL_MAX_ARCHIVE_BYTES is refused: at once when its index says so,
// while extracting when it has none (xz and tar are then stopped). Either way the temporary
// folder is gone and no program is left running.
TEST(TraceInputLimitsTest, ArchivesThatExpandPastTheLimitAreRefusedAndLeaveNothing) {
  ScratchFolder tmp;
  ScopedEnvironment tmpdir("TMPDIR", tmp.path());
  ScopedEnvironment limit("KEEL_MAX_ARCHIVE_BYTES", "1M");
  for (const bool with_index : {true, false}) {
    SCOPED_TRACE(with_index ? "xz with an index" : "lzma, no index");
    ScratchFolder folder;
    const std::string archive = WriteArchive(folder, 8 << 20, with_index);
    const Result<Trace> trace = WithinSeconds(kHangSeconds, "ReadTrace(archive)", [&] {
      return ReadTrace(archive, TraceFormat::kSmartMoe);
    });
    ASSERT_FALSE(trace.ok());
    EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument);
    const std::string expected =
        with_index ? archive + ": expands to 8.0 MiB (" : archive + ": expands to more than ";
    EXPECT_EQ(trace.status().message().rfind(expected, 0), 0u) << trace.status().ToString();
    EXPECT_NE(trace.status().message().find("the limit of 1 MiB for an extracted archive (set "
                                            "KEEL_MAX_ARCHIVE_BYTES to raise it)"),
              std::string::npos)
        << trace.status().ToString();
    EXPECT_EQ(LeftoverFolders(tmp.path()), 0) << "the temporary folder was left behind";
    ExpectNoChildren();
  }
  // Within the limit, the same archive reads (as a table of zeros: refused for what it holds,
  // once extracted).
  ScopedEnvironment raised("KEEL_MAX_ARCHIVE_BYTES", "16M");
  ScratchFolder folder;
  const Result<Trace> trace =
      ReadTrace(WriteArchive(folder, 8 << 20, false), TraceFormat::kSmartMoe);
  ASSERT_FALSE(trace.ok());
  EXPECT_EQ(trace.status().message().find("extracted archive"), std::string::npos)
      << trace.status().ToString();
  EXPECT_NE(trace.status().message().find("table_iter1_rank0.log:1"), std::string::npos)
      << trace.status().ToString();
  EXPECT_EQ(LeftoverFolders(tmp.path()), 0);
  ExpectNoChildren();
}

// monitor.trace_path naming a FIFO: with no reader the recorder fails, naming it, instead of
// blocking the run in open; with a reader the trace goes through it.
TEST(TraceInputLimitsTest, RecordingIntoAFifoNeedsAReader) {
  ScratchFolder folder;
  const std::string fifo = folder.File("trace.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  TraceRecorderOptions options;
  options.path = fifo;
  auto opened = WithinSeconds(kHangSeconds, "TraceRecorder::Open(FIFO)",
                              [&] { return TraceRecorder::Open(options); });
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(opened.status().message(),
            "cannot create trace " + fifo +
                ": a FIFO that no process reads (no reader opened it within 2 s; start its reader "
                "first)");

  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  opened = TraceRecorder::Open(options);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  ASSERT_TRUE((*opened)->Close().ok());
  char buffer[256] = {};
  ASSERT_GT(::read(reader, buffer, sizeof(buffer) - 1), 0);
  EXPECT_EQ(std::string(buffer).rfind("{\"keel_trace\": 1", 0), 0u) << buffer;
  ::close(reader);
}

}  // namespace
}  // namespace keel
