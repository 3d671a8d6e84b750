#!/usr/bin/env bash
# Installs the build tree into a fresh prefix, then configures, builds and runs the consumer of
# tests/install/consumer and the custom policy of examples/custom_policy against that prefix alone
# (find_package(Keel)). The custom policy must appear in its replay report and balance better
# than the static placement.
# Usage: install_consumer.sh BUILD_DIR
set -euo pipefail
build=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log" || { cat "$work/install.log"; exit 1; }
for f in include/keel/engine.hpp include/keel/keel.h include/keel/version.hpp \
         lib/cmake/Keel/KeelConfig.cmake; do
  [ -e "$work/prefix/$f" ] || { echo "not installed: $f"; exit 1; }
done
ls "$work/prefix"/lib*/libkeel.so >/dev/null
# Public headers include only each other and the standard library (C's two headers in keel.h).
foreign=$(grep -h '^#include' "$work/prefix/include/keel/"* |
          grep -Ev '^#include ("keel/[a-z_]+\.(hpp|h)"|<[a-z_]+>|<std(def|int)\.h>)$' || true)
if [ -n "$foreign" ]; then echo "public headers include outside keel/ and std:"; echo "$foreign"; exit 1; fi
cmake -S "$here/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
      >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" -j 2
"$work/build/consumer"

# A policy of one's own, registered by name outside Keel's sources.
cmake -S "$here/../../examples/custom_policy" -B "$work/custom" -DCMAKE_PREFIX_PATH="$work/prefix" \
      >"$work/custom-configure.log" 2>&1 || { cat "$work/custom-configure.log"; exit 1; }
cmake --build "$work/custom" -j 2
"$work/custom/custom_policy" >"$work/report.json"
python3 - "$work/report.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
policies = report["policies"]
assert report["policy_order"] == ["static", "eplb", "hot_copies", "keel"], report["policy_order"]
mine, static = policies["hot_copies"], policies["static"]
assert mine["layer_replans"] > 0, mine
assert mine["imbalance"]["mean"] < 0.8 * static["imbalance"]["mean"], (mine["imbalance"], static["imbalance"])
assert mine["moved_homes_total"] == 0, "hot_copies keeps every home"
print("custom policy: imbalance mean %.3f (static %.3f)" % (mine["imbalance"]["mean"], static["imbalance"]["mean"]))
PY
