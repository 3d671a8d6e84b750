// Token condensation (Luffy): among the rows sent to one expert, near-duplicates (cosine
// similarity at or above a threshold) need to be sent and computed once; their outputs are copied
// back afterwards. Off unless the trainer calls it: exact routing never depends on it.
#pragma once

#include <cstdint>

#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

// The rule, over permuted rows grouped in buckets (kernels/permute.h; e.g. one bucket per slot),
// looking back at most `window` rows within the row's bucket:
//   row i is a leader when no earlier row j in its window has cosine(i, j) >= threshold;
//   representative[i] = i for a leader; otherwise the earliest leader j in i's window with
//   cosine(i, j) >= threshold, or i itself when there is none (i is then sent too).
// So a row's representative is always a row that is sent, and always similar enough to it.
// Similar means identical bit for bit, or (threshold below 1) cosine >= threshold: so threshold
// 1.0 condenses exactly the rows that equal an earlier one, whatever the rounding of a cosine.
// Cosine is dot / sqrt(|a|^2 |b|^2), the three dot products summed in float32 and the rest in
// double. Two zero rows are duplicates, a zero row and a non-zero row are not. Within float32
// rounding of the dot products the GPU and the CPU agree; rows whose similarity lies within
// rounding of the threshold may be classified differently.
// Backward (the rule `keel demo --condense` follows): every row keeps its own output gradient,
// and the expert takes each of them back through its representative's forward (input and
// activation). Weight gradients are then the exact gradients of the condensed forward, and a
// condensed row's input gradient is its representative's Jacobian applied to its own output
// gradient; for identical rows both equal exact training's, bit for bit.
//   rows:           [num_rows, hidden] float32 or bf16
//   bucket_begin:   [num_buckets + 1] int32, bucket b is rows [bucket_begin[b], bucket_begin[b+1])
//   representative: [num_rows] int32, overwritten
//   kept:           [num_buckets] int32, overwritten: rows with representative[i] == i
// threshold is in (0, 1]; window >= 1 (32 is a good start: duplicates in real batches sit close).

namespace cpu {

Status CondenseRows(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                    const int32_t* bucket_begin, int num_buckets, float threshold, int window,
                    int32_t* representative, int32_t* kept);

// After the experts ran on the kept rows: row i = row representative[i] for every row that is not
// its own representative (in place; representatives are never overwritten).
Status ExpandCondensed(void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                       const int32_t* representative);

}  // namespace cpu

namespace gpu {

Status CondenseRows(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                    const int32_t* bucket_begin, int num_buckets, float threshold, int window,
                    int32_t* representative, int32_t* kept, Stream stream);
Status ExpandCondensed(void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                       const int32_t* representative, Stream stream);

}  // namespace gpu
}  // namespace keel::kernels
