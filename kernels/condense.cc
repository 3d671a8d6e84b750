// CPU reference of token condensation: squared norms first, then the leader pass and the
// representative pass of the rule in condense.h, each looking back `window` rows within the bucket.
#include "kernels/condense.h"

#include "keel/condense.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/arguments.h"
#include "kernels/host_device.h"

namespace keel::kernels::cpu {
namespace {

float Element(const void* rows, DType dtype, int64_t at) {
  if (dtype == DType::kFloat32) return static_cast<const float*>(rows)[at];
  return Bf16ToFloat(static_cast<const uint16_t*>(rows)[at]);
}

float Dot(const void* rows, DType dtype, int64_t hidden, int64_t a, int64_t b) {
  float dot = 0.0f;
  for (int64_t h = 0; h < hidden; ++h) {
    const float product =
        Element(rows, dtype, a * hidden + h) * Element(rows, dtype, b * hidden + h);
    dot = dot + product;
  }
  return dot;
}

// Identical rows (bit for bit), or cosine(a, b) >= threshold below 1, with squared[] the rows'
// squared norms. Zero rows match only zero rows. The product of two floats is exact in double,
// and so is the square root of a square.
bool Similar(const void* rows, DType dtype, int64_t hidden, const std::vector<float>& squared,
             int64_t a, int64_t b, float threshold) {
  const size_t row_bytes = static_cast<size_t>(hidden) * DTypeBytes(dtype);
  const auto* base = static_cast<const char*>(rows);
  if (std::memcmp(base + a * row_bytes, base + b * row_bytes, row_bytes) == 0) return true;
  if (threshold >= 1.0f) return false;
  if (squared[a] == 0.0f || squared[b] == 0.0f) return squared[a] == 0.0f && squared[b] == 0.0f;
  const double dot = Dot(rows, dtype, hidden, a, b);
  return dot / std::sqrt(static_cast<double>(squared[a]) * static_cast<double>(squared[b])) >=
         static_cast<double>(threshold);
}

}  // namespace

Status CondenseRows(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                    const int32_t* bucket_begin, int num_buckets, float threshold, int window,
                    int32_t* representative, int32_t* kept) {
  KEEL_RETURN_IF_ERROR(CheckCondenseArguments(rows, num_rows, hidden, dtype, bucket_begin,
                                              num_buckets, threshold, window, representative,
                                              kept));
  for (int b = 0; b < num_buckets; ++b) {
    if (bucket_begin[b] < 0 || bucket_begin[b + 1] < bucket_begin[b] ||
        bucket_begin[b + 1] > num_rows) {
      return InvalidArgument("bucket " + std::to_string(b) + " = rows [" +
                             std::to_string(bucket_begin[b]) + ", " +
                             std::to_string(bucket_begin[b + 1]) + ") is not inside [0, " +
                             std::to_string(num_rows) + ")");
    }
  }
  std::vector<float> squared(num_rows);
  for (int64_t i = 0; i < num_rows; ++i) squared[i] = Dot(rows, dtype, hidden, i, i);
  // Rows outside every bucket are left alone: each is its own representative.
  for (int64_t i = 0; i < num_rows; ++i) representative[i] = static_cast<int32_t>(i);
  std::vector<char> leader(num_rows, 1);
  for (int b = 0; b < num_buckets; ++b) {
    const int64_t begin = bucket_begin[b];
    const int64_t end = bucket_begin[b + 1];
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = std::max(begin, i - window); j < i && leader[i]; ++j) {
        if (Similar(rows, dtype, hidden, squared, i, j, threshold)) leader[i] = 0;
      }
    }
    int32_t bucket_kept = 0;
    for (int64_t i = begin; i < end; ++i) {
      if (!leader[i]) {
        for (int64_t j = std::max(begin, i - window); j < i; ++j) {
          if (leader[j] && Similar(rows, dtype, hidden, squared, i, j, threshold)) {
            representative[i] = static_cast<int32_t>(j);
            break;
          }
        }
      }
      if (representative[i] == i) ++bucket_kept;
    }
    kept[b] = bucket_kept;
  }
  return Status::Ok();
}

Status ExpandCondensed(void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                       const int32_t* representative) {
  KEEL_RETURN_IF_ERROR(CheckExpandArguments(rows, num_rows, hidden, dtype, representative));
  for (int64_t i = 0; i < num_rows; ++i) {
    const int32_t from = representative[i];
    if (from < 0 || from >= num_rows || representative[from] != from) {
      return InvalidArgument("representative[" + std::to_string(i) + "] = " + std::to_string(from) +
                             " is not a row that represents itself");
    }
  }
  const int64_t bytes = hidden * DTypeBytes(dtype);
  auto* base = static_cast<char*>(rows);
  for (int64_t i = 0; i < num_rows; ++i) {
    if (representative[i] != i)
      std::memcpy(base + i * bytes, base + representative[i] * bytes, bytes);
  }
  return Status::Ok();
}

}  // namespace keel::kernels::cpu

namespace keel {

Status CondenseRows(const float* rows, int64_t num_rows, int64_t hidden,
                    const int32_t* bucket_begin, int num_buckets, float threshold, int window,
                    int32_t* representative, int32_t* kept) {
  return kernels::cpu::CondenseRows(rows, num_rows, hidden, kernels::DType::kFloat32, bucket_begin,
                                    num_buckets, threshold, window, representative, kept);
}

}  // namespace keel
