// Whole-file reads and atomic writes: contents round-trip, failures name the path and leave the
// previous file and no temporary behind. Outputs kept apart from inputs and from each other
// (CheckOutputsApart), and the folders no checkpoint may fill (CheckOutputFolder).
#include "common/file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

namespace keel {
namespace {

namespace fs = std::filesystem;

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
  auto text = ReadFile(path);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, std::string("second\0line", 11));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1)
      << "a temporary file was left behind";
}

TEST_F(FileTest, MissingFileIsNotFoundNamingThePath) {
  const std::string path = (dir_ / "missing.txt").string();
  auto text = ReadFile(path);
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
  EXPECT_EQ(*ReadFile(path), "previous");
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
  EXPECT_EQ(*ReadFile(target.string()), "new");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 2);
}

// A FIFO is written through, not replaced by a regular file.
TEST_F(FileTest, WritesThroughAFifo) {
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  Result<std::string> read = std::string();
  std::thread reader([&] { read = ReadFile(fifo); });
  const Status written = WriteFileAtomically(fifo, "through the pipe");
  reader.join();
  ASSERT_TRUE(written.ok()) << written.ToString();
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, "through the pipe");
  EXPECT_TRUE(fs::is_fifo(fifo));
}

TEST_F(FileTest, ReadingAFolderNamesIt) {
  auto text = ReadFile(dir_.string());
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
