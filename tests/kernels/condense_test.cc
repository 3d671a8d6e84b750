// CPU reference of token condensation: exact and near duplicates are found within a bucket and
// a window, a row's representative is always a kept leader similar to it, and expanding copies
// the representatives' outputs back.
#include "kernels/condense.h"

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/host_device.h"

namespace keel::kernels {
namespace {

// Rows built from a few random directions: row i = direction[pattern[i]] * scale, plus noise.
std::vector<float> RowsFrom(const std::vector<int>& pattern, int64_t hidden, float noise,
                            int seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int directions = 0;
  for (int p : pattern) directions = std::max(directions, p + 1);
  std::vector<float> base(directions * hidden);
  for (float& x : base) x = normal(rng);
  std::vector<float> rows;
  for (int p : pattern) {
    const float scale = 0.5f + static_cast<float>(rng() % 4);  // cosine ignores scale
    for (int64_t h = 0; h < hidden; ++h)
      rows.push_back(scale * base[p * hidden + h] + noise * normal(rng));
  }
  return rows;
}

TEST(CondenseTest, FindsDuplicatesWithinABucket) {
  // Bucket 0 = rows 0..5, bucket 1 = rows 6..8. Row 6 repeats row 0's direction but in another
  // bucket, so it is kept.
  const std::vector<int> pattern{0, 1, 0, 2, 1, 0, 0, 3, 0};
  const int64_t hidden = 64;
  const std::vector<float> rows = RowsFrom(pattern, hidden, 0.001f, 1);
  const std::vector<int32_t> begin{0, 6, 9};
  std::vector<int32_t> rep(9, -5), kept(2, -5);
  ASSERT_TRUE(cpu::CondenseRows(rows.data(), 9, hidden, DType::kFloat32, begin.data(), 2, 0.99f, 32,
                                rep.data(), kept.data())
                  .ok());
  EXPECT_EQ(rep, (std::vector<int32_t>{0, 1, 0, 3, 1, 0, 6, 7, 6}));
  EXPECT_EQ(kept, (std::vector<int32_t>{3, 2}));
}

TEST(CondenseTest, ThresholdOneCondensesExactlyTheIdenticalRows) {
  // Random rows, each repeated exactly or with one element one bf16 step away (a cosine that
  // rounds to 1 in float32), in every dtype: at threshold 1.0 every exact repeat is condensed
  // and no changed row is.
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const int64_t hidden : {3, 16, 61, 256}) {
      const int rows = 200;
      std::vector<float> values(rows * hidden);
      std::vector<int> copy_of(rows, -1);  // the earlier row a row equals, or -1
      std::vector<int> originals;          // rows drawn afresh: always leaders
      for (int i = 0; i < rows; ++i) {
        // A repeat copies an original at most 8 rows back, inside the window of 32.
        int from = -1;
        if (rng() % 2 == 0 && !originals.empty() && originals.back() >= i - 8) {
          from = originals[originals.size() - 1 - rng() % std::min<size_t>(originals.size(), 2)];
          if (from < i - 8) from = originals.back();
        }
        for (int64_t h = 0; h < hidden; ++h) {
          values[i * hidden + h] =
              from >= 0 ? values[from * hidden + h] : Bf16ToFloat(FloatToBf16(uniform(rng)));
        }
        if (from < 0) {
          originals.push_back(i);
        } else if (rng() % 3 == 0) {
          // A near repeat: one element one bf16 step away, exact in both dtypes.
          const uint16_t bits = FloatToBf16(values[i * hidden + hidden / 2]);
          values[i * hidden + hidden / 2] = Bf16ToFloat(static_cast<uint16_t>(bits + 1));
        } else {
          copy_of[i] = from;
        }
      }
      std::vector<uint16_t> bf16(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        bf16[i] = FloatToBf16(values[i]);
        values[i] = Bf16ToFloat(bf16[i]);  // the rows as bf16 holds them
      }
      const void* data = dtype == DType::kFloat32 ? static_cast<const void*>(values.data())
                                                  : static_cast<const void*>(bf16.data());
      const std::vector<int32_t> begin{0, rows};
      std::vector<int32_t> rep(rows), kept(1);
      ASSERT_TRUE(cpu::CondenseRows(data, rows, hidden, dtype, begin.data(), 1, 1.0f, 32,
                                    rep.data(), kept.data())
                      .ok());
      for (int i = 0; i < rows; ++i) {
        SCOPED_TRACE("hidden " + std::to_string(hidden) + " row " + std::to_string(i));
        if (rep[i] != i) {
          // Only identical rows are condensed.
          for (int64_t h = 0; h < hidden; ++h) {
            ASSERT_EQ(values[i * hidden + h], values[rep[i] * hidden + h]);
          }
        } else if (copy_of[i] >= 0) {
          // An exact repeat is condensed (onto the first row it equals, a leader).
          ADD_FAILURE() << "identical to row " << copy_of[i] << " but kept";
        }
      }
    }
  }
}

TEST(CondenseTest, LooksBackOnlyWithinTheWindow) {
  const std::vector<int> pattern{0, 1, 2, 3, 0};
  const std::vector<float> rows = RowsFrom(pattern, 32, 0.0f, 2);
  const std::vector<int32_t> begin{0, 5};
  std::vector<int32_t> rep(5), kept(1);
  ASSERT_TRUE(cpu::CondenseRows(rows.data(), 5, 32, DType::kFloat32, begin.data(), 1, 0.95f, 3,
                                rep.data(), kept.data())
                  .ok());
  EXPECT_EQ(rep[4], 4) << "row 0 is 4 rows back, outside a window of 3";
  ASSERT_TRUE(cpu::CondenseRows(rows.data(), 5, 32, DType::kFloat32, begin.data(), 1, 0.95f, 4,
                                rep.data(), kept.data())
                  .ok());
  EXPECT_EQ(rep[4], 0);
  EXPECT_EQ(kept[0], 4);
}

TEST(CondenseTest, ARowSimilarOnlyToANonLeaderIsSentItself) {
  // b = a + d, c = b + d: cos(a, b) and cos(b, c) pass the threshold, cos(a, c) does not.
  // b is not a leader (a is similar), so c cannot be represented by b and is sent itself.
  const int64_t hidden = 2;
  const float angle = 0.3f;  // cos(0.3) = 0.955, cos(0.6) = 0.825
  const std::vector<float> rows{
      1.0f, 0.0f, std::cos(angle), std::sin(angle), std::cos(2 * angle), std::sin(2 * angle)};
  const std::vector<int32_t> begin{0, 3};
  std::vector<int32_t> rep(3), kept(1);
  ASSERT_TRUE(cpu::CondenseRows(rows.data(), 3, hidden, DType::kFloat32, begin.data(), 1, 0.9f, 8,
                                rep.data(), kept.data())
                  .ok());
  EXPECT_EQ(rep, (std::vector<int32_t>{0, 0, 2}));
  EXPECT_EQ(kept[0], 2);
}

TEST(CondenseTest, RandomRowsKeepEveryRepresentativeSimilarAndSent) {
  std::mt19937 rng(9);
  std::vector<int> pattern(400);
  for (int& p : pattern) p = static_cast<int>(rng() % 30);
  const int64_t hidden = 48;
  const std::vector<float> rows = RowsFrom(pattern, hidden, 0.01f, 3);
  std::vector<uint16_t> bf16(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) bf16[i] = FloatToBf16(rows[i]);
  const std::vector<int32_t> begin{0, 90, 90, 250, 400};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const void* data =
        dtype == DType::kFloat32 ? static_cast<const void*>(rows.data()) : bf16.data();
    std::vector<int32_t> rep(400), kept(4);
    ASSERT_TRUE(cpu::CondenseRows(data, 400, hidden, dtype, begin.data(), 4, 0.98f, 16, rep.data(),
                                  kept.data())
                    .ok());
    int total_kept = 0;
    for (int b = 0; b < 4; ++b) {
      for (int i = begin[b]; i < begin[b + 1]; ++i) {
        ASSERT_EQ(rep[rep[i]], rep[i]) << "the representative of " << i << " is not sent";
        ASSERT_GE(rep[i], std::max(begin[b], i - 16));
        ASSERT_LE(rep[i], i);
        // Same direction means similar; different random directions never reach 0.98.
        EXPECT_EQ(pattern[rep[i]], pattern[i]) << "row " << i;
      }
      total_kept += kept[b];
    }
    EXPECT_EQ(kept[1], 0);
    EXPECT_LT(total_kept, 300);  // 30 directions, window 16: most rows have a duplicate near
    // Expanding copies each representative's row to the rows it stands for.
    std::vector<float> out(rows);
    ASSERT_TRUE(cpu::ExpandCondensed(out.data(), 400, hidden, DType::kFloat32, rep.data()).ok());
    for (int i = 0; i < 400; ++i) {
      ASSERT_EQ(out[i * hidden + 5], rows[rep[i] * hidden + 5]);
    }
  }
}

TEST(CondenseTest, ZeroRowsMatchOnlyZeroRows) {
  const std::vector<float> rows{0, 0, 1, 0, 0, 0};
  const std::vector<int32_t> begin{0, 3};
  std::vector<int32_t> rep(3), kept(1);
  ASSERT_TRUE(cpu::CondenseRows(rows.data(), 3, 2, DType::kFloat32, begin.data(), 1, 0.5f, 4,
                                rep.data(), kept.data())
                  .ok());
  EXPECT_EQ(rep, (std::vector<int32_t>{0, 1, 0}));
}

TEST(CondenseTest, RejectsBadArguments) {
  const std::vector<float> rows(4, 1.0f);
  const std::vector<int32_t> begin{0, 3};
  std::vector<int32_t> rep(2), kept(1);
  Status status = cpu::CondenseRows(rows.data(), 2, 2, DType::kFloat32, begin.data(), 1, 0.9f, 4,
                                    rep.data(), kept.data());
  EXPECT_NE(status.message().find("rows [0, 3)"), std::string::npos) << status.message();
  const std::vector<int32_t> ok_begin{0, 2};
  status = cpu::CondenseRows(rows.data(), 2, 2, DType::kFloat32, ok_begin.data(), 1, 1.5f, 4,
                             rep.data(), kept.data());
  EXPECT_NE(status.message().find("threshold = 1.5"), std::string::npos) << status.message();
  status = cpu::CondenseRows(rows.data(), 2, 2, DType::kFloat32, ok_begin.data(), 1, 0.9f, 0,
                             rep.data(), kept.data());
  EXPECT_NE(status.message().find("window = 0"), std::string::npos) << status.message();
  const std::vector<int32_t> chained{0, 0, 1};  // row 2 points at row 1, which is not sent
  std::vector<float> three(6, 1.0f);
  status = cpu::ExpandCondensed(three.data(), 3, 2, DType::kFloat32, chained.data());
  EXPECT_NE(status.message().find("representative[2] = 1"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace keel::kernels
