// Tests of keel::Status, keel::Result and the KEEL_RETURN_IF_ERROR / KEEL_ASSIGN_OR_RETURN macros:
// codes, messages, context prefixes and early returns.
#include "keel/status.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace keel {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status status;
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kOk);
  EXPECT_EQ(status.message(), "");
  EXPECT_EQ(status.ToString(), "OK");
  EXPECT_TRUE(Status::Ok().ok());
}

TEST(StatusTest, ConstructorsSetCodeAndMessage) {
  struct Case {
    Status status;
    StatusCode code;
    const char* name;
  };
  const Case cases[] = {
      {InvalidArgument("m"), StatusCode::kInvalidArgument, "INVALID_ARGUMENT"},
      {NotFound("m"), StatusCode::kNotFound, "NOT_FOUND"},
      {IoError("m"), StatusCode::kIoError, "IO_ERROR"},
      {FailedPrecondition("m"), StatusCode::kFailedPrecondition, "FAILED_PRECONDITION"},
      {OutOfRange("m"), StatusCode::kOutOfRange, "OUT_OF_RANGE"},
      {Unimplemented("m"), StatusCode::kUnimplemented, "UNIMPLEMENTED"},
      {Internal("m"), StatusCode::kInternal, "INTERNAL"},
  };
  for (const Case& c : cases) {
    EXPECT_FALSE(c.status.ok()) << c.name;
    EXPECT_EQ(c.status.code(), c.code) << c.name;
    EXPECT_EQ(c.status.message(), "m") << c.name;
    EXPECT_EQ(StatusCodeName(c.code), c.name);
    EXPECT_EQ(c.status.ToString(), std::string(c.name) + ": m");
  }
  EXPECT_EQ(StatusCodeName(StatusCode::kDeadlineExceeded), "DEADLINE_EXCEEDED");
  EXPECT_EQ(StatusCodeName(StatusCode::kAborted), "ABORTED");
}

TEST(StatusTest, WithContextPrefixesErrorsOnly) {
  Status error = InvalidArgument("num_replicas 10 is not divisible by num_gpus 4");
  Status located = error.WithContext("config.yaml:12");
  EXPECT_EQ(located.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(located.message(), "config.yaml:12: num_replicas 10 is not divisible by num_gpus 4");
  // The original is unchanged.
  EXPECT_EQ(error.message(), "num_replicas 10 is not divisible by num_gpus 4");
  EXPECT_TRUE(Status::Ok().WithContext("anywhere").ok());
  EXPECT_EQ(Status::Ok().WithContext("anywhere").message(), "");
}

TEST(ResultTest, HoldsValue) {
  Result<int> result = 42;
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result.status().ok());
  EXPECT_EQ(result.value(), 42);
  EXPECT_EQ(*result, 42);
  *result = 7;
  EXPECT_EQ(result.value(), 7);
}

TEST(ResultTest, HoldsStatus) {
  Result<std::string> result = NotFound("trace.bin: no such file");
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(result.status().message(), "trace.bin: no such file");
}

TEST(ResultTest, ArrowAndMoveOut) {
  Result<std::string> result = std::string("expert");
  EXPECT_EQ(result->size(), 6u);
  std::string taken = std::move(result).value();
  EXPECT_EQ(taken, "expert");

  Result<std::unique_ptr<int>> owner = std::make_unique<int>(5);
  ASSERT_TRUE(owner.ok());
  std::unique_ptr<int> pointer = std::move(owner).value();
  EXPECT_EQ(*pointer, 5);
}

Status FailIf(bool fail) { return fail ? OutOfRange("slot 9 >= 8") : Status::Ok(); }

Status RunTwo(bool fail_first, bool fail_second, int* steps) {
  KEEL_RETURN_IF_ERROR(FailIf(fail_first));
  ++*steps;
  KEEL_RETURN_IF_ERROR(FailIf(fail_second));
  ++*steps;
  return Status::Ok();
}

TEST(MacroTest, ReturnIfErrorStopsAtFirstError) {
  int steps = 0;
  EXPECT_TRUE(RunTwo(false, false, &steps).ok());
  EXPECT_EQ(steps, 2);

  steps = 0;
  Status status = RunTwo(false, true, &steps);
  EXPECT_EQ(status.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(status.message(), "slot 9 >= 8");
  EXPECT_EQ(steps, 1);

  steps = 0;
  EXPECT_FALSE(RunTwo(true, false, &steps).ok());
  EXPECT_EQ(steps, 0);
}

Result<int> Half(int value) {
  if (value % 2 != 0) return InvalidArgument("value " + std::to_string(value) + " is odd");
  return value / 2;
}

Result<int> Quarter(int value) {
  KEEL_ASSIGN_OR_RETURN(int half, Half(value));
  KEEL_ASSIGN_OR_RETURN(int quarter, Half(half));  // two uses in one scope must not collide
  return quarter;
}

TEST(MacroTest, AssignOrReturn) {
  Result<int> quarter = Quarter(12);
  ASSERT_TRUE(quarter.ok());
  EXPECT_EQ(*quarter, 3);

  Result<int> odd = Quarter(6);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().message(), "value 3 is odd");

  Result<int> odd_first = Quarter(5);
  ASSERT_FALSE(odd_first.ok());
  EXPECT_EQ(odd_first.status().message(), "value 5 is odd");
}

Status AssignIntoStatusFunction(int value, int* out) {
  KEEL_ASSIGN_OR_RETURN(*out, Half(value));
  return Status::Ok();
}

TEST(MacroTest, AssignOrReturnToExistingVariableInStatusFunction) {
  int out = -1;
  EXPECT_TRUE(AssignIntoStatusFunction(8, &out).ok());
  EXPECT_EQ(out, 4);
  out = -1;
  EXPECT_EQ(AssignIntoStatusFunction(7, &out).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(out, -1);
}

}  // namespace
}  // namespace keel
