// The largest job Keel takes. Every size a user gives (a config, a trace, `keel plan`'s input,
// the engine's shape) and every product of sizes that Keel allocates a table of is checked against
// these before anything is allocated, so that a typo or a corrupt file fails with its name rather
// than as exhausted memory, an overflow or hours of work. docs/config.md ("Limits") lists them.
#pragma once

#include <cstdint>

namespace keel {

inline constexpr int kMaxLayers = 65536;   // MoE layers
inline constexpr int kMaxExperts = 65536;  // logical experts per layer
// Ranks (GPUs) of a job: each layer's step has a ranks x ranks all-to-all matrix (128 MiB of
// doubles at 4096 ranks), and the planners scan it.
inline constexpr int kMaxRanks = 4096;
inline constexpr int kMaxSlotsPerLayer = 1 << 20;  // all ranks' persistent and transient slots
// Slots of all layers together: the placements a job holds (num_layers x slots per layer).
inline constexpr int64_t kMaxSlots = int64_t{1} << 24;
// Tokens in one count (of a traffic matrix or a trace) or in one expert's expected load: sums of
// such counts stay exact whole numbers in a double, and rounding one to an integer cannot overflow.
inline constexpr double kMaxTokenCount = 1e15;
// Token counts a job holds at once, 512 MiB of doubles: a trace's steps x layers x sources x
// experts (and its sequences' layers x experts each), or the engine's per-layer loads by source
// rank, layers x ranks x experts, times the estimator's window.
inline constexpr int64_t kMaxCounts = int64_t{1} << 26;
// Threads one call runs on (`keel replay --threads`, ReplayRequest): more than any machine has
// cores, fewer than a process can always start.
inline constexpr int kMaxThreads = 1024;

}  // namespace keel
