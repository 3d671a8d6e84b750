// Strict JSON for every reader of Keel's inputs (traces and their importers, `keel plan` input,
// strategy pools, engine state): nlohmann's parser, refusing what it would let through without a
// word, and integers read at their full width before any narrowing.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>

#include "keel/status.hpp"

namespace keel {

// How deep arrays and objects may nest in any JSON input. Keel's formats need 6 levels at most
// (OLMoE's counts); deeper text is refused where it goes past the limit, before it is built, so
// that no reader of the value recurses without bound.
inline constexpr int kMaxJsonNesting = 64;

// `text` as one JSON value. InvalidArgument, naming the line and column in `text`, for what
// nlohmann would accept silently: a key that appears twice in one object (nlohmann keeps the
// last), and nesting deeper than kMaxJsonNesting. A syntax error, text after the value or a number
// beyond a double's range is InvalidArgument "<syntax_error>: <nlohmann's message, which names the
// line and column>". An integer beyond 64 bits is a double, as in nlohmann: a count may be one,
// JsonInteger refuses it.
Result<nlohmann::json> ParseJson(std::string_view text,
                                 std::string_view syntax_error = "not valid JSON");

// `value` as an integer in [min, max], checked at its full width: an unsigned value above
// INT64_MAX is out of range, never wrapped to a negative one, and so is an integer beyond 64 bits
// (held as a double: quoted with the double's digits, the text's for a power of two such as 2^64,
// the nearest double's otherwise). A
// number with a fraction or an exponent within 64 bits, a quoted number and a boolean are not
// integers. Errors start with `name` and quote the value as written:
// `"step" 18446744073709551615 is more than 9223372036854775807`,
// `"num_layers" must be an integer, got "4"`.
Result<int64_t> JsonInteger(const nlohmann::json& value, std::string_view name,
                            int64_t min = std::numeric_limits<int64_t>::min(),
                            int64_t max = std::numeric_limits<int64_t>::max());

}  // namespace keel
