// CPU reference of the gradient sum: one add per element in the element's type, unaligned
// buffers, int64 sums that wrap, trailing bytes left alone, and argument errors.
#include "kernels/add.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace keel::kernels {
namespace {

TEST(AddIntoTest, AddsFloat32ElementsRoundingEachOnce) {
  std::vector<float> acc = {1.0f, 1e8f, -0.0f, 0.5f};
  const std::vector<float> source = {2.0f, 1.0f, 0.0f, -0.25f};
  ASSERT_TRUE(cpu::AddInto(GradientType::kFloat32, acc.data(), source.data(), 16).ok());
  EXPECT_EQ(acc, (std::vector<float>{3.0f, 1e8f + 1.0f, 0.0f, 0.25f}));
  EXPECT_FALSE(std::signbit(acc[2])) << "-0 + 0 is +0";
}

TEST(AddIntoTest, AddsFloat64AndWrapsInt64) {
  std::vector<double> acc = {1.0, 1e-300};
  const std::vector<double> source = {1e-16, 1e-300};
  ASSERT_TRUE(cpu::AddInto(GradientType::kFloat64, acc.data(), source.data(), 16).ok());
  EXPECT_EQ(acc, (std::vector<double>{1.0 + 1e-16, 2e-300}));

  std::vector<int64_t> fixed = {std::numeric_limits<int64_t>::max(), -5};
  const std::vector<int64_t> more = {1, 7};
  ASSERT_TRUE(cpu::AddInto(GradientType::kFixedInt64, fixed.data(), more.data(), 16).ok());
  EXPECT_EQ(fixed, (std::vector<int64_t>{std::numeric_limits<int64_t>::min(), 2}));
}

TEST(AddIntoTest, UnalignedBuffersAndTrailingBytes) {
  // Two floats at odd offsets, and 3 trailing bytes that are not an element.
  std::vector<unsigned char> acc(1 + 11, 0x77);
  std::vector<unsigned char> source(3 + 11, 0x11);
  const float a[2] = {1.5f, -2.0f};
  const float b[2] = {0.25f, 4.0f};
  std::memcpy(acc.data() + 1, a, sizeof(a));
  std::memcpy(source.data() + 3, b, sizeof(b));
  ASSERT_TRUE(cpu::AddInto(GradientType::kFloat32, acc.data() + 1, source.data() + 3, 11).ok());
  float sum[2];
  std::memcpy(sum, acc.data() + 1, sizeof(sum));
  EXPECT_EQ(sum[0], 1.75f);
  EXPECT_EQ(sum[1], 2.0f);
  for (size_t i = 9; i < acc.size(); ++i) EXPECT_EQ(acc[i], 0x77) << "trailing byte " << i;
}

TEST(AddIntoTest, RejectsNullAndNegativeSizesNamingThem) {
  std::vector<double> acc(2);
  Status status = cpu::AddInto(GradientType::kFloat64, acc.data(), nullptr, 16);
  EXPECT_NE(status.message().find("source is null"), std::string::npos) << status.ToString();
  status = cpu::AddInto(GradientType::kFloat64, acc.data(), acc.data(), -8);
  EXPECT_NE(status.message().find("num_bytes"), std::string::npos) << status.ToString();
  EXPECT_TRUE(cpu::AddInto(GradientType::kFloat64, nullptr, nullptr, 0).ok());
}

}  // namespace
}  // namespace keel::kernels
