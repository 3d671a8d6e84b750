// Strict JSON (json.h): a SAX handler that builds nlohmann's value as its DOM parser does and
// stops at a repeated key, naming where it is.
#include "common/json.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace keel {
namespace {

using Json = nlohmann::json;

// An iterator over the text that records how far the parser has read, so that what the handler
// refuses can be placed: the parser hands a handler values, never positions.
class TrackedIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackedIterator(const char* at, const char** furthest) : at_(at), furthest_(furthest) {}
  reference operator*() const { return *at_; }
  TrackedIterator& operator++() {
    *furthest_ = ++at_;
    return *this;
  }
  TrackedIterator operator++(int) {
    TrackedIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const TrackedIterator& other) const { return at_ == other.at_; }
  bool operator!=(const TrackedIterator& other) const { return at_ != other.at_; }

 private:
  const char* at_;
  const char** furthest_;
};

// "line 3, column 7" of byte `offset` of `text`, both counted from 1 as nlohmann's messages do.
std::string PlaceOf(std::string_view text, size_t offset) {
  offset = std::min(offset, text.size());
  const std::string_view before = text.substr(0, offset);
  const size_t line = static_cast<size_t>(std::count(before.begin(), before.end(), '\n')) + 1;
  const size_t line_start = before.rfind('\n');
  const size_t column = line_start == std::string_view::npos ? offset + 1 : offset - line_start;
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

// Builds the value as nlohmann's json_sax_dom_parser does (containers on a stack of the values
// being filled, each inside the one below it), checking what that parser does not.
class StrictBuilder {
 public:
  StrictBuilder(std::string_view text, const char* const* furthest)
      : text_(text), furthest_(furthest) {}

  bool null() { return Add(nullptr); }
  bool boolean(bool value) { return Add(value); }
  bool number_integer(Json::number_integer_t value) { return Add(value); }
  bool number_unsigned(Json::number_unsigned_t value) { return Add(value); }
  bool number_float(Json::number_float_t value, const Json::string_t& /*written*/) {
    return Add(value);
  }
  bool string(Json::string_t& value) { return Add(std::move(value)); }
  bool binary(Json::binary_t& /*value*/) { return Refuse("binary value", Offset()); }
  bool start_object(std::size_t /*size*/) {
    if (TooDeep()) return false;
    stack_.push_back(Place(Json::object()));
    return true;
  }
  bool key(Json::string_t& key) {
    if (stack_.back()->contains(key)) {
      return Refuse("key \"" + key + "\" appears twice in one object", KeyStart());
    }
    key_ = std::move(key);
    return true;
  }
  bool end_object() {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t /*size*/) {
    if (TooDeep()) return false;
    stack_.push_back(Place(Json::array()));
    return true;
  }
  bool end_array() {
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const Json::exception& error) {
    syntax_error_ = error.what();  // names the line and column itself
    return false;
  }

  Json& root() { return root_; }
  const std::string& refusal() const { return refusal_; }
  const std::string& syntax_error() const { return syntax_error_; }

 private:
  bool Add(Json value) {
    Place(std::move(value));
    return true;
  }

  // Puts `value` where the parser is (the root, the end of the array being filled, or the object
  // being filled at the last key) and returns where it now lives.
  Json* Place(Json value) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Json& container = *stack_.back();
    if (container.is_array()) {
      container.push_back(std::move(value));
      return &container.back();
    }
    Json& member = container[key_];
    member = std::move(value);
    return &member;
  }

  // Whether the array or object that starts here would nest deeper than the limit (refused).
  bool TooDeep() {
    if (stack_.size() < static_cast<size_t>(kMaxJsonNesting)) return false;
    Refuse("arrays and objects nest deeper than " + std::to_string(kMaxJsonNesting) + " levels",
           Offset() - 1);
    return true;
  }

  bool Refuse(const std::string& what, size_t offset) {
    refusal_ = what + " at " + PlaceOf(text_, offset);
    return false;
  }

  size_t Offset() const { return static_cast<size_t>(*furthest_ - text_.data()); }

  // Where the key the parser just read begins: its closing quote is the last byte read.
  size_t KeyStart() const {
    const size_t close = Offset() - 1;
    for (size_t i = close; i-- > 0;) {
      if (text_[i] != '"') continue;
      size_t backslashes = 0;
      while (backslashes < i && text_[i - 1 - backslashes] == '\\') ++backslashes;
      if (backslashes % 2 == 0) return i;
    }
    return close;
  }

  std::string_view text_;
  const char* const* furthest_;
  Json root_;
  std::vector<Json*> stack_;
  std::string key_;
  std::string refusal_;       // what this handler refused, and where
  std::string syntax_error_;  // nlohmann's message
};

}  // namespace

Result<Json> ParseJson(std::string_view text, std::string_view syntax_error) {
  const char* furthest = text.data();
  StrictBuilder builder(text, &furthest);
  const TrackedIterator begin(text.data(), &furthest);
  const TrackedIterator end(text.data() + text.size(), &furthest);
  if (!Json::sax_parse(begin, end, &builder)) {
    if (!builder.refusal().empty()) return InvalidArgument(builder.refusal());
    return InvalidArgument(std::string(syntax_error) + ": " + builder.syntax_error());
  }
  return std::move(builder.root());
}

Result<int64_t> JsonInteger(const Json& value, std::string_view name, int64_t min, int64_t max) {
  const std::string shown(name);
  auto out_of_range = [&](const std::string& written, bool above) {
    if (above)
      return InvalidArgument(shown + " " + written + " is more than " + std::to_string(max));
    return InvalidArgument(
        shown + " " + written +
        (min == 0 ? std::string(" is negative") : " is less than " + std::to_string(min)));
  };
  if (value.is_number_float()) {
    // nlohmann holds an integer beyond 64 bits as the nearest double. It is out of range
    // whatever the field, and its digits say so better than "must be an integer, got 1e+20".
    const double number = value.get<double>();
    if (std::isfinite(number) && number == std::trunc(number) &&
        std::fabs(number) >= 9223372036854775808.0) {  // 2^63
      char digits[400];
      std::snprintf(digits, sizeof(digits), "%.0f", number);
      return out_of_range(digits, number > 0);
    }
  }
  if (!value.is_number_integer()) {
    return InvalidArgument(shown + " must be an integer, got " + value.dump());
  }
  // An unsigned value above INT64_MAX is above every max; compare it before converting.
  if (value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    return out_of_range(value.dump(), true);
  }
  const int64_t exact = value.get<int64_t>();
  if (exact > max || exact < min) return out_of_range(value.dump(), exact > max);
  return exact;
}

}  // namespace keel
