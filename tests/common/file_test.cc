// Whole-file reads and atomic writes: contents round-trip, failures name the path and leave the
// previous file and no temporary behind.
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

}  // namespace
}  // namespace keel
