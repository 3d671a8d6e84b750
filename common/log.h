// A small leveled logger: one line per message on stderr, safe to call from any thread. The level
// comes from the environment variable KEEL_LOG_LEVEL (debug, info, warn, error, off) or from
// SetLogLevel; messages below it cost one comparison and are never formatted.
#pragma once

#include <string_view>

#include "keel/status.hpp"

namespace keel {

enum class LogLevel { kDebug = 0, kInfo, kWarn, kError, kOff };

// "debug", "info", "warn" (or "warning"), "error", "off"; case-insensitive.
Result<LogLevel> ParseLogLevel(std::string_view name);
std::string_view LogLevelName(LogLevel level);

// The current threshold. Until SetLogLevel is called it is read once from KEEL_LOG_LEVEL, and is
// kInfo when that is unset or not a level name.
LogLevel GetLogLevel();
void SetLogLevel(LogLevel level);
inline bool LogEnabled(LogLevel level) { return level >= GetLogLevel() && level != LogLevel::kOff; }

// Writes "[keel W 12:34:56.789 file.cc:42] message" to stderr as one write, printf-style. Use the
// KEEL_LOG_* macros, which skip formatting when the level is off and add the file and line.
void LogMessage(LogLevel level, const char* file, int line, const char* format, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace keel

#define KEEL_LOG(level, ...)                                      \
  do {                                                            \
    if (::keel::LogEnabled(level)) {                              \
      ::keel::LogMessage(level, __FILE__, __LINE__, __VA_ARGS__); \
    }                                                             \
  } while (0)
#define KEEL_LOG_DEBUG(...) KEEL_LOG(::keel::LogLevel::kDebug, __VA_ARGS__)
#define KEEL_LOG_INFO(...) KEEL_LOG(::keel::LogLevel::kInfo, __VA_ARGS__)
#define KEEL_LOG_WARN(...) KEEL_LOG(::keel::LogLevel::kWarn, __VA_ARGS__)
#define KEEL_LOG_ERROR(...) KEEL_LOG(::keel::LogLevel::kError, __VA_ARGS__)
