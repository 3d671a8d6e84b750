// Permute and unpermute-combine of hidden-state rows around the expert all-to-all: gather each
// token's rows into slot-contiguous send order, and after the experts scatter-add them back
// weighted by the router's top-k weights; both with their backward. float32 or bf16 rows,
// float32 accumulation in a fixed order, so the GPU and the CPU reference give the same bits
// (except UnpermuteCombineBackward's weight gradients, dot products the GPU sums as a tree:
// they repeat bit for bit for the same buffer alignment, which picks the GPU's load width).
#pragma once

#include <cstdint>

#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

// Where each routed entry goes in the send buffer: buckets in ascending order (e.g. bucket =
// destination rank * local slots + local slot, so every rank's rows are contiguous and grouped by
// slot), entries within a bucket in entry order (a stable counting sort).
//   slot:           [num_entries] int32, physical slot per entry or -1 (not routed)
//   bucket_of_slot: [num_slots] int32, each in [0, num_buckets)
//   position:       [num_entries] int32, overwritten: the entry's send-buffer row, or -1
//   bucket_begin:   [num_buckets + 1] int32, overwritten: first row of each bucket; the last
//                   element is the number of rows
//   invalid:        [1] int32, overwritten: entries whose slot is outside [-1, num_slots)
// Rows below: `in`/`out` rows are `hidden` elements of `dtype`; a row of bf16 is uint16_t.
// `position` must map routed entries to distinct rows (PermutationIndex always does); -1 skips.

namespace cpu {

Status PermutationIndex(const int32_t* slot, int64_t num_entries, const int32_t* bucket_of_slot,
                        int num_slots, int num_buckets, int32_t* position, int32_t* bucket_begin,
                        int32_t* invalid);

// out[position[t * top_k + k]] = in[t] for every routed entry.
//   in:  [num_tokens, hidden]    out: [num_rows, hidden]    position: [num_tokens, top_k]
Status Permute(const void* in, int64_t num_tokens, int top_k, int64_t hidden, DType dtype,
               const int32_t* position, void* out, int64_t num_rows);

// Backward of Permute: grad_in[t] = sum over k (ascending) of grad_out[position[t, k]], summed
// in float32 and rounded once; a token with no routed entry gets a zero row.
//   grad_out: [num_rows, hidden]    grad_in: [num_tokens, hidden]
Status PermuteBackward(const void* grad_out, int64_t num_rows, const int32_t* position,
                       int64_t num_tokens, int top_k, int64_t hidden, DType dtype, void* grad_in);

// out[t] = sum over k (ascending) of weights[t, k] * rows[position[t, k]], in float32 (each
// product rounded, then added), rounded to dtype once; unrouted entries add nothing.
//   rows: [num_rows, hidden]    weights: [num_tokens, top_k] float32    out: [num_tokens, hidden]
Status UnpermuteCombine(const void* rows, int64_t num_rows, const int32_t* position,
                        const float* weights, int64_t num_tokens, int top_k, int64_t hidden,
                        DType dtype, void* out);

// Backward of UnpermuteCombine:
//   grad_rows[position[t, k]] = weights[t, k] * grad_out[t]   (rounded to dtype)
//   grad_weights[t, k] = sum over h of grad_out[t, h] * rows[position[t, k], h]  (float32; 0 for
//                        unrouted entries)
//   grad_out: [num_tokens, hidden]    grad_rows: [num_rows, hidden]
//   grad_weights: [num_tokens, top_k] float32
// Rows of grad_rows that no entry maps to are left as they are.
Status UnpermuteCombineBackward(const void* grad_out, const void* rows, int64_t num_rows,
                                const int32_t* position, const float* weights, int64_t num_tokens,
                                int top_k, int64_t hidden, DType dtype, void* grad_rows,
                                float* grad_weights);

}  // namespace cpu

namespace gpu {

// Device pointers, enqueued on `stream`. PermutationIndex needs a device `workspace` of
// PermutationWorkspaceBytes(num_entries, num_buckets) bytes.
int64_t PermutationWorkspaceBytes(int64_t num_entries, int num_buckets);
Status PermutationIndex(const int32_t* slot, int64_t num_entries, const int32_t* bucket_of_slot,
                        int num_slots, int num_buckets, int32_t* position, int32_t* bucket_begin,
                        int32_t* invalid, void* workspace, Stream stream);
Status Permute(const void* in, int64_t num_tokens, int top_k, int64_t hidden, DType dtype,
               const int32_t* position, void* out, int64_t num_rows, Stream stream);
Status PermuteBackward(const void* grad_out, int64_t num_rows, const int32_t* position,
                       int64_t num_tokens, int top_k, int64_t hidden, DType dtype, void* grad_in,
                       Stream stream);
Status UnpermuteCombine(const void* rows, int64_t num_rows, const int32_t* position,
                        const float* weights, int64_t num_tokens, int top_k, int64_t hidden,
                        DType dtype, void* out, Stream stream);
Status UnpermuteCombineBackward(const void* grad_out, const void* rows, int64_t num_rows,
                                const int32_t* position, const float* weights, int64_t num_tokens,
                                int top_k, int64_t hidden, DType dtype, void* grad_rows,
                                float* grad_weights, Stream stream);

}  // namespace gpu
}  // namespace keel::kernels
