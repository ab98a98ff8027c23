#!/usr/bin/env bash
# On the GPU machine (repo root, `.whl/` carried): TORCH_LOGS=ditron under that machine's torch,
# and the CPU test files that start subprocesses and ranks, under that torch.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
step() { local name=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0))s | $(grep -E 'passed|failed|PASS|FAIL|Error|accepted' "$OUT/$name.log" | tail -1)"; }
step torch_logs env TORCH_LOGS=+ditron,graph_breaks python3 -c "import torch; print('TORCH_LOGS accepted', torch.__version__)"
step unit timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider ditron_inductor/tests/test_backend.py \
  ditron_inductor/tests/test_lowering.py ditron_inductor/tests/test_scheduler.py ditron_inductor/tests/test_ops.py
step e2e_gloo timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider ditron_inductor/tests/test_e2e_gloo.py
