// Token condensation (Luffy) for trainers that condense on the CPU, as keel.torch does: which
// rows of one expert stand for others. The rule, and the backward rule that goes with it, are
// kernels/condense.h's; this is its CPU reference for float32 rows.
#pragma once

#include <cstdint>

#include "keel/status.hpp"

namespace keel {

// rows: [num_rows, hidden] float32, grouped in buckets (e.g. one per destination slot);
// bucket_begin: [num_buckets + 1] int32, bucket b is rows [bucket_begin[b], bucket_begin[b+1]).
// Writes representative: [num_rows] int32 (a row that is sent stands for itself; a condensed row
// names the earlier row of its bucket that is sent in its place) and kept: [num_buckets] int32,
// the rows each bucket sends. A row is similar to another when the two are identical, or (below
// threshold 1) when their cosine is at least `threshold`; only the `window` rows before a row in
// its bucket are compared. threshold in (0, 1], window >= 1. InvalidArgument names the bad one.
Status CondenseRows(const float* rows, int64_t num_rows, int64_t hidden,
                    const int32_t* bucket_begin, int num_buckets, float threshold, int window,
                    int32_t* representative, int32_t* kept);

}  // namespace keel
