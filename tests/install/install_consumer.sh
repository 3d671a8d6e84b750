#!/usr/bin/env bash
# Installs the build tree into a fresh prefix, then configures, builds and runs the consumer of
# tests/install/consumer against that prefix alone (find_package(Keel)).
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
