// The logger behind common/log.h: a process-wide threshold (atomic) and one mutex around the
// final write, so lines from different threads never interleave.
#include "common/log.h"

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string>

namespace keel {
namespace {

// -1 until the first read, which takes KEEL_LOG_LEVEL from the environment.
std::atomic<int> g_level{-1};

LogLevel LevelFromEnvironment() {
  const char* value = std::getenv("KEEL_LOG_LEVEL");
  if (value == nullptr || *value == '\0') return LogLevel::kInfo;
  Result<LogLevel> level = ParseLogLevel(value);
  if (!level.ok()) {
    std::fprintf(stderr, "[keel W] KEEL_LOG_LEVEL: %s; using info\n",
                 level.status().message().c_str());
    return LogLevel::kInfo;
  }
  return *level;
}

std::mutex& OutputMutex() {
  static std::mutex mutex;
  return mutex;
}

std::string_view BaseName(std::string_view path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

}  // namespace

Result<LogLevel> ParseLogLevel(std::string_view name) {
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "debug") return LogLevel::kDebug;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "warn" || lower == "warning") return LogLevel::kWarn;
  if (lower == "error") return LogLevel::kError;
  if (lower == "off") return LogLevel::kOff;
  return InvalidArgument("'" + std::string(name) +
                         "' is not a log level (must be one of debug, info, warn, error, off)");
}

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
    case LogLevel::kOff:
      return "off";
  }
  return "unknown";
}

LogLevel GetLogLevel() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    // Two threads may both read the environment; they store the same value.
    level = static_cast<int>(LevelFromEnvironment());
    int unset = -1;
    g_level.compare_exchange_strong(unset, level, std::memory_order_relaxed);
    level = g_level.load(std::memory_order_relaxed);
  }
  return static_cast<LogLevel>(level);
}

void SetLogLevel(LogLevel level) {
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

void LogMessage(LogLevel level, const char* file, int line, const char* format, ...) {
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E', 'O'};

  auto now = std::chrono::system_clock::now();
  std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  int millis = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm local{};
  localtime_r(&seconds, &local);

  char prefix[160];
  std::string_view base = BaseName(file);
  std::snprintf(prefix, sizeof(prefix), "[keel %c %02d:%02d:%02d.%03d %.*s:%d] ",
                kLetters[static_cast<int>(level)], local.tm_hour, local.tm_min, local.tm_sec,
                millis, static_cast<int>(base.size()), base.data(), line);

  std::va_list args;
  va_start(args, format);
  std::va_list args_copy;
  va_copy(args_copy, args);
  int length = std::vsnprintf(nullptr, 0, format, args_copy);
  va_end(args_copy);
  std::string text(prefix);
  if (length > 0) {
    size_t start = text.size();
    text.resize(start + static_cast<size_t>(length) + 1);
    std::vsnprintf(text.data() + start, static_cast<size_t>(length) + 1, format, args);
    text.resize(start + static_cast<size_t>(length));
  }
  va_end(args);
  text += '\n';

  std::lock_guard<std::mutex> lock(OutputMutex());
  std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace keel
