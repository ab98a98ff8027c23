#!/usr/bin/env bash
# Install what is missing (scripts/install.sh: nothing when all is there), then run the demo in
# the same environment: 2 CPU ranks over gloo, or GPUs + NCCL where present; about 1 minute.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/python_env.sh
exec "$PY" -m ditron_inductor.demo "$@"
