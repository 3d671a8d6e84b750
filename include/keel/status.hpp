// Keel's one error model, inside the library and at its C++ API: Status for operations that
// return nothing, Result<T> for those that return a value. Exceptions never cross a module, thread
// or API boundary; the code that first detects an error names the bad field and value.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace keel {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad input: config, trace, API argument
  kNotFound,         // a file, key or name that does not exist
  kIoError,          // reading or writing failed
  kFailedPrecondition,
  kOutOfRange,
  kUnimplemented,
  kInternal,
  kDeadlineExceeded,
  kAborted,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "INVALID_ARGUMENT: num_replicas 10 is not divisible by num_gpus 4".
  std::string ToString() const;

  // Prefixes the message with where it happened ("config.yaml:12: ...").
  Status WithContext(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status IoError(std::string message);
Status FailedPrecondition(std::string message);
Status OutOfRange(std::string message);
Status Unimplemented(std::string message);
Status Internal(std::string message);
Status DeadlineExceeded(std::string message);
Status Aborted(std::string message);

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!status_.ok() && "Result built from an OK status carries no value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace keel

#define KEEL_STATUS_CONCAT_INNER(a, b) a##b
#define KEEL_STATUS_CONCAT(a, b) KEEL_STATUS_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define KEEL_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::keel::Status keel_status_ = (expr);        \
    if (!keel_status_.ok()) return keel_status_; \
  } while (0)

// `KEEL_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a Result or returns its Status.
#define KEEL_ASSIGN_OR_RETURN(lhs, expr) \
  KEEL_ASSIGN_OR_RETURN_IMPL(KEEL_STATUS_CONCAT(keel_result_, __LINE__), lhs, expr)
#define KEEL_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
