#!/usr/bin/env bash
# Install ditron-inductor (editable) and what its tests need. An installed torch is kept as it is
# (a GPU user's CUDA build); where there is none, the CPU build is pinned, since an unpinned
# `torch` pulls gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
fi
"$PY" -m pip install -e ".[test]"
