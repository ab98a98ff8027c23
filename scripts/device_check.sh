#!/usr/bin/env bash
# One call on the GPU machine (run from the repo root, `.whl/` carried): install the package so
# its entry points exist, then check the backend under that machine's torch: unit tests, the demo
# over NCCL (scheduler's plans, then fused plans forced), and the fused kernels on 2 ranks.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
step() { local name=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0))s | $(grep -E 'passed|failed|PASS|FAIL|Error' "$OUT/$name.log" | tail -1)"; }
step torch_logs env TORCH_LOGS=ditron python3 -c "import torch; print('TORCH_LOGS=ditron accepted')"
step unit timeout -k 5 170 python3 -m pytest -q -x -p no:cacheprovider ditron_inductor/tests/test_backend.py \
  ditron_inductor/tests/test_lowering.py ditron_inductor/tests/test_scheduler.py ditron_inductor/tests/test_ops.py
step demo_nccl timeout -k 5 120 python3 -m ditron_inductor.demo
step demo_nccl_fused env DITRON_PLAN=fused TORCH_LOGS=ditron timeout -k 5 120 python3 -m ditron_inductor.demo
step fused_w2 timeout -k 5 150 python3 -m pytest -q -s -p no:cacheprovider ditron_inductor/tests/gpu/test_fused_gpu.py -k "world2 and torch"
grep -h "FUSED\|not fused\|PASS\|FAIL" "$OUT/demo_nccl.log" | head -20
