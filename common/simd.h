// Four-lane vectors for the planner's hot loops, and AVX2 dispatch where the CPU has it. No
// architecture's intrinsics: the same source is the one path on every CPU (an x86-64 CPU with
// AVX2 runs a copy the compiler built for it, which gives the same bits).
//
// DoubleQuad holds four doubles as one value: GCC and Clang keep it in one AVX register or two
// SSE2 registers (every x86-64 CPU has SSE2; other targets use what they have) and apply + * |
// and comparisons lane by lane. A lane's operation is the scalar IEEE one, so a loop that adds
// its terms in the same order as a scalar loop gives the same bits. Neither the vector nor the
// scalar code may contract a multiply and an add into an FMA: ISO C++ mode (-std=c++20, not
// gnu++20) keeps them apart, and AVX2 alone has no FMA instruction.
#pragma once

#include <cstdint>

#include "common/sanitizers.h"

namespace keel {

using DoubleQuad = double __attribute__((vector_size(32)));
using BitsQuad = std::uint64_t __attribute__((vector_size(32)));
using IntQuad = std::int32_t __attribute__((vector_size(16)));   // one SSE2 register
using UintOct = std::uint32_t __attribute__((vector_size(32)));  // one AVX register

}  // namespace keel

// On a lambda that must be inlined: one that is not keeps the variables it shares with its caller
// in memory, where every addition waits on a store.
#define KEEL_INLINE __attribute__((always_inline))

// Before a function definition: compile it for AVX2 and for the baseline, and pick one when the
// program loads (function multi-versioning). Only on x86-64; elsewhere the function is compiled
// once for the target. Not under ThreadSanitizer either: the resolver that picks a copy runs while
// the program is relocated, before the sanitizer's runtime is up, and its instrumented code
// crashes there.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !KEEL_UNDER_TSAN
#define KEEL_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KEEL_AVX2_CLONES
#endif
