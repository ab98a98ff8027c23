#!/usr/bin/env bash
# On one GPU (issue 58): the bounded-wait GPU tests, then benchmarks/bench_wait_bound.py; logs in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MACHINE_KIND=${MACHINE_KIND:-nvidia-h200-x1}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 240 python3 -m pytest -q -x -s -p no:cacheprovider -m gpu tests/gpu/test_wait_bound_gpu.py \
  "tests/gpu/test_fused_gpu.py::test_fused_world1[torch]" "tests/gpu/test_all_reduce_gpu.py::test_all_reduce_fused[1]" 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
timeout 280 torchrun --nproc-per-node 1 -m benchmarks.bench_wait_bound --models 8b --tp 2 \
  --workloads decode,prefill,train --decode-tokens 1,4,16 --prefill-tokens 4096,8192 \
  --train-tokens 8192 --variants none --iters 20 --reps 9 \
  --out "$OUT/wait_bound_cost_h200x1" > "$OUT/bench.log" 2>&1
echo "bench rc $?"; tail -45 "$OUT/bench.log"
