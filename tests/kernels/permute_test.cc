// CPU references of the permutation index, permute / unpermute-combine and their backward:
// exact values on small cases, the stable counting sort on random input, and the backward
// functions checked as adjoints of the forward ones (in double precision).
#include "kernels/permute.h"

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/host_device.h"

namespace keel::kernels {
namespace {

TEST(PermutationIndexTest, GroupsByBucketKeepingEntryOrder) {
  // Slots 0..3 map to buckets 1, 0, 1, 2; entry 3 is unrouted, entry 6 has slot 9 (invalid).
  const std::vector<int32_t> slot{2, 1, 0, -1, 3, 1, 9, 2};
  const std::vector<int32_t> bucket_of_slot{1, 0, 1, 2};
  std::vector<int32_t> position(8, 77), begin(4, 77);
  int32_t invalid = 77;
  ASSERT_TRUE(cpu::PermutationIndex(slot.data(), 8, bucket_of_slot.data(), 4, 3, position.data(),
                                    begin.data(), &invalid)
                  .ok());
  // bucket 0: entries 1, 5; bucket 1: entries 0, 2, 7; bucket 2: entry 4.
  EXPECT_EQ(begin, (std::vector<int32_t>{0, 2, 5, 6}));
  EXPECT_EQ(position, (std::vector<int32_t>{2, 0, 3, -1, 5, 1, -1, 4}));
  EXPECT_EQ(invalid, 1);
}

TEST(PermutationIndexTest, RandomSlotsGiveABijectionSortedStably) {
  std::mt19937 rng(5);
  const int slots = 37, buckets = 11, n = 3001;
  std::vector<int32_t> bucket_of_slot(slots), slot(n);
  for (int32_t& b : bucket_of_slot) b = static_cast<int32_t>(rng() % buckets);
  for (int32_t& s : slot) s = static_cast<int32_t>(rng() % (slots + 1)) - 1;
  std::vector<int32_t> position(n), begin(buckets + 1);
  int32_t invalid = 0;
  ASSERT_TRUE(cpu::PermutationIndex(slot.data(), n, bucket_of_slot.data(), slots, buckets,
                                    position.data(), begin.data(), &invalid)
                  .ok());
  std::vector<int> entry_at(begin[buckets], -1);
  for (int i = 0; i < n; ++i) {
    if (slot[i] < 0) {
      EXPECT_EQ(position[i], -1);
      continue;
    }
    const int b = bucket_of_slot[slot[i]];
    ASSERT_GE(position[i], begin[b]);
    ASSERT_LT(position[i], begin[b + 1]);
    ASSERT_EQ(entry_at[position[i]], -1) << "row " << position[i] << " used twice";
    entry_at[position[i]] = i;
  }
  for (int row = 0; row + 1 < begin[buckets]; ++row) {
    ASSERT_NE(entry_at[row], -1) << "row " << row << " unused";
    const int b = bucket_of_slot[slot[entry_at[row]]];
    if (row + 1 < begin[b + 1]) {
      EXPECT_LT(entry_at[row], entry_at[row + 1]) << "unstable";
    }
  }
}

// Random rows of `dtype`, never all zero, as raw bytes.
std::vector<uint8_t> RandomRows(std::mt19937& rng, int64_t rows, int64_t hidden, DType dtype) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> bytes(rows * hidden * DTypeBytes(dtype));
  for (int64_t i = 0; i < rows * hidden; ++i) {
    const float value = normal(rng) + 0.01f;
    if (dtype == DType::kFloat32) {
      reinterpret_cast<float*>(bytes.data())[i] = value;
    } else {
      reinterpret_cast<uint16_t*>(bytes.data())[i] = FloatToBf16(value);
    }
  }
  return bytes;
}

double At(const std::vector<uint8_t>& bytes, DType dtype, int64_t i) {
  if (dtype == DType::kFloat32) return reinterpret_cast<const float*>(bytes.data())[i];
  return Bf16ToFloat(reinterpret_cast<const uint16_t*>(bytes.data())[i]);
}

double Dot(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, DType dtype) {
  double dot = 0;
  for (size_t i = 0; i < a.size() / DTypeBytes(dtype); ++i)
    dot += At(a, dtype, i) * At(b, dtype, i);
  return dot;
}

// A routing of `tokens` x `top_k` entries onto rows: some entries unrouted.
std::vector<int32_t> RandomPositions(std::mt19937& rng, int64_t tokens, int top_k,
                                     int64_t& num_rows) {
  std::vector<int32_t> position(tokens * top_k, -1);
  std::vector<int64_t> routed;
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    if (rng() % 7 != 0) routed.push_back(i);
  }
  std::shuffle(routed.begin(), routed.end(), rng);
  for (size_t r = 0; r < routed.size(); ++r) position[routed[r]] = static_cast<int32_t>(r);
  num_rows = static_cast<int64_t>(routed.size());
  return position;
}

class PermuteTest : public ::testing::TestWithParam<DType> {};

TEST_P(PermuteTest, ForwardCopiesRowsAndBackwardIsItsAdjoint) {
  const DType dtype = GetParam();
  std::mt19937 rng(17);
  const int64_t tokens = 53, hidden = 13;
  const int top_k = 3;
  int64_t rows = 0;
  const std::vector<int32_t> position = RandomPositions(rng, tokens, top_k, rows);
  const std::vector<uint8_t> in = RandomRows(rng, tokens, hidden, dtype);
  std::vector<uint8_t> out(rows * hidden * DTypeBytes(dtype), 0xff);
  ASSERT_TRUE(
      cpu::Permute(in.data(), tokens, top_k, hidden, dtype, position.data(), out.data(), rows)
          .ok());
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    if (position[i] < 0) continue;
    for (int64_t h = 0; h < hidden; ++h) {
      ASSERT_EQ(At(out, dtype, position[i] * hidden + h), At(in, dtype, (i / top_k) * hidden + h));
    }
  }
  // <Permute(x), g> == <x, PermuteBackward(g)>.
  const std::vector<uint8_t> grad_out = RandomRows(rng, rows, hidden, dtype);
  std::vector<uint8_t> grad_in(tokens * hidden * DTypeBytes(dtype), 0xff);
  ASSERT_TRUE(cpu::PermuteBackward(grad_out.data(), rows, position.data(), tokens, top_k, hidden,
                                   dtype, grad_in.data())
                  .ok());
  const double tolerance = dtype == DType::kFloat32 ? 1e-4 : 5e-2;
  EXPECT_NEAR(Dot(out, grad_out, dtype), Dot(in, grad_in, dtype),
              tolerance * std::abs(Dot(out, grad_out, dtype)) + tolerance);
}

TEST_P(PermuteTest, CombineWeighsRowsAndBackwardGivesBothGradients) {
  const DType dtype = GetParam();
  std::mt19937 rng(23);
  const int64_t tokens = 41, hidden = 9;
  const int top_k = 4;
  int64_t rows = 0;
  const std::vector<int32_t> position = RandomPositions(rng, tokens, top_k, rows);
  const std::vector<uint8_t> expert_rows = RandomRows(rng, rows, hidden, dtype);
  std::vector<float> weights(tokens * top_k);
  for (float& w : weights) w = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng);
  std::vector<uint8_t> out(tokens * hidden * DTypeBytes(dtype), 0xff);
  ASSERT_TRUE(cpu::UnpermuteCombine(expert_rows.data(), rows, position.data(), weights.data(),
                                    tokens, top_k, hidden, dtype, out.data())
                  .ok());
  const double tolerance = dtype == DType::kFloat32 ? 1e-5 : 1e-2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < hidden; ++h) {
      double want = 0;
      for (int k = 0; k < top_k; ++k) {
        const int32_t row = position[t * top_k + k];
        if (row >= 0) want += weights[t * top_k + k] * At(expert_rows, dtype, row * hidden + h);
      }
      ASSERT_NEAR(At(out, dtype, t * hidden + h), want, tolerance * (1 + std::abs(want)));
    }
  }
  // out is linear in rows and in weights: check both gradients against <out, g>.
  const std::vector<uint8_t> grad_out = RandomRows(rng, tokens, hidden, dtype);
  std::vector<uint8_t> grad_rows(rows * hidden * DTypeBytes(dtype), 0xff);
  std::vector<float> grad_weights(tokens * top_k, -7.0f);
  ASSERT_TRUE(cpu::UnpermuteCombineBackward(grad_out.data(), expert_rows.data(), rows,
                                            position.data(), weights.data(), tokens, top_k, hidden,
                                            dtype, grad_rows.data(), grad_weights.data())
                  .ok());
  const double forward = Dot(out, grad_out, dtype);
  EXPECT_NEAR(Dot(expert_rows, grad_rows, dtype), forward, 5 * tolerance * (1 + std::abs(forward)));
  double via_weights = 0;
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    if (position[i] < 0) {
      EXPECT_EQ(grad_weights[i], 0.0f);
    }
    via_weights += weights[i] * grad_weights[i];
  }
  EXPECT_NEAR(via_weights, forward, 5 * tolerance * (1 + std::abs(forward)));
}

INSTANTIATE_TEST_SUITE_P(DTypes, PermuteTest, ::testing::Values(DType::kFloat32, DType::kBFloat16),
                         [](const auto& info) {
                           return info.param == DType::kFloat32 ? "Float32" : "BFloat16";
                         });

TEST(PermuteTest, BackwardOfAnUnroutedTokenIsZero) {
  const std::vector<int32_t> position{-1, -1, 0, 1};  // token 0 unrouted, token 1 twice
  const std::vector<float> grad_out{1.5f, -2.0f, 0.25f, 4.0f};
  std::vector<float> grad_in(4, 9.0f);
  ASSERT_TRUE(cpu::PermuteBackward(grad_out.data(), 2, position.data(), 2, 2, 2, DType::kFloat32,
                                   grad_in.data())
                  .ok());
  EXPECT_EQ(grad_in, (std::vector<float>{0.0f, 0.0f, 1.75f, 2.0f}));
}

TEST(PermuteTest, RejectsAPositionOutsideTheBuffer) {
  const std::vector<int32_t> position{0, 5};
  std::vector<float> in(2), out(2);
  const Status status =
      cpu::Permute(in.data(), 1, 2, 2, DType::kFloat32, position.data(), out.data(), 1);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("position[1] = 5"), std::string::npos) << status.message();
  EXPECT_NE(cpu::Permute(in.data(), 1, 2, 0, DType::kFloat32, position.data(), out.data(), 1)
                .message()
                .find("hidden = 0"),
            std::string::npos);
}

TEST(Bf16Test, RoundsToNearestEvenAndKeepsSpecialValues) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);  // above halfway rounds up
  EXPECT_EQ(FloatToBf16(-INFINITY), 0xff80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(FloatToBf16(3.0e38f), 0x7f62);  // large finite values stay finite
}

}  // namespace
}  // namespace keel::kernels
