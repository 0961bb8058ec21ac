#!/usr/bin/env bash
# Build pympgu's extensions in place (./build.sh), or remove every build output (./build.sh clean).
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "clean" ]; then
  rm -rf build dist *.egg-info pympgu/*.so pympgu/*/*.so pympgu/_host.cpp pympgu/_cuda/_core.cpp
  find . -name __pycache__ -type d -prune -exec rm -rf {} +
  echo "cleaned"
  exit 0
fi
python3 setup.py build_ext --inplace "$@"
