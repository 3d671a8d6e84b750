// A progress bar on stderr for long-running commands with several concurrent tasks (one per
// policy in `keel replay`). On a terminal it redraws one line at most ~10 times per second; when
// stderr is a file or pipe it prints a plain line every ~10% of the total work instead.
#pragma once

#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace keel::tools {

// `value` with `decimals` digits after the point, for table cells.
std::string FormatFixed(double value, int decimals);

// A summary table on stdout: the first column aligned left (a name), the others right (numbers),
// a rule under the header.
void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows);

class ProgressBar {
 public:
  enum class Mode { kAuto, kTerminal, kLines };

  // `tasks`: one name per task; `totals`: units of work per task (same length). kAuto picks
  // kTerminal when `stream` is a TTY.
  ProgressBar(std::string label, std::vector<std::string> tasks, std::vector<long> totals,
              std::FILE* stream = stderr, Mode mode = Mode::kAuto);
  ~ProgressBar();

  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Records that task `task` has finished `done` units. Safe to call from any thread.
  void Update(int task, long done);
  // Draws the final state once and ends the line; later updates are ignored.
  void Finish();

 private:
  std::string Line() const;  // caller holds mutex_

  std::string label_;
  std::vector<std::string> tasks_;
  std::vector<long> totals_;
  std::vector<long> done_;
  std::FILE* stream_;
  bool terminal_;
  bool finished_ = false;
  int last_decile_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  std::mutex mutex_;
};

}  // namespace keel::tools
