// Whole-file reads and atomic writes: contents round-trip, failures name the path and leave the
// previous file and no temporary behind. Bounded reads: every kind of input that is not a regular
// file within its limit is refused by name, without blocking; the limits and their overrides.
// Opens for writing that never block. Outputs kept apart from inputs and from each other
// (CheckOutputsApart), and the folders no checkpoint may fill (CheckOutputFolder).
#include "common/file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>

#include "tests/common/test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::ScopedEnvironment;
using testing::WithinSeconds;

// A read must end, with an answer, within this time: a hang guard, never a timing.
constexpr double kHangSeconds = 60;

Result<std::string> BoundedRead(const std::string& path, const ReadOptions& options) {
  return WithinSeconds(kHangSeconds, "ReadFile(" + path + ")",
                       [path, options] { return ReadFile(path, options); });
}

// Everything a descriptor gives until its writers close it.
std::string Drain(int fd) {
  std::string text;
  char buffer[4096];
  ssize_t got = 0;
  while ((got = ::read(fd, buffer, sizeof(buffer))) > 0) text.append(buffer, got);
  return text;
}

class FileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "keel-file-test-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(FileTest, WriteThenReadRoundTrips) {
  const std::string path = (dir_ / "a.txt").string();
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, std::string("second\0line", 11)).ok());
  auto text = ReadFile(path, {});
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, std::string("second\0line", 11));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1)
      << "a temporary file was left behind";
}

TEST_F(FileTest, MissingFileIsNotFoundNamingThePath) {
  const std::string path = (dir_ / "missing.txt").string();
  auto text = ReadFile(path, {});
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), StatusCode::kNotFound);
  EXPECT_NE(text.status().message().find(path), std::string::npos);
}

TEST_F(FileTest, FailedWriteKeepsThePreviousFile) {
  const std::string path = (dir_ / "keep.txt").string();
  ASSERT_TRUE(WriteFileAtomically(path, "previous").ok());
  // A directory where the file should go: the rename fails after the temporary was written.
  const std::string blocked = (dir_ / "blocked").string();
  fs::create_directories(fs::path(blocked) / "inside");
  Status status = WriteFileAtomically(blocked, "new");
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find(blocked), std::string::npos);
  EXPECT_EQ(*ReadFile(path, {}), "previous");
  EXPECT_FALSE(WriteFileAtomically((dir_ / "no" / "such" / "dir.txt").string(), "x").ok());
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 2);
}

// A link to a regular file stays a link, and its target gets the contents.
TEST_F(FileTest, WritesThroughALinkKeepingIt) {
  const fs::path target = dir_ / "target.txt";
  const fs::path link = dir_ / "link.txt";
  ASSERT_TRUE(WriteFileAtomically(target.string(), "old").ok());
  fs::create_symlink(target, link);
  ASSERT_TRUE(WriteFileAtomically(link.string(), "new").ok());
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link)));
  EXPECT_EQ(*ReadFile(target.string(), {}), "new");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 2);
}

// A FIFO is written through, not replaced by a regular file.
TEST_F(FileTest, WritesThroughAFifo) {
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // The reader opens first (without blocking), as `cat FIFO &` would.
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  const Status written = WriteFileAtomically(fifo, "through the pipe");
  ASSERT_TRUE(written.ok()) << written.ToString();
  ASSERT_EQ(::fcntl(reader, F_SETFL, 0), 0);
  EXPECT_EQ(Drain(reader), "through the pipe");
  ::close(reader);
  EXPECT_TRUE(fs::is_fifo(fifo));
}

// A FIFO that no process reads: the write fails, naming it, instead of blocking forever in open.
TEST_F(FileTest, WritingAFifoWithoutAReaderFails) {
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const Status written = WithinSeconds(kHangSeconds, "WriteFileAtomically(FIFO)",
                                       [&] { return WriteFileAtomically(fifo, "nobody reads"); });
  ASSERT_FALSE(written.ok());
  EXPECT_EQ(written.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(written.message(),
            fifo + ": a FIFO that no process reads (no reader opened it within " +
                std::to_string(kFifoReaderWaitSeconds) + " s; start its reader first)");
  Result<Descriptor> fd =
      WithinSeconds(kHangSeconds, "OpenForWriting(FIFO)", [&] { return OpenForWriting(fifo, 0); });
  ASSERT_FALSE(fd.ok());
  EXPECT_NE(fd.status().message().find("a FIFO that no process reads"), std::string::npos);
  // A reader that comes within the wait is found.
  std::thread late_reader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const int reader = ::open(fifo.c_str(), O_RDONLY);
    EXPECT_EQ(Drain(reader), "late");
    ::close(reader);
  });
  EXPECT_TRUE(WriteFileAtomically(fifo, "late").ok());
  late_reader.join();
  EXPECT_TRUE(fs::is_fifo(fifo));
}

// Every input that is not a regular file within its limit is refused by name, with the path, and
// without blocking: the table of what a hostile or careless user might hand a reader.
TEST_F(FileTest, ReadRefusesWhatIsNotARegularFileWithinItsLimit) {
  const std::string fifo = (dir_ / "fifo.yaml").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string sparse = (dir_ / "sparse.yaml").string();
  ASSERT_TRUE(WriteFileAtomically(sparse, "").ok());
  fs::resize_file(sparse, uint64_t{2} << 30);  // 2 GiB, no disk used
  fs::create_symlink("/dev/zero", dir_ / "zero.yaml");
  struct Case {
    const char* name;
    std::string path;
    StatusCode code;
    std::string text;  // what follows "--config 'PATH': "
  };
  const std::string stream_hint =
      ", not a regular file; Keel reads inputs from regular files (set KEEL_ALLOW_STREAMS=1 to "
      "read pipes and devices as streams, up to the same limits)";
  const Case cases[] = {
      {"a FIFO with no writer", fifo, StatusCode::kInvalidArgument,
       "is a FIFO (named pipe)" + stream_hint},
      {"/dev/zero", "/dev/zero", StatusCode::kInvalidArgument,
       "is a character device" + stream_hint},
      {"/dev/urandom", "/dev/urandom", StatusCode::kInvalidArgument,
       "is a character device" + stream_hint},
      {"a link to /dev/zero", (dir_ / "zero.yaml").string(), StatusCode::kInvalidArgument,
       "is a character device" + stream_hint},
      {"a folder", dir_.string(), StatusCode::kInvalidArgument, "is a folder, expected a file"},
      {"a file beyond the limit", sparse, StatusCode::kInvalidArgument,
       "2 GiB is more than the limit of 1 MiB for a config file (set KEEL_MAX_CONFIG_BYTES to "
       "raise it)"},
      {"a missing file", (dir_ / "missing.yaml").string(), StatusCode::kNotFound,
       "cannot open: No such file or directory"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Result<std::string> read =
        BoundedRead(c.path, {.limit = InputLimit::kConfigBytes, .argument = "--config"});
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().code(), c.code);
    EXPECT_EQ(read.status().message(), "--config '" + c.path + "': " + c.text);
  }
  // Without an argument, the message starts with the path.
  const Result<std::string> plain = ReadFile(fifo, {});
  ASSERT_FALSE(plain.ok());
  EXPECT_EQ(plain.status().message().rfind(fifo + ": is a FIFO", 0), 0u)
      << plain.status().ToString();
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 3)
      << "a read left a file behind";
}

// A file whose size, when it was opened, was within the limit, but that gives more once read (a
// file that grows; /proc's files, whose size reads as 0) is cut at the limit and refused.
TEST_F(FileTest, ReadStopsAtTheLimitForAFileThatGrows) {
  ScopedEnvironment limit("KEEL_MAX_CONFIG_BYTES", "100");
  const Result<std::string> read =
      BoundedRead("/proc/self/maps", {.limit = InputLimit::kConfigBytes});
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().message(),
            "/proc/self/maps: grew while it was read, past the limit of 100 bytes for a config "
            "file (set KEEL_MAX_CONFIG_BYTES to raise it)");

  // A file that a writer keeps appending to, from below the limit to past it.
  const std::string growing = (dir_ / "growing.yaml").string();
  ASSERT_TRUE(WriteFileAtomically(growing, "").ok());
  ScopedEnvironment small("KEEL_MAX_CONFIG_BYTES", "1M");
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    const int fd = ::open(growing.c_str(), O_WRONLY | O_APPEND);
    const std::string chunk(4096, 'x');
    for (int i = 0; i < 4096 && !stop; ++i)
      ASSERT_EQ(::write(fd, chunk.data(), chunk.size()), 4096);
    ::close(fd);
  });
  // Read until the file is past the limit: whichever way it is seen (at the open or while read),
  // it is refused, and nothing beyond the limit is held.
  Result<std::string> last = std::string();
  while (last.ok()) {
    last = BoundedRead(growing, {.limit = InputLimit::kConfigBytes});
    if (last.ok()) {
      EXPECT_LE(last->size(), size_t{1} << 20);
    }
  }
  stop = true;
  writer.join();
  EXPECT_NE(last.status().message().find("the limit of 1 MiB for a config file"), std::string::npos)
      << last.status().ToString();
}

// The limits in force: a default per kind, an environment variable that overrides it, and a
// value that is not a size refused by name rather than ignored.
TEST_F(FileTest, LimitsComeFromTheEnvironment) {
  EXPECT_EQ(InputLimits().size(), 7u);
  for (const InputLimitInfo& info : InputLimits()) {
    EXPECT_EQ(&InputLimitOf(info.limit), &info) << info.variable;
    ScopedEnvironment unset(std::string(info.variable), std::nullopt);
    EXPECT_EQ(InputLimitBytes(info.limit).value(), info.default_bytes);
  }
  EXPECT_EQ(InputLimitOf(InputLimit::kConfigBytes).default_bytes, uint64_t{1} << 20);
  const std::string path = (dir_ / "three_kib.yaml").string();
  ASSERT_TRUE(WriteFileAtomically(path, std::string(3072, '#')).ok());
  for (const auto& [value, bytes] : std::vector<std::pair<std::string, uint64_t>>{
           {"2048", 2048}, {"2K", 2048}, {"2k", 2048}, {"3M", 3 << 20}, {"1G", 1 << 30}}) {
    ScopedEnvironment limit("KEEL_MAX_CONFIG_BYTES", value);
    EXPECT_EQ(InputLimitBytes(InputLimit::kConfigBytes).value(), bytes) << value;
    EXPECT_EQ(ReadFile(path, {.limit = InputLimit::kConfigBytes}).ok(), bytes >= 3072) << value;
  }
  {
    ScopedEnvironment limit("KEEL_MAX_CONFIG_BYTES", "2K");
    const Result<std::string> read = ReadFile(path, {.limit = InputLimit::kConfigBytes});
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().message(),
              path +
                  ": 3 KiB is more than the limit of 2 KiB for a config file (set "
                  "KEEL_MAX_CONFIG_BYTES to raise it)");
  }
  for (const std::string bad :
       {"abc", "0", "12X", "-5", "1.5G", "2 K", "99999999999999999999", "99999999999G"}) {
    ScopedEnvironment limit("KEEL_MAX_TRACE_BYTES", bad);
    const Result<uint64_t> bytes = InputLimitBytes(InputLimit::kTraceFileBytes);
    ASSERT_FALSE(bytes.ok()) << bad;
    EXPECT_EQ(bytes.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(bytes.status().message().rfind("KEEL_MAX_TRACE_BYTES='" + bad + "': expected", 0), 0u)
        << bytes.status().ToString();
    const Result<std::string> read = ReadFile(path, {});
    ASSERT_FALSE(read.ok());
    EXPECT_NE(read.status().message().find("KEEL_MAX_TRACE_BYTES='" + bad + "'"),
              std::string::npos);
  }
}

// KEEL_ALLOW_STREAMS=1 reads pipes and devices as streams, within the same limits: an endless
// device is cut at the limit, a FIFO without a writer reads as empty, without blocking.
TEST_F(FileTest, StreamsAreReadWhenAllowedWithinTheLimit) {
  ScopedEnvironment streams("KEEL_ALLOW_STREAMS", "1");
  ScopedEnvironment limit("KEEL_MAX_POOL_BYTES", "1K");
  for (const char* device : {"/dev/zero", "/dev/urandom"}) {
    const Result<std::string> read =
        BoundedRead(device, {.limit = InputLimit::kStrategyPoolBytes, .argument = "--pool"});
    ASSERT_FALSE(read.ok()) << device;
    EXPECT_EQ(read.status().message(),
              "--pool '" + std::string(device) +
                  "': holds more than the limit of 1 KiB for a strategy pool (set "
                  "KEEL_MAX_POOL_BYTES to raise it)");
  }
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const Result<std::string> empty = BoundedRead(fifo, {.limit = InputLimit::kStrategyPoolBytes});
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(*empty, "");
  std::thread writer([&] {
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    ASSERT_EQ(::write(fd, "streamed", 8), 8);
    ::close(fd);
  });
  // The writer may open after the reader looked: read until its text arrives.
  Result<std::string> streamed = std::string();
  while (streamed.ok() && streamed->empty()) {
    streamed = BoundedRead(fifo, {.limit = InputLimit::kStrategyPoolBytes});
  }
  writer.join();
  ASSERT_TRUE(streamed.ok()) << streamed.status().ToString();
  EXPECT_EQ(*streamed, "streamed");
  // Folders stay refused.
  EXPECT_FALSE(ReadFile(dir_.string(), {}).ok());
}

// "-" is stdin where the caller says so (`keel plan --input -`), bounded like any stream.
TEST_F(FileTest, DashIsStdinWhereAskedAndBounded) {
  const int saved = ::dup(STDIN_FILENO);
  ASSERT_GE(saved, 0);
  const auto with_stdin = [&](int fd, const std::function<void()>& read) {
    ASSERT_EQ(::dup2(fd, STDIN_FILENO), STDIN_FILENO);
    ::close(fd);
    read();
    ASSERT_EQ(::dup2(saved, STDIN_FILENO), STDIN_FILENO);
  };
  int pipe_ends[2];
  ASSERT_EQ(::pipe(pipe_ends), 0);
  ASSERT_EQ(::write(pipe_ends[1], "{\"weight\": [[1]]}", 17), 17);
  ::close(pipe_ends[1]);
  with_stdin(pipe_ends[0], [] {
    const Result<std::string> read = BoundedRead(
        "-", {.limit = InputLimit::kPlanInputBytes, .argument = "--input", .dash_is_stdin = true});
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(*read, "{\"weight\": [[1]]}");
  });
  ScopedEnvironment limit("KEEL_MAX_PLAN_INPUT_BYTES", "4K");
  with_stdin(::open("/dev/zero", O_RDONLY), [] {
    const Result<std::string> read = BoundedRead(
        "-", {.limit = InputLimit::kPlanInputBytes, .argument = "--input", .dash_is_stdin = true});
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().message(),
              "--input '-': holds more than the limit of 4 KiB for `keel plan` input (set "
              "KEEL_MAX_PLAN_INPUT_BYTES to raise it)");
  });
  ::close(saved);
  // Elsewhere "-" is a file name like any other.
  const Result<std::string> named = ReadFile("-", {});
  ASSERT_FALSE(named.ok());
  EXPECT_EQ(named.status().code(), StatusCode::kNotFound);
}

// The first line of a file, and an expert file's own bound (the size the caller knows).
TEST_F(FileTest, FirstLineAndAKnownSize) {
  const std::string path = (dir_ / "lines.jsonl").string();
  ASSERT_TRUE(WriteFileAtomically(path, "first line\nsecond\n").ok());
  Result<InputFile> file = InputFile::Open(path, {});
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->ReadFirstLine(1 << 20).value(), "first line");
  Result<InputFile> again = InputFile::Open(path, {});
  EXPECT_EQ(again->ReadFirstLine(5).value(), "first");

  const Result<std::string> known =
      ReadFile(path, {.max_bytes = 10, .subject = "the size of a test file"});
  ASSERT_FALSE(known.ok());
  EXPECT_EQ(known.status().message(),
            path + ": 18 bytes is more than 10 bytes, the size of a test file");
  EXPECT_TRUE(ReadFile(path, {.max_bytes = 18, .subject = "the size of a test file"}).ok());
  EXPECT_EQ(DescribeBytes(1536), "1.5 KiB (1536 bytes)");
  EXPECT_EQ(DescribeBytes(uint64_t{3} << 30), "3 GiB");
  EXPECT_EQ(DescribeBytes(1), "1 byte");
}

TEST_F(FileTest, ReadingAFolderNamesIt) {
  auto text = ReadFile(dir_.string(), {});
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(text.status().message().find("is a folder, expected a file"), std::string::npos);
}

// Every spelling of one file is the same file: the path itself, a link (even a dangling one, whose
// target a write creates), a hard link, `..` through a folder, an absolute path. The message
// names both flags and the output's path.
TEST_F(FileTest, OutputsThatNameAnInputAreRefused) {
  const fs::path input = dir_ / "trace.jsonl";
  ASSERT_TRUE(WriteFileAtomically(input.string(), "x").ok());
  fs::create_symlink(input, dir_ / "link.jsonl");
  fs::create_hard_link(input, dir_ / "hard.jsonl");
  fs::create_directories(dir_ / "sub");
  fs::create_symlink(dir_ / "later.json", dir_ / "dangling.json");
  const std::vector<NamedPath> inputs = {{"--trace", input.string()}, {"--config", ""}};
  for (const fs::path& output :
       {input, dir_ / "link.jsonl", dir_ / "hard.jsonl", dir_ / "sub" / ".." / "trace.jsonl"}) {
    const Status status = CheckOutputsApart(inputs, {{"--report", output.string()}});
    ASSERT_FALSE(status.ok()) << output;
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), "--report '" + output.string() + "' and --trace '" +
                                    input.string() +
                                    "' name the same file: writing --report would replace the "
                                    "input (give --report another path)");
  }
  // Two outputs that do not exist yet, one through a dangling link to the other.
  const Status both = CheckOutputsApart(inputs, {{"--report", (dir_ / "later.json").string()},
                                                 {"--plot", (dir_ / "dangling.json").string()}});
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.message().find("--plot '" + (dir_ / "dangling.json").string() + "' and --report"),
            std::string::npos)
      << both.ToString();
  EXPECT_NE(both.message().find("one output would replace the other"), std::string::npos);
  // Other files, the same name in another folder, stdin, and outputs written through are fine.
  fs::create_directories(dir_ / "other");
  EXPECT_TRUE(CheckOutputsApart({{"--trace", input.string()}, {"--input", "-"}},
                                {{"--report", (dir_ / "other" / "trace.jsonl").string()},
                                 {"--plot", (dir_ / "plot.svg").string()},
                                 {"--output", "-"},
                                 {"--a", "/dev/null"},
                                 {"--b", "/dev/null"},
                                 {"--c", ""}})
                  .ok());
}

// An input folder's files are part of the input; an output that replaces one of them is refused,
// a new file beside them is not. An output that is a folder is refused by name.
TEST_F(FileTest, OutputsInsideAnInputFolderAndFolderOutputs) {
  fs::create_directories(dir_ / "esft");
  ASSERT_TRUE(WriteFileAtomically((dir_ / "esft" / "expert_weights_1.txt").string(), "1").ok());
  const std::vector<NamedPath> inputs = {{"--trace", (dir_ / "esft").string()}};
  const Status inside =
      CheckOutputsApart(inputs, {{"--report", (dir_ / "esft" / "expert_weights_1.txt").string()}});
  ASSERT_FALSE(inside.ok());
  EXPECT_NE(inside.message().find("is a file inside the input folder --trace"), std::string::npos)
      << inside.ToString();
  EXPECT_TRUE(
      CheckOutputsApart(inputs, {{"--report", (dir_ / "esft" / "new.json").string()}}).ok());
  const Status folder = CheckOutputsApart({}, {{"--report", (dir_ / "esft").string()}});
  ASSERT_FALSE(folder.ok());
  EXPECT_EQ(folder.message(),
            "--report '" + (dir_ / "esft").string() + "' is a folder; name a file to write");
}

TEST_F(FileTest, CheckpointFoldersAreNeitherEmptyNorTheRoot) {
  const Status empty = CheckOutputFolder("dir", "");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty.message().find("dir is empty"), std::string::npos);
  fs::create_symlink("/", dir_ / "root");
  for (const std::string& root :
       std::vector<std::string>{"/", "//", "/.", "/tmp/..", "/..", (dir_ / "root").string()}) {
    const Status status = CheckOutputFolder("dir", root);
    ASSERT_FALSE(status.ok()) << root;
    EXPECT_EQ(status.message(),
              "dir '" + root + "' is the filesystem root: name a folder of its own");
  }
  EXPECT_TRUE(CheckOutputFolder("dir", (dir_ / "experts").string()).ok());
  EXPECT_TRUE(CheckOutputFolder("dir", "relative/experts").ok());
}

}  // namespace
}  // namespace keel
