#!/usr/bin/env bash
# Install, then run the test suite (GPU tests skip themselves where no GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q -ra "$@"
