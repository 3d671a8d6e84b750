// The progress bar: one redrawn line on a terminal, sparse plain lines elsewhere.
#include "tools/progress.h"

#include <unistd.h>

#include <algorithm>

namespace keel::tools {
namespace {

constexpr auto kRedrawInterval = std::chrono::milliseconds(100);

}  // namespace

ProgressBar::ProgressBar(std::string label, std::vector<std::string> tasks,
                         std::vector<long> totals, std::FILE* stream, Mode mode)
    : label_(std::move(label)),
      tasks_(std::move(tasks)),
      totals_(std::move(totals)),
      done_(tasks_.size(), 0),
      stream_(stream),
      start_(std::chrono::steady_clock::now()) {
  totals_.resize(tasks_.size(), 0);
  terminal_ = mode == Mode::kTerminal ||
              (mode == Mode::kAuto && stream_ != nullptr && isatty(fileno(stream_)) == 1);
  last_draw_ = start_ - kRedrawInterval;
}

ProgressBar::~ProgressBar() { Finish(); }

std::string ProgressBar::Line() const {
  long done = 0;
  long total = 0;
  for (size_t i = 0; i < tasks_.size(); ++i) {
    done += std::min(done_[i], totals_[i]);
    total += totals_[i];
  }
  const double fraction = total > 0 ? static_cast<double>(done) / total : 1.0;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  char head[96];
  std::snprintf(head, sizeof(head), "%s %3d%% %6.1fs ", label_.c_str(),
                static_cast<int>(fraction * 100), seconds);
  std::string line = head;
  if (terminal_) {
    constexpr int kWidth = 20;
    const int filled = static_cast<int>(fraction * kWidth);
    line += "[" + std::string(filled, '#') + std::string(kWidth - filled, '.') + "] ";
  }
  for (size_t i = 0; i < tasks_.size(); ++i) {
    const int percent =
        totals_[i] > 0 ? static_cast<int>(100 * std::min(done_[i], totals_[i]) / totals_[i]) : 100;
    line += " " + tasks_[i] + " " + std::to_string(percent) + "%";
  }
  return line;
}

void ProgressBar::Update(int task, long done) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_ || stream_ == nullptr || task < 0 || task >= static_cast<int>(tasks_.size())) {
    return;
  }
  done_[task] = done;
  if (terminal_) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_draw_ < kRedrawInterval) return;
    last_draw_ = now;
    // \r returns to the line start, ESC[K clears what a longer previous line left behind.
    std::fprintf(stream_, "\r%s\033[K", Line().c_str());
    std::fflush(stream_);
    return;
  }
  long all_done = 0;
  long all_total = 0;
  for (size_t i = 0; i < tasks_.size(); ++i) {
    all_done += std::min(done_[i], totals_[i]);
    all_total += totals_[i];
  }
  const int decile = all_total > 0 ? static_cast<int>(10 * all_done / all_total) : 10;
  if (decile > last_decile_ && decile < 10) {
    last_decile_ = decile;
    std::fprintf(stream_, "%s\n", Line().c_str());
    std::fflush(stream_);
  }
}

void ProgressBar::Finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (finished_ || stream_ == nullptr) return;
  finished_ = true;
  if (terminal_) {
    std::fprintf(stream_, "\r%s\033[K\n", Line().c_str());
  } else {
    std::fprintf(stream_, "%s\n", Line().c_str());
  }
  std::fflush(stream_);
}

std::string FormatFixed(double value, int decimals) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& row : rows) width[c] = std::max(width[c], row[c].size());
  }
  auto print_row = [&](const std::vector<std::string>& row) {
    for (size_t c = 0; c < row.size(); ++c) {
      if (c == 0) {
        std::printf("%-*s", static_cast<int>(width[c]), row[c].c_str());
      } else {
        std::printf("  %*s", static_cast<int>(width[c]), row[c].c_str());
      }
    }
    std::printf("\n");
  };
  print_row(header);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  std::printf("%s\n", std::string(total - 2, '-').c_str());
  for (const auto& row : rows) print_row(row);
}

}  // namespace keel::tools
