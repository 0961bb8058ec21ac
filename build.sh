#!/usr/bin/env bash
# Build pympgu's extensions in place: ./build.sh prints one line (the compiler's output goes
# to build/build.log, shown in full on failure); ./build.sh -v shows it as it goes;
# ./build.sh clean removes every build output.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "clean" ]; then
  rm -rf build dist *.egg-info pympgu/*.so pympgu/*/*.so pympgu/_host.cpp pympgu/_cuda/_core.cpp
  find . -name __pycache__ -type d -prune -exec rm -rf {} +
  echo "cleaned"
  exit 0
fi
if [ "${1:-}" = "-v" ]; then
  shift
  exec python3 setup.py build_ext --inplace "$@"
fi
mkdir -p build
log=build/build.log
start=$SECONDS
if ! python3 setup.py build_ext --inplace "$@" > "$log" 2>&1; then
  tail -n 60 "$log"
  echo "pympgu: the build failed; its whole log: $log" >&2
  exit 1
fi
built="pympgu._host"
if ! grep -q "building the host part only" "$log"; then
  built+=" and pympgu._cuda._core"
  if grep -q "building without the XLA operations" "$log"; then
    built+=" (without the XLA operations: jaxlib's headers not found)"
  else
    built+=" (with the XLA operations)"
  fi
else
  built+=" only ($(grep -o "PYMPGU_NO_CUDA=1\|no CUDA toolkit found" "$log" | head -1))"
fi
echo "pympgu: built $built in $((SECONDS - start)) s; log: $log"
