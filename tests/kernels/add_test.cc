// CPU reference of the gradient sum: one add per element in the element's type, unaligned
// buffers, int64 sums that wrap, trailing bytes left alone, and argument errors. bf16 and fp16
// sums: hand-picked bits (ties to even, overflow, NaN, subnormals, signed zeros), the fp16
// conversions on their own, and random sums against an independent double-precision reference.
#include "kernels/add.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/host_device.h"

namespace keel::kernels {
namespace {

// A 16-bit binary float format, described by its numbers only (no bit tricks shared with the
// code under test): bf16 and IEEE binary16.
struct Format {
  const char* name;
  GradientType type;
  int fraction_bits;
  int min_exponent;  // of the normal numbers; the exponent bias is 1 - min_exponent
  int max_exponent;
  uint16_t canonical_nan;
};
constexpr Format kBf16 = {"bf16", GradientType::kBFloat16, 7, -126, 127, 0x7fc0};
constexpr Format kFp16 = {"fp16", GradientType::kFloat16, 10, -14, 15, 0x7e00};

uint16_t ExponentMask(const Format& f) {
  return static_cast<uint16_t>(0x7fff & ~((1u << f.fraction_bits) - 1u));
}

bool IsNan(uint16_t bits, const Format& f) {
  return (bits & ExponentMask(f)) == ExponentMask(f) && (bits & ((1u << f.fraction_bits) - 1u));
}

// The value of `bits`, NaN aside.
double Decode(uint16_t bits, const Format& f) {
  const double sign = (bits & 0x8000u) != 0 ? -1.0 : 1.0;
  const int biased = (bits & 0x7fff) >> f.fraction_bits;
  const int fraction = bits & ((1 << f.fraction_bits) - 1);
  const int all_ones = ExponentMask(f) >> f.fraction_bits;
  if (biased == all_ones) return sign * std::numeric_limits<double>::infinity();
  if (biased == 0) return sign * std::ldexp(fraction, f.min_exponent - f.fraction_bits);
  const int exponent = biased - 1 + f.min_exponent;
  return sign * std::ldexp((1 << f.fraction_bits) + fraction, exponent - f.fraction_bits);
}

// `x` rounded once to the format: to nearest, ties to even (nearbyint in the default rounding
// mode), with gradual underflow below 2^min_exponent and overflow to infinity when the rounded
// magnitude exceeds the largest finite value.
double RoundOnce(double x, const Format& f) {
  if (x == 0 || std::isinf(x)) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const int exponent = std::max(e - 1, f.min_exponent);
  const double quantum = std::ldexp(1.0, exponent - f.fraction_bits);
  const double rounded = std::nearbyint(x / quantum) * quantum;
  const double largest = std::ldexp(2.0 - std::ldexp(1.0, -f.fraction_bits), f.max_exponent);
  if (std::fabs(rounded) > largest) return std::copysign(HUGE_VAL, x);
  return rounded;
}

// The bits of a value of the format (signed zeros and infinities included).
uint16_t Encode(double value, const Format& f) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  const double magnitude = std::fabs(value);
  if (std::isinf(magnitude)) return static_cast<uint16_t>(sign | ExponentMask(f));
  if (magnitude == 0) return sign;
  int e = 0;
  std::frexp(magnitude, &e);
  const int exponent = e - 1;
  if (exponent < f.min_exponent) {
    return static_cast<uint16_t>(
        sign | static_cast<uint16_t>(std::ldexp(magnitude, f.fraction_bits - f.min_exponent)));
  }
  const auto fraction =
      static_cast<uint16_t>(std::ldexp(std::ldexp(magnitude, -exponent) - 1.0, f.fraction_bits));
  const auto biased = static_cast<uint16_t>(exponent - f.min_exponent + 1);
  return static_cast<uint16_t>(sign | (biased << f.fraction_bits) | fraction);
}

// The reference sum: the exact sum of two fp16 values fits a double; for bf16 a double carries
// more than twice bf16's significand plus two bits, so rounding the double sum once more gives
// the exact sum rounded once. A NaN sum is the canonical NaN.
uint16_t ReferenceSum(uint16_t a, uint16_t b, const Format& f) {
  const double sum = Decode(a, f) + Decode(b, f);
  if (IsNan(a, f) || IsNan(b, f) || std::isnan(sum)) return f.canonical_nan;
  return Encode(RoundOnce(sum, f), f);
}

// cpu::AddInto over pairs of bits, one element each.
std::vector<uint16_t> Sums(const Format& f, std::vector<uint16_t> acc,
                           const std::vector<uint16_t>& source) {
  const auto bytes = static_cast<int64_t>(acc.size() * sizeof(uint16_t));
  EXPECT_TRUE(cpu::AddInto(f.type, acc.data(), source.data(), bytes).ok());
  return acc;
}

struct BitCase {
  uint16_t acc;
  uint16_t source;
  uint16_t want;
  const char* why;
};

void ExpectSums(const Format& f, const std::vector<BitCase>& cases) {
  std::vector<uint16_t> acc;
  std::vector<uint16_t> source;
  for (const BitCase& c : cases) {
    acc.push_back(c.acc);
    source.push_back(c.source);
  }
  const std::vector<uint16_t> got = Sums(f, acc, source);
  for (size_t i = 0; i < cases.size(); ++i) {
    const BitCase& c = cases[i];
    EXPECT_EQ(got[i], c.want) << f.name << " " << std::hex << c.acc << " + " << c.source << ": "
                              << c.why;
    // The reference agrees with every hand-picked case.
    EXPECT_EQ(ReferenceSum(c.acc, c.source, f), c.want) << f.name << ": " << c.why;
  }
}

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

TEST(AddIntoTest, Bf16SumsHaveTheExpectedBits) {
  ExpectSums(kBf16, {
                        {0x3f80, 0x3f80, 0x4000, "1 + 1 = 2"},
                        {0x3f80, 0x3b80, 0x3f80, "1 + 2^-8: a tie, to the even 1"},
                        {0x3f81, 0x3b80, 0x3f82, "(1 + 2^-7) + 2^-8: a tie, up to even"},
                        {0x3f80, 0x3b81, 0x3f81, "just above the tie rounds up"},
                        {0x3f80, 0xbb80, 0x3f7f, "1 - 2^-8 is exact below 1"},
                        {0x7f7f, 0x7f7f, 0x7f80, "largest + largest overflows float32: inf"},
                        {0x7f7f, 0x7b00, 0x7f80, "largest + half an ulp: a tie, up to inf"},
                        {0xff7f, 0xfb00, 0xff80, "the same, negative: -inf"},
                        {0x7f7f, 0x7a80, 0x7f7f, "largest + a quarter ulp stays finite"},
                        {0x7f80, 0x3f80, 0x7f80, "inf + 1 = inf"},
                        {0x7f80, 0xff80, 0x7fc0, "inf - inf is the canonical NaN"},
                        {0x7fc1, 0x3f80, 0x7fc0, "a NaN's payload is not passed on"},
                        {0x3f80, 0xffc0, 0x7fc0, "a negative NaN neither"},
                        {0x7f81, 0x0000, 0x7fc0, "a signalling NaN neither"},
                        {0x0001, 0x0001, 0x0002, "subnormals add exactly"},
                        {0x0040, 0x0040, 0x0080, "two subnormals make the smallest normal"},
                        {0x0080, 0x8001, 0x007f, "normal - subnormal = subnormal"},
                        {0x0001, 0x8001, 0x0000, "x - x = +0"},
                        {0x8000, 0x8000, 0x8000, "-0 + -0 = -0"},
                        {0x8000, 0x0000, 0x0000, "-0 + 0 = +0"},
                        {0x3f80, 0xbf80, 0x0000, "1 - 1 = +0"},
                    });
}

TEST(AddIntoTest, Fp16SumsHaveTheExpectedBits) {
  ExpectSums(kFp16, {
                        {0x3c00, 0x3c00, 0x4000, "1 + 1 = 2"},
                        {0x3c00, 0x1000, 0x3c00, "1 + 2^-11: a tie, to the even 1"},
                        {0x3c01, 0x1000, 0x3c02, "(1 + 2^-10) + 2^-11: a tie, up to even"},
                        {0x3c00, 0x1001, 0x3c01, "just above the tie rounds up"},
                        {0x7bff, 0x4c00, 0x7c00, "65504 + 16 = 65520: a tie, up to inf"},
                        {0x7bff, 0x4bff, 0x7bff, "65504 + 15.99 stays 65504"},
                        {0x7bff, 0x7bff, 0x7c00, "65504 + 65504 = inf"},
                        {0xfbff, 0xcc00, 0xfc00, "the same, negative: -inf"},
                        {0x7c00, 0x3c00, 0x7c00, "inf + 1 = inf"},
                        {0x7c00, 0xfc00, 0x7e00, "inf - inf is the canonical NaN"},
                        {0x7e01, 0x3c00, 0x7e00, "a NaN's payload is not passed on"},
                        {0x3c00, 0xfe00, 0x7e00, "a negative NaN neither"},
                        {0x7c01, 0x0000, 0x7e00, "a signalling NaN neither"},
                        {0x0001, 0x0001, 0x0002, "2^-24 + 2^-24: subnormals add exactly"},
                        {0x03ff, 0x0001, 0x0400, "the largest subnormal carries into normal"},
                        {0x0400, 0x8001, 0x03ff, "normal - subnormal = subnormal"},
                        {0x0001, 0x8001, 0x0000, "x - x = +0"},
                        {0x8000, 0x8000, 0x8000, "-0 + -0 = -0"},
                        {0x8000, 0x0000, 0x0000, "-0 + 0 = +0"},
                        {0xbc00, 0x3c00, 0x0000, "-1 + 1 = +0"},
                    });
}

// Every fp16 value widens exactly (NaN keeps its sign and payload) and comes back unchanged.
TEST(Fp16ConversionTest, EveryValueRoundTrips) {
  for (uint32_t i = 0; i <= 0xffff; ++i) {
    const auto bits = static_cast<uint16_t>(i);
    const float value = Fp16ToFloat(bits);
    if (IsNan(bits, kFp16)) {
      ASSERT_TRUE(std::isnan(value)) << std::hex << bits;
      ASSERT_EQ(BitsFromFloat(value) >> 31, static_cast<uint32_t>(bits >> 15)) << std::hex << bits;
      ASSERT_EQ(FloatToFp16(value), bits | 0x0200)
          << "quietened, payload kept: " << std::hex << bits;
      continue;
    }
    ASSERT_EQ(static_cast<double>(value), Decode(bits, kFp16)) << std::hex << bits;
    ASSERT_EQ(std::signbit(value), (bits & 0x8000) != 0) << std::hex << bits;
    ASSERT_EQ(FloatToFp16(value), bits) << std::hex << bits;
  }
}

TEST(Fp16ConversionTest, RoundsToNearestEvenIncludingSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000) << "half the smallest subnormal: to 0";
  EXPECT_EQ(FloatToFp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToFp16(3 * std::ldexp(1.0f, -25)), 0x0002) << "1.5 x 2^-24: a tie, to 2";
  EXPECT_EQ(FloatToFp16(-std::ldexp(1.0f, -26)), 0x8000) << "underflow keeps the sign";
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)), 0x0400)
      << "1023.5 x 2^-24: a tie, up into the smallest normal";
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-1e30f), 0xfc00);
  EXPECT_EQ(FloatToFp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToFp16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::quiet_NaN()) & 0x7e00, 0x7e00);
}

// Random float32 values, over all bits and then concentrated on fp16's range, against the
// double-precision reference (a float32 is exact in a double).
TEST(Fp16ConversionTest, RandomFloatsRoundLikeTheReference) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2'000'000; ++i) {
    auto bits = static_cast<uint32_t>(rng());
    if (i % 2 == 1) {  // exponents 2^-27 .. 2^17
      bits = (bits & 0x807fffffu) | ((100u + static_cast<uint32_t>(rng() % 45)) << 23);
    }
    const float value = FloatFromBits(bits);
    if (std::isnan(value)) continue;
    const uint16_t want = Encode(RoundOnce(value, kFp16), kFp16);
    ASSERT_EQ(FloatToFp16(value), want) << std::hex << "float bits " << bits;
    ASSERT_EQ(FloatToBf16(value), Encode(RoundOnce(value, kBf16), kBf16))
        << std::hex << "float bits " << bits;
  }
}

// Random pairs against the reference: half uniform over all bits (NaN, inf and subnormals
// included), half with operands of nearby magnitude and random signs, where cancellation and
// ties happen.
TEST(AddIntoTest, RandomSixteenBitSumsEqualTheReferenceRoundedOnce) {
  for (const Format& f : {kBf16, kFp16}) {
    const uint64_t seed = std::random_device{}();
    SCOPED_TRACE(std::string(f.name) + " seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    constexpr size_t kCount = 1 << 20;
    std::vector<uint16_t> acc(kCount);
    std::vector<uint16_t> source(kCount);
    // The fraction and the two lowest exponent bits.
    const uint16_t near = static_cast<uint16_t>((1u << (f.fraction_bits + 2)) - 1);
    for (size_t i = 0; i < kCount; ++i) {
      acc[i] = static_cast<uint16_t>(rng());
      const auto draw = static_cast<uint16_t>(rng());
      source[i] =
          i % 2 == 0
              ? draw
              : static_cast<uint16_t>((acc[i] & ~near & 0x7fff) | (draw & near) | (draw & 0x8000));
    }
    const std::vector<uint16_t> got = Sums(f, acc, source);
    size_t mismatches = 0;
    for (size_t i = 0; i < kCount; ++i) {
      const uint16_t want = ReferenceSum(acc[i], source[i], f);
      if (got[i] != want && mismatches++ < 5) {
        ADD_FAILURE() << std::hex << acc[i] << " + " << source[i] << ": want " << want << ", got "
                      << got[i];
      }
    }
    EXPECT_EQ(mismatches, 0u);
  }
}

// The same sources added in the same order give the same bits; in another order they may not,
// which is why the engine fixes the order.
TEST(AddIntoTest, Bf16SumsInAFixedOrderRepeatAndDependOnTheOrder) {
  const std::vector<uint16_t> sources = {0x3f80, 0x3b80, 0x3b80};  // 1, 2^-8, 2^-8
  auto sum_in = [](const std::vector<uint16_t>& order) {
    uint16_t acc = 0;
    for (uint16_t s : order) EXPECT_TRUE(cpu::AddInto(GradientType::kBFloat16, &acc, &s, 2).ok());
    return acc;
  };
  EXPECT_EQ(sum_in(sources), 0x3f80) << "1 + 2^-8 ties to 1, twice";
  EXPECT_EQ(sum_in(sources), 0x3f80);
  EXPECT_EQ(sum_in({0x3b80, 0x3b80, 0x3f80}), 0x3f81) << "2^-7 first, then 1: exact";
}

TEST(AddIntoTest, SixteenBitUnalignedBuffersAndATrailingByte) {
  for (const Format& f : {kBf16, kFp16}) {
    std::vector<unsigned char> acc(1 + 5, 0x77);
    std::vector<unsigned char> source(3 + 5, 0x11);
    const uint16_t one = f.type == GradientType::kBFloat16 ? 0x3f80 : 0x3c00;
    constexpr uint16_t kTwo = 0x4000;  // in both formats
    const uint16_t a[2] = {one, 0x8000};
    const uint16_t b[2] = {one, 0x8000};
    std::memcpy(acc.data() + 1, a, sizeof(a));
    std::memcpy(source.data() + 3, b, sizeof(b));
    ASSERT_TRUE(cpu::AddInto(f.type, acc.data() + 1, source.data() + 3, 5).ok());
    uint16_t sum[2];
    std::memcpy(sum, acc.data() + 1, sizeof(sum));
    EXPECT_EQ(sum[0], kTwo) << f.name;
    EXPECT_EQ(sum[1], 0x8000) << f.name;
    EXPECT_EQ(acc[5], 0x77) << f.name << ": the trailing byte";
  }
}

TEST(AddIntoTest, SixteenBitElementsAreTwoBytes) {
  EXPECT_EQ(GradientElementBytes(GradientType::kBFloat16), 2u);
  EXPECT_EQ(GradientElementBytes(GradientType::kFloat16), 2u);
  EXPECT_EQ(GradientElementBytes(GradientType::kFloat32), 4u);
  EXPECT_EQ(GradientElementBytes(GradientType::kFloat64), 8u);
  EXPECT_EQ(GradientElementBytes(GradientType::kFixedInt64), 8u);
}

}  // namespace
}  // namespace keel::kernels
