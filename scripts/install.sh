#!/usr/bin/env bash
# Install ditron-inductor (editable) and what its tests need, into the environment that
# scripts/python_env.sh names (the active venv/conda env, else ./.venv). Nothing is installed when
# the package and the test dependencies already import from it. An installed torch is kept as it
# is (a GPU user's CUDA build); where there is none, the CPU build is pinned, since an unpinned
# `torch` pulls gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
if "$PY" - <<'PY' 2>/dev/null; then
import importlib.metadata as md, os, sys
import ditron_inductor, expecttest, numpy, pytest, torch, torchao, triton, xdist  # noqa: F401
here = os.path.realpath(os.path.join(os.getcwd(), "ditron_inductor"))
found = os.path.realpath(os.path.dirname(ditron_inductor.__file__))
backends = {e.name for e in md.entry_points(group="torch_dynamo_backends")}
sys.exit(0 if found == here and "ditron" in backends else 1)
PY
  echo "ditron-inductor and the test dependencies are installed in $PY" >&2
  exit 0
fi
# A fresh CI machine gains nothing from pip's cache, and its disk can be short (a CI run of
# 2026-11-27 ran out of space while installing): no cache there.
if [ -n "${CI:-}" ]; then
  export PIP_NO_CACHE_DIR=1
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
fi
"$PY" -m pip install -e ".[test]"
echo "installed into $PY" >&2
