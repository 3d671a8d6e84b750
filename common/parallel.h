// keel::ParallelFor: oneTBB's parallel_for over the indices [begin, end), for loops whose
// iterations are independent. Under ThreadSanitizer the loop runs on the caller, in order:
// Debian's oneTBB is not built with the sanitizer, so the synchronization by which its threads hand
// tasks over is invisible to it and every parallel loop would be reported as a race inside TBB.
// What that build checks is Keel's own threads and what they share.
#pragma once

#include <tbb/parallel_for.h>

#include "common/sanitizers.h"

namespace keel {

template <typename Index, typename Body>
void ParallelFor(Index begin, Index end, const Body& body) {
#if KEEL_UNDER_TSAN
  for (Index i = begin; i < end; ++i) body(i);
#else
  tbb::parallel_for(begin, end, body);
#endif
}

}  // namespace keel
