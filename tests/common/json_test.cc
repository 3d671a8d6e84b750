// Tests of the strict JSON every reader uses (common/json.h): what nlohmann accepts silently is
// refused with its place (a key twice), and integers are range-checked at their full width with
// the value quoted as written.
#include "common/json.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

namespace keel {
namespace {

TEST(JsonTest, RefusesWhatNlohmannAcceptsSilentlyAndSaysWhere) {
  struct Case {
    const char* text;
    const char* message;
  };
  const Case cases[] = {
      {R"({"step": 0, "step": 5})",
       "key \"step\" appears twice in one object at line 1, column 13"},
      {"{\"a\": 1,\n \"b\": {\"c\": 2,\n  \"c\": 3}}",
       "key \"c\" appears twice in one object at line 3, column 3"},
      {R"([{"x": 1}, {"y": 1, "x": 2, "y": 3}])", "key \"y\" appears twice in one object"},
      {R"({"k\"ey": 1, "k\"ey": 2})",
       "key \"k\"ey\" appears twice in one object at line 1, column 14"},
      {R"({"a": 1} x)", "not valid JSON: [json.exception.parse_error.101] parse error at line 1"},
      {R"({"a": 1e400})", "not valid JSON: [json.exception.out_of_range.406] number overflow"},
      {"{\"a\": \n", "not valid JSON: "},
      {"", "not valid JSON: "},
  };
  for (const Case& c : cases) {
    Result<nlohmann::json> parsed = ParseJson(c.text);
    ASSERT_FALSE(parsed.ok()) << c.text;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(c.message), std::string::npos)
        << c.text << " -> " << parsed.status().message();
  }
  Result<nlohmann::json> syntax = ParseJson("[", "header is not JSON");
  ASSERT_FALSE(syntax.ok());
  EXPECT_EQ(syntax.status().message().rfind("header is not JSON: [json.exception", 0), 0u)
      << syntax.status().message();
}

// Nesting is bounded: kMaxJsonNesting levels read, one more is refused where it starts, and a
// megabyte of '[' is refused at the same place without building anything deeper.
TEST(JsonTest, NestingIsBounded) {
  const auto nested = [](int depth, const std::string& inner) {
    std::string text;
    for (int i = 0; i < depth; ++i) text += i % 2 == 0 ? "[" : "{\"k\": ";
    text += inner;
    for (int i = depth - 1; i >= 0; --i) text += i % 2 == 0 ? "]" : "}";
    return text;
  };
  const Result<nlohmann::json> deepest = ParseJson(nested(kMaxJsonNesting, "1"));
  ASSERT_TRUE(deepest.ok()) << deepest.status().ToString();
  for (const std::string& text :
       {nested(kMaxJsonNesting + 1, "1"), nested(kMaxJsonNesting, "[]"),
        "\n" + std::string(1 << 20, '['), std::string(1 << 19, '[') + std::string(1 << 19, ']')}) {
    const Result<nlohmann::json> parsed = ParseJson(text);
    ASSERT_FALSE(parsed.ok()) << text.substr(0, 80);
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("arrays and objects nest deeper than 64 levels at "
                                             "line "),
              std::string::npos)
        << parsed.status().message();
  }
  const Result<nlohmann::json> placed = ParseJson("\n" + std::string(100, '['));
  ASSERT_FALSE(placed.ok());
  EXPECT_NE(placed.status().message().find("at line 2, column 65"), std::string::npos)
      << placed.status().message();
}

TEST(JsonTest, ReadsWhatIsWellFormedAsNlohmannDoes) {
  const char* texts[] = {
      R"({"a": 1, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}]})",
      R"([18446744073709551615, -9223372036854775808, 1.5e300, 2.0, "x", true, null, {}])",
      R"({"count": 36893488147419103232, "other": -9223372036854775809})",
      R"("just a string")",
      R"({"step": 0, "layers": [[1, 2], [3, 4]]})",
  };
  for (const char* text : texts) {
    Result<nlohmann::json> parsed = ParseJson(text);
    ASSERT_TRUE(parsed.ok()) << text << ": " << parsed.status().ToString();
    EXPECT_EQ(*parsed, nlohmann::json::parse(text)) << text;
  }
}

TEST(JsonTest, IntegersAreCheckedAtFullWidthAndQuotedAsWritten) {
  struct Case {
    const char* text;
    int64_t min;
    int64_t max;
    const char* message;  // empty: accepted
    int64_t value;
  };
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const Case cases[] = {
      {"18446744073709551615", 0, kMax,
       "\"f\" 18446744073709551615 is more than 9223372036854775807", 0},
      {"18446744073709551615", -1, 100, "\"f\" 18446744073709551615 is more than 100", 0},
      {"9223372036854775808", kMin, kMax,
       "\"f\" 9223372036854775808 is more than 9223372036854775807", 0},
      {"2000000000", 1, 1 << 30, "\"f\" 2000000000 is more than 1073741824", 0},
      // Beyond 64 bits nlohmann holds a double; it is out of range, quoted with its digits.
      {"36893488147419103232", 0, kMax,
       "\"f\" 36893488147419103232 is more than 9223372036854775807", 0},
      {"-36893488147419103232", -1, 100, "\"f\" -36893488147419103232 is less than -1", 0},
      {"1e20", 0, 100, "\"f\" 100000000000000000000 is more than 100", 0},
      {"-4", 0, kMax, "\"f\" -4 is negative", 0},
      {"-3", -1, 100, "\"f\" -3 is less than -1", 0},
      {"\"4\"", 0, kMax, "\"f\" must be an integer, got \"4\"", 0},
      {"true", 0, kMax, "\"f\" must be an integer, got true", 0},
      {"4.0", 0, kMax, "\"f\" must be an integer, got 4.0", 0},
      {"1e3", 0, kMax, "\"f\" must be an integer, got 1000.0", 0},
      {"null", 0, kMax, "\"f\" must be an integer, got null", 0},
      {"9223372036854775807", 0, kMax, "", kMax},
      {"-9223372036854775808", kMin, kMax, "", kMin},
      {"-1", -1, 100, "", -1},
      {"100", -1, 100, "", 100},
  };
  for (const Case& c : cases) {
    Result<nlohmann::json> parsed = ParseJson(c.text);
    ASSERT_TRUE(parsed.ok()) << c.text << ": " << parsed.status().ToString();
    Result<int64_t> value = JsonInteger(*parsed, "\"f\"", c.min, c.max);
    if (std::string(c.message).empty()) {
      ASSERT_TRUE(value.ok()) << c.text << ": " << value.status().ToString();
      EXPECT_EQ(*value, c.value) << c.text;
      continue;
    }
    ASSERT_FALSE(value.ok()) << c.text << " read as " << *value;
    EXPECT_EQ(value.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(value.status().message(), c.message) << c.text;
  }
}

}  // namespace
}  // namespace keel
