// The largest job Keel takes. Every size a user gives (a config, a trace, `keel plan`'s input,
// the engine's shape) is checked against these before anything is allocated, so that a typo or
// a corrupt file fails with its name rather than as exhausted memory or an overflow.
#pragma once

namespace keel {

inline constexpr int kMaxLayers = 65536;           // MoE layers
inline constexpr int kMaxExperts = 65536;          // logical experts per layer
inline constexpr int kMaxRanks = 65536;            // ranks (GPUs) of a job
inline constexpr int kMaxSlotsPerLayer = 1 << 20;  // all ranks' persistent and transient slots
// Tokens in one count (of a traffic matrix or a trace) or in one expert's expected load: sums of
// such counts stay exact whole numbers in a double, and rounding one to an integer cannot overflow.
inline constexpr double kMaxTokenCount = 1e15;

}  // namespace keel
