// Tests of the leveled logger: level names (parsing and printing), the threshold that filters
// messages, and the one-line format that reaches stderr.
#include "common/log.h"

#include <gtest/gtest.h>

#include <regex>
#include <string>

namespace keel {
namespace {

constexpr LogLevel kAllLevels[] = {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn,
                                   LogLevel::kError, LogLevel::kOff};

// The threshold is process-wide; every test that changes it puts back what it found.
class LogLevelTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = GetLogLevel(); }
  void TearDown() override { SetLogLevel(saved_); }

 private:
  LogLevel saved_ = LogLevel::kInfo;
};

TEST(LogTest, ParsesEveryLevelNameInAnyCase) {
  struct Case {
    const char* name;
    LogLevel level;
  };
  const Case cases[] = {
      {"debug", LogLevel::kDebug},  {"info", LogLevel::kInfo},   {"warn", LogLevel::kWarn},
      {"warning", LogLevel::kWarn}, {"error", LogLevel::kError}, {"off", LogLevel::kOff},
      {"DEBUG", LogLevel::kDebug},  {"Info", LogLevel::kInfo},   {"WaRn", LogLevel::kWarn},
      {"WARNING", LogLevel::kWarn}, {"ERROR", LogLevel::kError}, {"Off", LogLevel::kOff},
  };
  for (const Case& c : cases) {
    Result<LogLevel> level = ParseLogLevel(c.name);
    ASSERT_TRUE(level.ok()) << c.name << ": " << level.status().ToString();
    EXPECT_EQ(*level, c.level) << c.name;
  }
}

TEST(LogTest, BadLevelNameIsAnErrorThatNamesTheValue) {
  for (const char* name : {"verbose", "", "inf", "debug ", "2"}) {
    Result<LogLevel> level = ParseLogLevel(name);
    ASSERT_FALSE(level.ok()) << "'" << name << "' parsed";
    EXPECT_EQ(level.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(level.status().message().find("'" + std::string(name) + "'"), std::string::npos)
        << level.status().message();
    // The message lists what would have been accepted.
    for (const char* known : {"debug", "info", "warn", "error", "off"}) {
      EXPECT_NE(level.status().message().find(known), std::string::npos)
          << level.status().message() << " lacks " << known;
    }
  }
}

TEST(LogTest, LevelNamesRoundTrip) {
  for (LogLevel level : kAllLevels) {
    const std::string_view name = LogLevelName(level);
    Result<LogLevel> parsed = ParseLogLevel(name);
    ASSERT_TRUE(parsed.ok()) << name << ": " << parsed.status().ToString();
    EXPECT_EQ(*parsed, level) << name;
  }
  EXPECT_EQ(LogLevelName(LogLevel::kWarn), "warn");
}

TEST_F(LogLevelTest, ThresholdFiltersLowerLevels) {
  for (LogLevel threshold : kAllLevels) {
    SetLogLevel(threshold);
    EXPECT_EQ(GetLogLevel(), threshold);
    for (LogLevel level : kAllLevels) {
      // kOff is a threshold, never a message level: nothing logs "at" off.
      const bool expected = level >= threshold && level != LogLevel::kOff;
      EXPECT_EQ(LogEnabled(level), expected)
          << "threshold " << LogLevelName(threshold) << ", level " << LogLevelName(level);
    }
  }
}

TEST_F(LogLevelTest, EnabledMessageReachesStderrAsOneFormattedLine) {
  SetLogLevel(LogLevel::kWarn);
  ::testing::internal::CaptureStderr();
  KEEL_LOG_INFO("below the threshold %d", 1);
  const int line = __LINE__ + 1;
  KEEL_LOG_WARN("expert %d moved to rank %s", 7, "three");
  const std::string output = ::testing::internal::GetCapturedStderr();

  // "[keel W 12:34:56.789 log_test.cc:42] message\n", and nothing from the info line.
  const std::regex format(R"(\[keel W \d\d:\d\d:\d\d\.\d\d\d log_test\.cc:(\d+)\] (.*)\n)");
  std::smatch match;
  ASSERT_TRUE(std::regex_match(output, match, format)) << "stderr: '" << output << "'";
  EXPECT_EQ(match[1].str(), std::to_string(line));
  EXPECT_EQ(match[2].str(), "expert 7 moved to rank three");
}

TEST_F(LogLevelTest, EachLevelHasItsLetter) {
  SetLogLevel(LogLevel::kDebug);
  ::testing::internal::CaptureStderr();
  KEEL_LOG_DEBUG("d");
  KEEL_LOG_INFO("i");
  KEEL_LOG_WARN("w");
  KEEL_LOG_ERROR("e");
  const std::string output = ::testing::internal::GetCapturedStderr();
  const std::regex line(R"(\[keel ([DIWE]) [^\]]*\] ([a-z])\n)");
  std::string letters;
  std::string messages;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it) {
    letters += (*it)[1].str();
    messages += (*it)[2].str();
  }
  EXPECT_EQ(letters, "DIWE") << "stderr: '" << output << "'";
  EXPECT_EQ(messages, "diwe");
}

TEST_F(LogLevelTest, DisabledMessageIsNeitherWrittenNorFormatted) {
  SetLogLevel(LogLevel::kOff);
  int evaluated = 0;
  ::testing::internal::CaptureStderr();
  KEEL_LOG_ERROR("%d", ++evaluated);
  SetLogLevel(LogLevel::kError);
  KEEL_LOG_WARN("%d", ++evaluated);
  const std::string output = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(output, "");
  EXPECT_EQ(evaluated, 0) << "the arguments of a filtered message were evaluated";
}

}  // namespace
}  // namespace keel
