// A small command-line flag parser shared by the `keel` subcommands: `--name value`,
// `--name=value` and boolean `--name`, typed targets with defaults, required flags, and a --help
// text generated from the same table, so a flag cannot exist without its documentation.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "keel/status.hpp"

namespace keel::tools {

enum class FlagRequirement { kOptional, kRequired };

class FlagParser {
 public:
  // `command` is the full command ("keel replay"); `summary` is one paragraph printed under the
  // usage line of the help text.
  FlagParser(std::string command, std::string summary);

  // Registers a flag whose value lands in `*target`; the target's value at registration is the
  // default shown in the help text. `metavar` names the value in the help ("PATH", "N").
  // Targets must outlive Parse.
  void Add(std::string name, std::string metavar, std::string* target, std::string meaning,
           FlagRequirement requirement = FlagRequirement::kOptional);
  void Add(std::string name, std::string metavar, int* target, std::string meaning,
           FlagRequirement requirement = FlagRequirement::kOptional);
  void Add(std::string name, std::string metavar, uint64_t* target, std::string meaning,
           FlagRequirement requirement = FlagRequirement::kOptional);
  void Add(std::string name, std::string metavar, double* target, std::string meaning,
           FlagRequirement requirement = FlagRequirement::kOptional);
  // A boolean flag: `--name` sets it, `--name=true|false|1|0` sets it explicitly.
  void AddBool(std::string name, bool* target, std::string meaning);

  // Text printed after the flag list (e.g. pointers to related commands).
  void SetEpilogue(std::string text) { epilogue_ = std::move(text); }

  // Parses argv[1..argc) (argv[0] is the subcommand's name). `--help` / `-h` stops parsing and
  // sets help_requested(); required flags are then not checked. Errors name the flag and value:
  // an unknown flag, a missing or malformed value, a flag given twice (the second would silently
  // win), a positional argument, a missing required flag.
  Status Parse(int argc, char** argv);

  bool help_requested() const { return help_requested_; }
  // True when the flag appeared on the command line.
  bool IsSet(std::string_view name) const;
  // Usage line, summary, every flag with its meaning and default, then the epilogue.
  std::string HelpText() const;

 private:
  using Target = std::variant<std::string*, int*, uint64_t*, double*, bool*>;
  struct Flag {
    std::string name;
    std::string metavar;
    Target target;
    std::string meaning;
    bool required = false;
    std::string default_text;
    bool set = false;
    std::string given;  // the value as written, once set
  };

  void AddFlag(std::string name, std::string metavar, Target target, std::string meaning,
               bool required);
  Flag* Find(std::string_view name);
  const Flag* Find(std::string_view name) const;
  static Status Assign(Flag& flag, std::string_view value);

  std::string command_;
  std::string summary_;
  std::string epilogue_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
};

// Splits "a, b,c" into {"a", "b", "c"} (surrounding spaces trimmed). An empty item ("a,,b",
// "keel,") is an error naming `flag` and the list as written: it names nothing, and is most likely
// a name left out.
Result<std::vector<std::string>> SplitCommaList(std::string_view text, std::string_view flag);

}  // namespace keel::tools
