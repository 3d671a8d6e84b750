// CPU references of permute / unpermute-combine and their backward: plain loops in the order the
// header fixes, so the CUDA kernels can match them bit for bit.
#include "kernels/permute.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/arguments.h"
#include "kernels/host_device.h"

namespace keel::kernels::cpu {
namespace {

// Reads and writes row elements of either dtype as float32.
struct RowAccess {
  DType dtype;
  int64_t hidden;

  float Load(const void* base, int64_t row, int64_t h) const {
    const int64_t at = row * hidden + h;
    if (dtype == DType::kFloat32) return static_cast<const float*>(base)[at];
    return Bf16ToFloat(static_cast<const uint16_t*>(base)[at]);
  }
  void Store(void* base, int64_t row, int64_t h, float value) const {
    const int64_t at = row * hidden + h;
    if (dtype == DType::kFloat32) {
      static_cast<float*>(base)[at] = value;
    } else {
      static_cast<uint16_t*>(base)[at] = FloatToBf16(value);
    }
  }
  void CopyRow(const void* from, int64_t from_row, void* to, int64_t to_row) const {
    const int64_t bytes = hidden * DTypeBytes(dtype);
    std::memcpy(static_cast<char*>(to) + to_row * bytes,
                static_cast<const char*>(from) + from_row * bytes, bytes);
  }
};

// Every position must be -1 or a row of the buffer: a bad index would write out of bounds.
Status CheckPositions(const int32_t* position, int64_t num_entries, int64_t num_rows) {
  for (int64_t i = 0; i < num_entries; ++i) {
    if (position[i] < -1 || position[i] >= num_rows) {
      return InvalidArgument("position[" + std::to_string(i) +
                             "] = " + std::to_string(position[i]) + " is not -1 or a row in [0, " +
                             std::to_string(num_rows) + ")");
    }
  }
  return Status::Ok();
}

// out[t] = sum over k of weights[t, k] * rows[position[t, k]], k ascending, in fp32 without FMA;
// unrouted entries add nothing. Null weights count as 1, which is exact: PermuteBackward.
void CombineRows(const void* rows, const int32_t* position, const float* weights,
                 int64_t num_tokens, int top_k, int64_t hidden, DType dtype, void* out) {
  const RowAccess access{dtype, hidden};
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < top_k; ++k) {
      const int32_t row = position[t * top_k + k];
      if (row < 0) continue;
      const float weight = weights != nullptr ? weights[t * top_k + k] : 1.0f;
      for (int64_t h = 0; h < hidden; ++h) {
        const float product = weight * access.Load(rows, row, h);
        acc[h] = acc[h] + product;
      }
    }
    for (int64_t h = 0; h < hidden; ++h) access.Store(out, t, h, acc[h]);
  }
}

}  // namespace

Status PermutationIndex(const int32_t* slot, int64_t num_entries, const int32_t* bucket_of_slot,
                        int num_slots, int num_buckets, int32_t* position, int32_t* bucket_begin,
                        int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(CheckPermutationIndexArguments(
      slot, num_entries, bucket_of_slot, num_slots, num_buckets, position, bucket_begin, invalid));
  for (int s = 0; s < num_slots; ++s) {
    if (bucket_of_slot[s] < 0 || bucket_of_slot[s] >= num_buckets) {
      return InvalidArgument("bucket_of_slot[" + std::to_string(s) +
                             "] = " + std::to_string(bucket_of_slot[s]) +
                             " is not a bucket in [0, " + std::to_string(num_buckets) + ")");
    }
  }
  std::vector<int64_t> next(num_buckets + 1, 0);
  int32_t bad = 0;
  for (int64_t i = 0; i < num_entries; ++i) {
    if (slot[i] >= 0 && slot[i] < num_slots) {
      ++next[bucket_of_slot[slot[i]] + 1];
    } else if (slot[i] != -1) {
      ++bad;
    }
  }
  for (int b = 0; b < num_buckets; ++b) next[b + 1] += next[b];
  for (int b = 0; b <= num_buckets; ++b) bucket_begin[b] = static_cast<int32_t>(next[b]);
  for (int64_t i = 0; i < num_entries; ++i) {
    const bool routed = slot[i] >= 0 && slot[i] < num_slots;
    position[i] = routed ? static_cast<int32_t>(next[bucket_of_slot[slot[i]]]++) : -1;
  }
  *invalid = bad;
  return Status::Ok();
}

Status Permute(const void* in, int64_t num_tokens, int top_k, int64_t hidden, DType dtype,
               const int32_t* position, void* out, int64_t num_rows) {
  KEEL_RETURN_IF_ERROR(
      CheckPermuteArguments(in, num_tokens, top_k, hidden, dtype, position, out, num_rows));
  KEEL_RETURN_IF_ERROR(CheckPositions(position, num_tokens * top_k, num_rows));
  const RowAccess rows{dtype, hidden};
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    if (position[i] >= 0) rows.CopyRow(in, i / top_k, out, position[i]);
  }
  return Status::Ok();
}

Status PermuteBackward(const void* grad_out, int64_t num_rows, const int32_t* position,
                       int64_t num_tokens, int top_k, int64_t hidden, DType dtype, void* grad_in) {
  KEEL_RETURN_IF_ERROR(CheckPermuteBackwardArguments(grad_out, num_rows, position, num_tokens,
                                                     top_k, hidden, dtype, grad_in));
  KEEL_RETURN_IF_ERROR(CheckPositions(position, num_tokens * top_k, num_rows));
  CombineRows(grad_out, position, nullptr, num_tokens, top_k, hidden, dtype, grad_in);
  return Status::Ok();
}

Status UnpermuteCombine(const void* rows, int64_t num_rows, const int32_t* position,
                        const float* weights, int64_t num_tokens, int top_k, int64_t hidden,
                        DType dtype, void* out) {
  KEEL_RETURN_IF_ERROR(CheckUnpermuteCombineArguments(rows, num_rows, position, weights, num_tokens,
                                                      top_k, hidden, dtype, out));
  KEEL_RETURN_IF_ERROR(CheckPositions(position, num_tokens * top_k, num_rows));
  CombineRows(rows, position, weights, num_tokens, top_k, hidden, dtype, out);
  return Status::Ok();
}

Status UnpermuteCombineBackward(const void* grad_out, const void* rows, int64_t num_rows,
                                const int32_t* position, const float* weights, int64_t num_tokens,
                                int top_k, int64_t hidden, DType dtype, void* grad_rows,
                                float* grad_weights) {
  KEEL_RETURN_IF_ERROR(CheckUnpermuteCombineBackwardArguments(grad_out, rows, num_rows, position,
                                                              weights, num_tokens, top_k, hidden,
                                                              dtype, grad_rows, grad_weights));
  KEEL_RETURN_IF_ERROR(CheckPositions(position, num_tokens * top_k, num_rows));
  const RowAccess access{dtype, hidden};
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < top_k; ++k) {
      const int64_t entry = t * top_k + k;
      const int32_t row = position[entry];
      if (row < 0) {
        grad_weights[entry] = 0.0f;
        continue;
      }
      float dot = 0.0f;
      for (int64_t h = 0; h < hidden; ++h) {
        const float g = access.Load(grad_out, t, h);
        access.Store(grad_rows, row, h, weights[entry] * g);
        const float product = g * access.Load(rows, row, h);
        dot = dot + product;
      }
      grad_weights[entry] = dot;
    }
  }
  return Status::Ok();
}

}  // namespace keel::kernels::cpu
