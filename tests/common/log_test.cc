// Tests of the leveled logger: level names (parsing and printing), the threshold that filters
// messages, and the one-line format that reaches stderr.
#include "common/log.h"

#include <gtest/gtest.h>

#include <cctype>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel {
namespace {

constexpr LogLevel kAllLevels[] = {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn,
                                   LogLevel::kError, LogLevel::kOff};

// One line the logger wrote, "[keel W 12:34:56.789 log_test.cc:42] message", in its parts.
// (Parsed by hand: GCC 12's <regex> trips -Wmaybe-uninitialized in the sanitizer build.)
struct LogLine {
  char letter = 0;
  std::string file;
  int line = 0;
  std::string message;
};

// The lines of `output`, each ending in a newline; nullopt when one is not in the format.
std::optional<std::vector<LogLine>> ParseLogLines(std::string_view output) {
  std::vector<LogLine> lines;
  while (!output.empty()) {
    const size_t end = output.find('\n');
    if (end == std::string_view::npos) return std::nullopt;
    std::string_view text = output.substr(0, end);
    output.remove_prefix(end + 1);
    // "[keel " letter " " HH:MM:SS.mmm " "
    constexpr std::string_view kTime = "00:00:00.000";
    if (text.size() < 8 + kTime.size() || text.substr(0, 6) != "[keel " || text[7] != ' ') {
      return std::nullopt;
    }
    LogLine line;
    line.letter = text[6];
    for (size_t i = 0; i < kTime.size(); ++i) {
      const char c = text[8 + i];
      const bool digit = std::isdigit(static_cast<unsigned char>(c)) != 0;
      if (kTime[i] == '0' ? !digit : c != kTime[i]) return std::nullopt;
    }
    text.remove_prefix(8 + kTime.size());
    const size_t close = text.find("] ");
    const size_t colon = text.rfind(':', close);
    if (text.empty() || text[0] != ' ' || close == std::string_view::npos ||
        colon == std::string_view::npos || colon < 1) {
      return std::nullopt;
    }
    line.file = std::string(text.substr(1, colon - 1));
    const std::string_view number = text.substr(colon + 1, close - colon - 1);
    if (number.empty()) return std::nullopt;
    for (char c : number) {
      if (!std::isdigit(static_cast<unsigned char>(c))) return std::nullopt;
      line.line = line.line * 10 + (c - '0');
    }
    line.message = std::string(text.substr(close + 2));
    lines.push_back(std::move(line));
  }
  return lines;
}

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
  const std::optional<std::vector<LogLine>> lines = ParseLogLines(output);
  ASSERT_TRUE(lines.has_value()) << "stderr: '" << output << "'";
  ASSERT_EQ(lines->size(), 1u) << "stderr: '" << output << "'";
  EXPECT_EQ((*lines)[0].letter, 'W');
  EXPECT_EQ((*lines)[0].file, "log_test.cc");
  EXPECT_EQ((*lines)[0].line, line);
  EXPECT_EQ((*lines)[0].message, "expert 7 moved to rank three");
}

TEST_F(LogLevelTest, EachLevelHasItsLetter) {
  SetLogLevel(LogLevel::kDebug);
  ::testing::internal::CaptureStderr();
  KEEL_LOG_DEBUG("d");
  KEEL_LOG_INFO("i");
  KEEL_LOG_WARN("w");
  KEEL_LOG_ERROR("e");
  const std::string output = ::testing::internal::GetCapturedStderr();
  const std::optional<std::vector<LogLine>> lines = ParseLogLines(output);
  ASSERT_TRUE(lines.has_value()) << "stderr: '" << output << "'";
  std::string letters;
  std::string messages;
  for (const LogLine& line : *lines) {
    letters += line.letter;
    messages += line.message;
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
