#!/usr/bin/env bash
# Install what is missing (scripts/install.sh: nothing when all is there), then run the test
# suite (GPU tests skip themselves where no GPU is present) on two pytest workers, a test file
# each at a time (--dist loadfile: a file's tests share the ranks it launches once). Arguments
# go to pytest (e.g. -n 0 for one process, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/python_env.sh
exec "$PY" -m pytest -q -ra -n 2 --dist loadfile "$@"
