// The subcommands' flag parser: value forms, booleans, errors that name the flag, help text; and
// the progress bar's plain-line mode.
#include "tools/flags.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tools/progress.h"

namespace keel::tools {
namespace {

// argv-style arguments owned by the test.
class Args {
 public:
  Args(std::initializer_list<std::string> args) : storage_(args) {
    for (std::string& arg : storage_) pointers_.push_back(arg.data());
  }
  int argc() const { return static_cast<int>(pointers_.size()); }
  char** argv() { return pointers_.data(); }

 private:
  std::vector<std::string> storage_;
  std::vector<char*> pointers_;
};

struct Values {
  std::string path;
  std::string name = "eplb";
  int repeat = 1;
  uint64_t seed = 7;
  double ratio = 1.5;
  bool quiet = false;
};

FlagParser MakeParser(Values& v) {
  FlagParser flags("keel test", "A test command.");
  flags.Add("path", "FILE", &v.path, "input file", FlagRequirement::kRequired);
  flags.Add("name", "NAME", &v.name, "policy name");
  flags.Add("repeat", "N", &v.repeat, "repetitions");
  flags.Add("seed", "N", &v.seed, "seed");
  flags.Add("ratio", "X", &v.ratio, "a ratio");
  flags.AddBool("quiet", &v.quiet, "no output");
  flags.SetEpilogue("See also: keel config --markdown");
  return flags;
}

TEST(FlagParserTest, ParsesBothValueFormsAndBooleans) {
  Values v;
  FlagParser flags = MakeParser(v);
  Args args{"test", "--path",    "in.json", "--name=keel", "--repeat",
            "5",    "--seed=42", "--ratio", "0.25",        "--quiet"};
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  EXPECT_EQ(v.path, "in.json");
  EXPECT_EQ(v.name, "keel");
  EXPECT_EQ(v.repeat, 5);
  EXPECT_EQ(v.seed, 42u);
  EXPECT_DOUBLE_EQ(v.ratio, 0.25);
  EXPECT_TRUE(v.quiet);
  EXPECT_TRUE(flags.IsSet("repeat"));
  EXPECT_FALSE(flags.help_requested());
}

TEST(FlagParserTest, DefaultsStayWhenFlagsAreAbsent) {
  Values v;
  FlagParser flags = MakeParser(v);
  Args args{"test", "--path=x", "--quiet=false", "--repeat=-3"};
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  EXPECT_EQ(v.name, "eplb");
  EXPECT_EQ(v.repeat, -3);  // negative numbers are values, not flags
  EXPECT_FALSE(v.quiet);
  EXPECT_FALSE(flags.IsSet("name"));
}

TEST(FlagParserTest, ErrorsNameTheFlagAndValue) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--path", "x", "--bogus", "1"}, "unknown flag --bogus"},
      {{"--path"}, "flag --path needs a value"},
      {{"--path", "--quiet"}, "flag --path needs a value"},
      {{"--quiet"}, "missing required flag --path"},
      {{"--path", "x", "--repeat", "many"}, "flag --repeat: 'many' is not an integer"},
      {{"--path", "x", "--seed=-1"}, "flag --seed: '-1' is not an integer >= 0"},
      // Integers beyond the flag's type are out of range, with the type's bounds.
      {{"--path", "x", "--repeat", "3000000000"},
       "flag --repeat: '3000000000' is out of range [-2147483648, 2147483647]"},
      {{"--path", "x", "--seed=18446744073709551616"},
       "flag --seed: '18446744073709551616' is out of range [0, 18446744073709551615]"},
      {{"--path", "x", "--ratio=abc"}, "flag --ratio: 'abc' is not a finite number"},
      {{"--path", "x", "--quiet=maybe"}, "flag --quiet: 'maybe' is not a boolean"},
      {{"--path", "x", "stray"}, "unexpected argument 'stray'"},
      // A second value would silently win over the first.
      {{"--path", "x", "--name", "esp", "--name=parm"},
       "flag --name given twice ('esp', then 'parm'); give it once"},
      {{"--path", "x", "--quiet", "--quiet=false"},
       "flag --quiet given twice ('true', then 'false')"},
      {{"--path", "x", "--path", "y"}, "flag --path given twice ('x', then 'y')"},
  };
  for (const Case& c : cases) {
    Values v;
    FlagParser flags = MakeParser(v);
    std::vector<std::string> storage = {"test"};
    storage.insert(storage.end(), c.args.begin(), c.args.end());
    std::vector<char*> argv;
    for (std::string& s : storage) argv.push_back(s.data());
    const Status status = flags.Parse(static_cast<int>(argv.size()), argv.data());
    ASSERT_FALSE(status.ok()) << c.expected;
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(c.expected), std::string::npos) << status.message();
  }
}

TEST(FlagParserTest, HelpListsEveryFlagWithMeaningAndDefault) {
  Values v;
  FlagParser flags = MakeParser(v);
  Args args{"test", "--help"};
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());  // no required-flag error
  EXPECT_TRUE(flags.help_requested());
  const std::string help = flags.HelpText();
  EXPECT_NE(help.find("Usage: keel test --path FILE [flags]"), std::string::npos) << help;
  EXPECT_NE(help.find("--path FILE"), std::string::npos);
  EXPECT_NE(help.find("input file (required)"), std::string::npos);
  EXPECT_NE(help.find("policy name (default: eplb)"), std::string::npos);
  EXPECT_NE(help.find("repetitions (default: 1)"), std::string::npos);
  EXPECT_NE(help.find("a ratio (default: 1.5)"), std::string::npos);
  EXPECT_NE(help.find("no output (default: off)"), std::string::npos);
  EXPECT_NE(help.find("--help"), std::string::npos);
  EXPECT_NE(help.find("keel config --markdown"), std::string::npos);
}

TEST(FlagParserTest, HelpWrapsLongMeaningsAtOneHundredColumns) {
  FlagParser flags("keel test", "summary");
  std::string path;
  std::string meaning;
  for (int i = 0; i < 40; ++i) meaning += "word" + std::to_string(i) + " ";
  meaning += "last";
  flags.Add("path", "FILE", &path, meaning);
  const std::string help = flags.HelpText();
  size_t begin = 0;
  int lines_with_words = 0;
  while (begin < help.size()) {
    size_t end = help.find('\n', begin);
    if (end == std::string::npos) end = help.size();
    const std::string text = help.substr(begin, end - begin);
    EXPECT_LE(text.size(), 100u) << text;
    if (text.find("word") != std::string::npos) ++lines_with_words;
    begin = end + 1;
  }
  EXPECT_GT(lines_with_words, 2);
  EXPECT_NE(help.find("word39 last"), std::string::npos) << "words lost or reordered";
}

TEST(SplitCommaListTest, TrimsItems) {
  EXPECT_EQ(SplitCommaList("static, eplb ,keel ", "policy").value(),
            (std::vector<std::string>{"static", "eplb", "keel"}));
  EXPECT_EQ(SplitCommaList("keel", "policy").value(), (std::vector<std::string>{"keel"}));
}

// An empty item names nothing: most likely a name left out, never silently dropped.
TEST(SplitCommaListTest, RefusesEmptyItemsByFlag) {
  const std::pair<std::string, std::string> cases[] = {
      {"keel,", "--policy 'keel,': item 2 is empty"},
      {"static,,keel", "--policy 'static,,keel': item 2 is empty"},
      {",keel", "--policy ',keel': item 1 is empty"},
      {" , ", "--policy ' , ': item 1 is empty"},
      {"", "--policy '': item 1 is empty"},
  };
  for (const auto& [text, expected] : cases) {
    const Result<std::vector<std::string>> items = SplitCommaList(text, "policy");
    ASSERT_FALSE(items.ok()) << text;
    EXPECT_EQ(items.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(items.status().message().find(expected), std::string::npos)
        << items.status().message();
  }
}

TEST(ProgressBarTest, PlainLinesAboutEveryTenPercent) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    ProgressBar bar("replay", {"a", "b"}, {100, 100}, file, ProgressBar::Mode::kLines);
    for (int done = 1; done <= 100; ++done) {
      bar.Update(0, done);
      bar.Update(1, done);
    }
    bar.Finish();
    bar.Update(0, 5);  // ignored after Finish
  }
  std::rewind(file);
  std::string text;
  char buffer[256];
  while (std::fgets(buffer, sizeof(buffer), file) != nullptr) text += buffer;
  std::fclose(file);
  const long lines = std::count(text.begin(), text.end(), '\n');
  EXPECT_GE(lines, 9);
  EXPECT_LE(lines, 11);
  EXPECT_NE(text.find("replay 100%"), std::string::npos) << text;
  EXPECT_NE(text.find("a 100% b 100%"), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos);
}

}  // namespace
}  // namespace keel::tools
