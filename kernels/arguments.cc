#include "kernels/arguments.h"

#include <limits>
#include <string>

#include "kernels/remap.h"

namespace keel::kernels {

Status CheckNonNegative(const char* name, int64_t value) {
  if (value >= 0) return Status::Ok();
  return InvalidArgument(std::string(name) + " = " + std::to_string(value) + " is negative");
}

Status CheckPositive(const char* name, int64_t value) {
  if (value >= 1) return Status::Ok();
  return InvalidArgument(std::string(name) + " = " + std::to_string(value) + " is not >= 1");
}

Status CheckPointer(const char* name, const void* pointer, int64_t elements) {
  if (pointer != nullptr || elements <= 0) return Status::Ok();
  return InvalidArgument(std::string(name) + " is null but must hold " + std::to_string(elements) +
                         " elements");
}

Status CheckQuotaTable(const QuotaTable& quotas) {
  KEEL_RETURN_IF_ERROR(CheckNonNegative("quotas.num_experts", quotas.num_experts));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("quotas.num_copies", quotas.num_copies));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("quotas.num_slots", quotas.num_slots));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("quotas.num_ranks", quotas.num_ranks));
  KEEL_RETURN_IF_ERROR(
      CheckPointer("quotas.copy_begin", quotas.copy_begin, int64_t{quotas.num_experts} + 1));
  KEEL_RETURN_IF_ERROR(CheckPointer("quotas.copy_slot", quotas.copy_slot, quotas.num_copies));
  KEEL_RETURN_IF_ERROR(CheckPointer("quotas.copy_quota", quotas.copy_quota, quotas.num_copies));
  return CheckPointer("quotas.slot_rank", quotas.slot_rank, quotas.num_slots);
}

Status CheckRows(int64_t hidden, DType dtype) {
  KEEL_RETURN_IF_ERROR(CheckPositive("hidden", hidden));
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16) {
    return InvalidArgument("dtype = " + std::to_string(static_cast<int>(dtype)) +
                           " is not kFloat32 or kBFloat16");
  }
  return Status::Ok();
}

Status CheckIndexable(const char* name, int64_t value) {
  KEEL_RETURN_IF_ERROR(CheckNonNegative(name, value));
  if (value <= std::numeric_limits<int32_t>::max()) return Status::Ok();
  return InvalidArgument(std::string(name) + " = " + std::to_string(value) +
                         " is more than int32 counts and positions can index");
}

Status CheckExpertHistogramArguments(const void* ids, int64_t num_entries, int num_experts,
                                     const int32_t* counts, const int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_entries", num_entries));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_experts", num_experts));
  KEEL_RETURN_IF_ERROR(CheckPointer("ids", ids, num_entries));
  KEEL_RETURN_IF_ERROR(CheckPointer("counts", counts, num_experts));
  return CheckPointer("invalid", invalid, 1);
}

Status CheckRankHistogramArguments(const void* ids, int64_t num_tokens, int top_k,
                                   const int32_t* rank_of, int num_ids, int num_ranks,
                                   const int32_t* entries, const int32_t* tokens,
                                   const int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_tokens", num_tokens));
  KEEL_RETURN_IF_ERROR(CheckPositive("top_k", top_k));
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_tokens * top_k", num_tokens * top_k));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_ids", num_ids));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_ranks", num_ranks));
  KEEL_RETURN_IF_ERROR(CheckPointer("ids", ids, num_tokens * top_k));
  KEEL_RETURN_IF_ERROR(CheckPointer("rank_of", rank_of, num_ids));
  KEEL_RETURN_IF_ERROR(CheckPointer("entries", entries, num_ranks));
  KEEL_RETURN_IF_ERROR(CheckPointer("tokens", tokens, num_ranks));
  return CheckPointer("invalid", invalid, 1);
}

Status CheckRemapArguments(const void* ids, int64_t num_entries, const QuotaTable& quotas,
                           const int32_t* slot, const int32_t* send_counts,
                           const int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_entries", num_entries));
  KEEL_RETURN_IF_ERROR(CheckQuotaTable(quotas));
  KEEL_RETURN_IF_ERROR(CheckPointer("ids", ids, num_entries));
  KEEL_RETURN_IF_ERROR(CheckPointer("slot", slot, num_entries));
  KEEL_RETURN_IF_ERROR(CheckPointer("send_counts", send_counts, quotas.num_ranks));
  return CheckPointer("invalid", invalid, 1);
}

Status CheckPermutationIndexArguments(const int32_t* slot, int64_t num_entries,
                                      const int32_t* bucket_of_slot, int num_slots, int num_buckets,
                                      const int32_t* position, const int32_t* bucket_begin,
                                      const int32_t* invalid) {
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_entries", num_entries));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_slots", num_slots));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_buckets", num_buckets));
  KEEL_RETURN_IF_ERROR(CheckPointer("slot", slot, num_entries));
  KEEL_RETURN_IF_ERROR(CheckPointer("bucket_of_slot", bucket_of_slot, num_slots));
  KEEL_RETURN_IF_ERROR(CheckPointer("position", position, num_entries));
  KEEL_RETURN_IF_ERROR(CheckPointer("bucket_begin", bucket_begin, int64_t{num_buckets} + 1));
  return CheckPointer("invalid", invalid, 1);
}

namespace {

// The shapes shared by the permute family, and `position`.
Status CheckTokenRowArguments(int64_t num_tokens, int top_k, int64_t hidden, DType dtype,
                              const int32_t* position, int64_t num_rows) {
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_tokens", num_tokens));
  KEEL_RETURN_IF_ERROR(CheckPositive("top_k", top_k));
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_tokens * top_k", num_tokens * top_k));
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_rows", num_rows));
  KEEL_RETURN_IF_ERROR(CheckRows(hidden, dtype));
  return CheckPointer("position", position, num_tokens * top_k);
}

}  // namespace

Status CheckPermuteArguments(const void* in, int64_t num_tokens, int top_k, int64_t hidden,
                             DType dtype, const int32_t* position, const void* out,
                             int64_t num_rows) {
  KEEL_RETURN_IF_ERROR(
      CheckTokenRowArguments(num_tokens, top_k, hidden, dtype, position, num_rows));
  KEEL_RETURN_IF_ERROR(CheckPointer("in", in, num_tokens * hidden));
  return CheckPointer("out", out, num_rows * hidden);
}

Status CheckPermuteBackwardArguments(const void* grad_out, int64_t num_rows,
                                     const int32_t* position, int64_t num_tokens, int top_k,
                                     int64_t hidden, DType dtype, const void* grad_in) {
  KEEL_RETURN_IF_ERROR(
      CheckTokenRowArguments(num_tokens, top_k, hidden, dtype, position, num_rows));
  KEEL_RETURN_IF_ERROR(CheckPointer("grad_out", grad_out, num_rows * hidden));
  return CheckPointer("grad_in", grad_in, num_tokens * hidden);
}

Status CheckUnpermuteCombineArguments(const void* rows, int64_t num_rows, const int32_t* position,
                                      const float* weights, int64_t num_tokens, int top_k,
                                      int64_t hidden, DType dtype, const void* out) {
  KEEL_RETURN_IF_ERROR(
      CheckTokenRowArguments(num_tokens, top_k, hidden, dtype, position, num_rows));
  KEEL_RETURN_IF_ERROR(CheckPointer("rows", rows, num_rows * hidden));
  KEEL_RETURN_IF_ERROR(CheckPointer("weights", weights, num_tokens * top_k));
  return CheckPointer("out", out, num_tokens * hidden);
}

Status CheckUnpermuteCombineBackwardArguments(const void* grad_out, const void* rows,
                                              int64_t num_rows, const int32_t* position,
                                              const float* weights, int64_t num_tokens, int top_k,
                                              int64_t hidden, DType dtype, const void* grad_rows,
                                              const float* grad_weights) {
  KEEL_RETURN_IF_ERROR(
      CheckTokenRowArguments(num_tokens, top_k, hidden, dtype, position, num_rows));
  KEEL_RETURN_IF_ERROR(CheckPointer("grad_out", grad_out, num_tokens * hidden));
  KEEL_RETURN_IF_ERROR(CheckPointer("rows", rows, num_rows * hidden));
  KEEL_RETURN_IF_ERROR(CheckPointer("weights", weights, num_tokens * top_k));
  KEEL_RETURN_IF_ERROR(CheckPointer("grad_rows", grad_rows, num_rows * hidden));
  return CheckPointer("grad_weights", grad_weights, num_tokens * top_k);
}

Status CheckSlotChecksumArguments(const void* base, int64_t num_slots, int64_t slot_bytes,
                                  int64_t stride_bytes, const uint64_t* checksums) {
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_slots", num_slots));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("slot_bytes", slot_bytes));
  if (stride_bytes < slot_bytes) {
    return InvalidArgument("stride_bytes = " + std::to_string(stride_bytes) +
                           " is smaller than slot_bytes = " + std::to_string(slot_bytes));
  }
  KEEL_RETURN_IF_ERROR(CheckPointer("base", base, num_slots > 0 ? slot_bytes : 0));
  return CheckPointer("checksums", checksums, num_slots);
}

Status CheckCondenseArguments(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                              const int32_t* bucket_begin, int num_buckets, float threshold,
                              int window, const int32_t* representative, const int32_t* kept) {
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_rows", num_rows));
  KEEL_RETURN_IF_ERROR(CheckRows(hidden, dtype));
  KEEL_RETURN_IF_ERROR(CheckNonNegative("num_buckets", num_buckets));
  KEEL_RETURN_IF_ERROR(CheckPositive("window", window));
  if (!(threshold > 0.0f && threshold <= 1.0f)) {
    return InvalidArgument("threshold = " + std::to_string(threshold) + " is not in (0, 1]");
  }
  KEEL_RETURN_IF_ERROR(CheckPointer("rows", rows, num_rows * hidden));
  KEEL_RETURN_IF_ERROR(CheckPointer("bucket_begin", bucket_begin, int64_t{num_buckets} + 1));
  KEEL_RETURN_IF_ERROR(CheckPointer("representative", representative, num_rows));
  return CheckPointer("kept", kept, num_buckets);
}

Status CheckExpandArguments(const void* rows, int64_t num_rows, int64_t hidden, DType dtype,
                            const int32_t* representative) {
  KEEL_RETURN_IF_ERROR(CheckIndexable("num_rows", num_rows));
  KEEL_RETURN_IF_ERROR(CheckRows(hidden, dtype));
  KEEL_RETURN_IF_ERROR(CheckPointer("rows", rows, num_rows * hidden));
  return CheckPointer("representative", representative, num_rows);
}

}  // namespace keel::kernels
