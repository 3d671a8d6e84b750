// Numbers in messages: the shortest text that reads back as the same double, so that a message
// quotes a value as the file or command line wrote it (1e-300, not std::to_string's 0.000000).
#pragma once

#include <string>

namespace keel {

// "0.1", "1e-300", "2.5e+20", "inf", "nan"; whole numbers without a fraction ("3").
std::string NumberText(double value);

}  // namespace keel
