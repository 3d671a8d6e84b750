// PLACEHOLDER: replaced by the real `keel plan`.
#include <cstdio>
#include "tools/commands.h"
namespace keel::tools {
int RunPlan(int, char**) { std::fputs("keel plan: not built yet\n", stderr); return 1; }
}  // namespace keel::tools
