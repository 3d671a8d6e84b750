// Numbers in messages (number_text.h).
#include "common/number_text.h"

#include <charconv>
#include <system_error>

namespace keel {

std::string NumberText(double value) {
  char buffer[64];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return error == std::errc() ? std::string(buffer, end) : std::to_string(value);
}

}  // namespace keel
