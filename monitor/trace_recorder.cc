// Incremental Keel trace writer. Unlike WriteKeelTrace (write a temporary file, then rename),
// a live run appends in place: the file must be readable while the run goes on, and a crash
// must keep the steps already written. A crash can cut the last line; the reader reports that
// line as not JSON, naming the file and line, so the cut is never silently replayed.
#include "monitor/trace_recorder.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "common/file.h"

namespace keel {

Result<std::unique_ptr<TraceRecorder>> TraceRecorder::Open(const TraceRecorderOptions& options) {
  if (options.path.empty()) return InvalidArgument("trace recorder: empty path");
  if (options.num_layers < 1 || options.num_experts < 1 || options.num_sources < 0) {
    return InvalidArgument("trace recorder " + options.path + ": bad shape " +
                           std::to_string(options.num_layers) + " layers x " +
                           std::to_string(options.num_experts) + " experts x " +
                           std::to_string(options.num_sources) + " sources");
  }
  if (options.sample_interval_steps < 1) {
    return InvalidArgument("trace recorder " + options.path + ": sample interval " +
                           std::to_string(options.sample_interval_steps) + " must be >= 1");
  }
  Trace shape;
  shape.description = options.description;
  shape.num_layers = options.num_layers;
  shape.num_experts = options.num_experts;
  shape.num_sources = options.num_sources;
  Result<std::string> header = KeelTraceHeaderLine(shape);
  if (!header.ok()) return header.status().WithContext(options.path);

  // A FIFO that no process reads is an error, not a run that hangs before its first step.
  Result<Descriptor> fd = OpenForWriting(options.path, O_CREAT | O_TRUNC);
  // A missing folder, a path without write permission, a FIFO without a reader: the path given
  // is wrong.
  if (!fd.ok()) return InvalidArgument("cannot create trace " + fd.status().message());
  std::FILE* file = ::fdopen(fd->get(), "wb");
  if (file == nullptr) {
    return IoError("cannot open trace " + options.path + ": " + std::strerror(errno));
  }
  fd->Release();  // the FILE owns it now
  std::unique_ptr<TraceRecorder> recorder(new TraceRecorder(options, file));
  recorder->shape_ = std::move(shape);
  if (std::fwrite(header->data(), 1, header->size(), file) != header->size() ||
      std::fflush(file) != 0) {
    return IoError("cannot write trace " + options.path + ": " + std::strerror(errno));
  }
  return recorder;
}

TraceRecorder::TraceRecorder(const TraceRecorderOptions& options, std::FILE* file)
    : options_(options), file_(file) {}

TraceRecorder::~TraceRecorder() { (void)Close(); }

Status TraceRecorder::RecordStep(int64_t step_id, std::span<const double> counts) {
  if (!error_.ok()) return error_;
  if (file_ == nullptr) return FailedPrecondition("trace " + options_.path + " is closed");
  const size_t expected = static_cast<size_t>(shape_.num_layers) * shape_.row_size();
  if (counts.size() != expected) {
    return InvalidArgument("trace " + options_.path + ": step " + std::to_string(step_id) +
                           " has " + std::to_string(counts.size()) + " counts, expected " +
                           std::to_string(expected));
  }
  const bool sampled = steps_offered_ % options_.sample_interval_steps == 0;
  ++steps_offered_;
  if (!sampled) return Status::Ok();
  line_.clear();
  AppendKeelTraceStepLine(shape_, step_id, counts, line_);
  // One flush per step: the OS has every finished step even if the process dies next.
  if (std::fwrite(line_.data(), 1, line_.size(), file_) != line_.size() ||
      std::fflush(file_) != 0) {
    error_ = IoError("cannot write trace " + options_.path + " at step " + std::to_string(step_id) +
                     ": " + std::strerror(errno));
    return error_;
  }
  ++steps_written_;
  return Status::Ok();
}

Status TraceRecorder::Close() {
  if (file_ == nullptr) return error_;
  const int result = std::fclose(file_);
  file_ = nullptr;
  if (result != 0 && error_.ok()) {
    error_ = IoError("cannot close trace " + options_.path + ": " + std::strerror(errno));
  }
  return error_;
}

}  // namespace keel
