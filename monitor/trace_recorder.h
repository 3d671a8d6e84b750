// Records a live run's routing as a Keel trace (docs/traces.md) that `keel replay --trace` reads:
// the header when opened, then one line per sampled step, flushed at once so that a crash loses
// at most the step being written.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>

#include "keel/status.hpp"
#include "monitor/trace.h"

namespace keel {

struct TraceRecorderOptions {
  std::string path;
  std::string description = "recorded by keel";
  int num_layers = 1;
  int num_experts = 1;
  int num_sources = 0;            // > 0: rows are traffic matrices [num_sources * num_experts]
  int sample_interval_steps = 1;  // record the 1st, (n+1)-th, (2n+1)-th ... step offered
};

// Not thread-safe: one writer (the load monitor's thread) owns it.
class TraceRecorder {
 public:
  // Creates (truncates) the file and writes the header. Errors name the path.
  static Result<std::unique_ptr<TraceRecorder>> Open(const TraceRecorderOptions& options);
  ~TraceRecorder();
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // Offers one step: counts [num_layers * row_size] (layer-major, rows as in the trace format).
  // Every sample_interval_steps-th offered step is appended and flushed to the OS. Fails on a
  // size mismatch or a write error (naming the path); the recorder then refuses further steps.
  Status RecordStep(int64_t step_id, std::span<const double> counts);
  // Flushes and closes; later RecordStep calls fail. Called by the destructor too.
  Status Close();

  int64_t steps_offered() const { return steps_offered_; }
  int64_t steps_written() const { return steps_written_; }
  const std::string& path() const { return options_.path; }

 private:
  TraceRecorder(const TraceRecorderOptions& options, std::FILE* file);

  TraceRecorderOptions options_;
  Trace shape_;  // header fields only; no steps
  std::FILE* file_;
  std::string line_;  // reused between steps so a long run does not reallocate
  int64_t steps_offered_ = 0;
  int64_t steps_written_ = 0;
  Status error_;
};

}  // namespace keel
