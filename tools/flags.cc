// The flag parser behind every `keel` subcommand that takes --flags.
#include "tools/flags.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace keel::tools {
namespace {

std::string FormatDouble(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

// Whether `text` is an integer, whole; `out_of_range` when it is one that Int cannot hold.
template <typename Int>
bool ParseInteger(std::string_view text, Int& out, bool& out_of_range) {
  out_of_range = false;
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  out_of_range = ec == std::errc::result_out_of_range && ptr == end;
  return ec == std::errc() && ptr == end;
}

}  // namespace

FlagParser::FlagParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void FlagParser::AddFlag(std::string name, std::string metavar, Target target, std::string meaning,
                         bool required) {
  Flag flag;
  flag.name = std::move(name);
  flag.metavar = std::move(metavar);
  flag.target = target;
  flag.meaning = std::move(meaning);
  flag.required = required;
  std::visit(
      [&](auto* value) {
        using T = std::remove_pointer_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::string>) {
          flag.default_text = *value;
        } else if constexpr (std::is_same_v<T, bool>) {
          flag.default_text = *value ? "on" : "off";
        } else if constexpr (std::is_same_v<T, double>) {
          flag.default_text = FormatDouble(*value);
        } else {
          flag.default_text = std::to_string(*value);
        }
      },
      target);
  flags_.push_back(std::move(flag));
}

void FlagParser::Add(std::string name, std::string metavar, std::string* target,
                     std::string meaning, FlagRequirement requirement) {
  AddFlag(std::move(name), std::move(metavar), target, std::move(meaning),
          requirement == FlagRequirement::kRequired);
}
void FlagParser::Add(std::string name, std::string metavar, int* target, std::string meaning,
                     FlagRequirement requirement) {
  AddFlag(std::move(name), std::move(metavar), target, std::move(meaning),
          requirement == FlagRequirement::kRequired);
}
void FlagParser::Add(std::string name, std::string metavar, uint64_t* target, std::string meaning,
                     FlagRequirement requirement) {
  AddFlag(std::move(name), std::move(metavar), target, std::move(meaning),
          requirement == FlagRequirement::kRequired);
}
void FlagParser::Add(std::string name, std::string metavar, double* target, std::string meaning,
                     FlagRequirement requirement) {
  AddFlag(std::move(name), std::move(metavar), target, std::move(meaning),
          requirement == FlagRequirement::kRequired);
}
void FlagParser::AddBool(std::string name, bool* target, std::string meaning) {
  AddFlag(std::move(name), "", target, std::move(meaning), false);
}

FlagParser::Flag* FlagParser::Find(std::string_view name) {
  for (Flag& flag : flags_) {
    if (flag.name == name) return &flag;
  }
  return nullptr;
}

const FlagParser::Flag* FlagParser::Find(std::string_view name) const {
  return const_cast<FlagParser*>(this)->Find(name);
}

bool FlagParser::IsSet(std::string_view name) const {
  const Flag* flag = Find(name);
  return flag != nullptr && flag->set;
}

Status FlagParser::Assign(Flag& flag, std::string_view value) {
  const std::string where = "flag --" + flag.name + ": '" + std::string(value) + "' ";
  Status status;
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, std::string>) {
          *target = std::string(value);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (value == "true" || value == "1" || value == "on" || value == "yes") {
            *target = true;
          } else if (value == "false" || value == "0" || value == "off" || value == "no") {
            *target = false;
          } else {
            status = InvalidArgument(where + "is not a boolean (true or false)");
          }
        } else if constexpr (std::is_same_v<T, double>) {
          const std::string text(value);
          char* end = nullptr;
          errno = 0;
          const double parsed = text.empty() ? 0.0 : std::strtod(text.c_str(), &end);
          if (text.empty() || end != text.c_str() + text.size() || errno != 0 ||
              !std::isfinite(parsed)) {
            status = InvalidArgument(where + "is not a finite number");
          } else {
            *target = parsed;
          }
        } else {
          T parsed{};
          bool out_of_range = false;
          if (!ParseInteger(value, parsed, out_of_range)) {
            status = InvalidArgument(
                out_of_range
                    ? where + "is out of range [" + std::to_string(std::numeric_limits<T>::min()) +
                          ", " + std::to_string(std::numeric_limits<T>::max()) + "]"
                    : where + "is not an integer" + (std::is_unsigned_v<T> ? " >= 0" : ""));
          } else {
            *target = parsed;
          }
        }
      },
      flag.target);
  if (status.ok()) {
    flag.set = true;
    flag.given = std::string(value);
  }
  return status;
}

Status FlagParser::Parse(int argc, char** argv) {
  const std::string help_hint = " (see " + command_ + " --help)";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return Status::Ok();
    }
    if (arg.size() < 3 || arg.substr(0, 2) != "--") {
      return InvalidArgument("unexpected argument '" + std::string(arg) + "'" + help_hint);
    }
    const size_t equals = arg.find('=');
    const std::string_view name =
        arg.substr(2, equals == std::string_view::npos ? std::string_view::npos : equals - 2);
    Flag* flag = Find(name);
    if (flag == nullptr) {
      return InvalidArgument("unknown flag --" + std::string(name) + help_hint);
    }
    const bool is_bool = std::holds_alternative<bool*>(flag->target);
    if (flag->set) {
      const std::string_view again = equals != std::string_view::npos ? arg.substr(equals + 1)
                                     : is_bool                        ? "true"
                                     : i + 1 < argc                   ? argv[i + 1]
                                                                      : "";
      return InvalidArgument("flag --" + flag->name + " given twice ('" + flag->given +
                             "', then '" + std::string(again) + "'); give it once" + help_hint);
    }
    if (equals != std::string_view::npos) {
      KEEL_RETURN_IF_ERROR(Assign(*flag, arg.substr(equals + 1)));
    } else if (is_bool) {
      KEEL_RETURN_IF_ERROR(Assign(*flag, "true"));
    } else {
      // A following flag is never taken as a value: `--report --plot x` lacks the report path.
      if (i + 1 >= argc || std::string_view(argv[i + 1]).substr(0, 2) == "--") {
        return InvalidArgument("flag --" + flag->name + " needs a value (" + flag->metavar + ")");
      }
      KEEL_RETURN_IF_ERROR(Assign(*flag, argv[++i]));
    }
  }
  for (const Flag& flag : flags_) {
    if (flag.required && !flag.set) {
      return InvalidArgument("missing required flag --" + flag.name + " " + flag.metavar +
                             help_hint);
    }
  }
  return Status::Ok();
}

std::string FlagParser::HelpText() const {
  std::string text = "Usage: " + command_;
  for (const Flag& flag : flags_) {
    if (flag.required) text += " --" + flag.name + " " + flag.metavar;
  }
  text += " [flags]\n\n" + summary_ + "\n\nFlags:\n";
  std::vector<std::string> heads;
  size_t width = 0;
  for (const Flag& flag : flags_) {
    std::string head = "  --" + flag.name;
    if (!flag.metavar.empty()) head += " " + flag.metavar;
    width = std::max(width, head.size());
    heads.push_back(std::move(head));
  }
  heads.push_back("  --help");
  width = std::min<size_t>(std::max(width, heads.back().size()) + 2, 30);
  // Meanings wrap at 100 columns, continuation lines aligned under the first.
  constexpr size_t kColumns = 100;
  auto line = [&](const std::string& head, const std::string& meaning) {
    text += head;
    if (head.size() + 1 > width) {
      text += "\n" + std::string(width, ' ');
    } else {
      text += std::string(width - head.size(), ' ');
    }
    size_t column = width;
    size_t begin = 0;
    while (begin < meaning.size()) {
      size_t end = meaning.find(' ', begin);
      if (end == std::string::npos) end = meaning.size();
      const size_t length = end - begin;
      if (column > width && column + 1 + length > kColumns) {
        text += "\n" + std::string(width, ' ');
        column = width;
      } else if (column > width) {
        text += ' ';
        ++column;
      }
      text.append(meaning, begin, length);
      column += length;
      begin = end + 1;
    }
    text += "\n";
  };
  for (size_t i = 0; i < flags_.size(); ++i) {
    const Flag& flag = flags_[i];
    std::string meaning = flag.meaning;
    if (flag.required) {
      meaning += " (required)";
    } else if (!flag.default_text.empty()) {
      meaning += " (default: " + flag.default_text + ")";
    }
    line(heads[i], meaning);
  }
  line(heads.back(), "print this help and exit");
  if (!epilogue_.empty()) text += "\n" + epilogue_ + "\n";
  return text;
}

Result<std::vector<std::string>> SplitCommaList(std::string_view text, std::string_view flag) {
  std::vector<std::string> items;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(begin, end - begin);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) {
      return InvalidArgument("--" + std::string(flag) + " '" + std::string(text) + "': item " +
                             std::to_string(items.size() + 1) +
                             " is empty (a comma-separated list of names)");
    }
    items.emplace_back(item);
    begin = end + 1;
  }
  return items;
}

}  // namespace keel::tools
