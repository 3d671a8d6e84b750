// Host-side argument checks shared by the CPU references and the CUDA host functions, so both
// reject the same calls with the same message naming the parameter and its value.
#pragma once

#include <cstdint>

#include "keel/status.hpp"
#include "kernels/device.h"

namespace keel::kernels {

struct QuotaTable;

// `name` = value must be >= 0.
Status CheckNonNegative(const char* name, int64_t value);
// `name` must be >= 1.
Status CheckPositive(const char* name, int64_t value);
// A null pointer is allowed only when it would hold no elements.
Status CheckPointer(const char* name, const void* pointer, int64_t elements);
// The scalar fields and pointers of a quota table (its contents live where the kernel runs).
Status CheckQuotaTable(const QuotaTable& quotas);
// Hidden-state rows: hidden >= 1 and a known dtype.
Status CheckRows(int64_t hidden, DType dtype);
// A number of entries or rows that int32 counts and positions can index: in [0, 2^31).
Status CheckIndexable(const char* name, int64_t value);

// The scalars and pointers of each kernel's arguments (kernels/*.h), checked the same way by
// the CPU reference and the CUDA host function. Contents of index arrays are checked by the CPU
// reference alone.
Status CheckExpertHistogramArguments(const void* ids, int64_t num_entries, int num_experts,
                                     const int32_t* counts, const int32_t* invalid);
Status CheckRankHistogramArguments(const void* ids, int64_t num_tokens, int top_k,
                                   const int32_t* rank_of, int num_ids, int num_ranks,
                                   const int32_t* entries, const int32_t* tokens,
                                   const int32_t* invalid);
Status CheckRemapArguments(const void* ids, int64_t num_entries, const QuotaTable& quotas,
                           const int32_t* slot, const int32_t* send_counts, const int32_t* invalid);
Status CheckPermutationIndexArguments(const int32_t* slot, int64_t num_entries,
                                      const int32_t* bucket_of_slot, int num_slots, int num_buckets,
                                      const int32_t* position, const int32_t* bucket_begin,
                                      const int32_t* invalid);
Status CheckPermuteArguments(const void* in, int64_t num_tokens, int top_k, int64_t hidden,
                             DType dtype, const int32_t* position, const void* out,
                             int64_t num_rows);
Status CheckPermuteBackwardArguments(const void* grad_out, int64_t num_rows,
                                     const int32_t* position, int64_t num_tokens, int top_k,
                                     int64_t hidden, DType dtype, const void* grad_in);
Status CheckUnpermuteCombineArguments(const void* rows, int64_t num_rows, const int32_t* position,
                                      const float* weights, int64_t num_tokens, int top_k,
                                      int64_t hidden, DType dtype, const void* out);
Status CheckUnpermuteCombineBackwardArguments(const void* grad_out, const void* rows,
                                              int64_t num_rows, const int32_t* position,
                                              const float* weights, int64_t num_tokens, int top_k,
                                              int64_t hidden, DType dtype, const void* grad_rows,
                                              const float* grad_weights);
Status CheckSlotChecksumArguments(const void* base, int64_t num_slots, int64_t slot_bytes,
                                  int64_t stride_bytes, const uint64_t* checksums);
Status CheckCondenseArguments(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                              const int32_t* bucket_begin, int num_buckets, float threshold,
                              int window, const int32_t* representative, const int32_t* kept);
Status CheckExpandArguments(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                            const int32_t* representative);

}  // namespace keel::kernels
