#!/bin/bash
# One call on the GPU machine: install the carried wheels, run the GPU tests, run the benchmark.
#   bash benchmarks/run_on_device.sh <world sizes for tests, e.g. "2" or "4 8"> <bench world> [bench args...]
# The all-reduce kernels (GEMM + all-reduce + RMSNorm) join in with AR=1: their GPU tests on the
# same world sizes (quick subset) and their benchmark on the bench world.
# AR_ARGS: extra arguments of bench_all_reduce.py (e.g. "--verbose --ms 1,32").
# FUSED_TESTS=0 / FUSED_BENCH=0 leave out the all-gather/reduce-scatter tests / benchmark.
# MOE=1: the MoE kernels' GPU tests (one GPU) and their world-1 benchmark (bench_moe.py, MOE_ARGS:
# its extra arguments), before the rest; MOE=tests or MOE=bench: one of the two (each can take
# most of a 10-minute call: compiling the tiles).
# Logs and results land in $OUT (the device tool brings them back).
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
TESTS=$1; BENCH_W=$2; shift 2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
python3 -c "import nvshmem.core; print('nvshmem4py ok')" 2>&1 | tail -1
nvidia-smi topo -m 2>&1 | head -12
if [ "${MOE:-0}" = "1" ] || [ "${MOE:-0}" = "tests" ]; then
  timeout -k 5 ${TEST_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_gpu.py 2>&1 | tee $OUT/moe_tests.log | grep -v "^$" | tail -6
  echo "moe gpu tests: rc=$?"
fi
if [ "${MOE:-0}" = "1" ] || [ "${MOE:-0}" = "bench" ]; then
  timeout -k 5 ${BENCH_TIMEOUT:-540} torchrun --nproc-per-node 1 benchmarks/bench_moe.py --out $OUT/moe_w1 ${MOE_ARGS:-} 2>&1 | tee $OUT/moe_bench.log | grep -v "Warning\|warn(\|^|" | tail -40
  echo "moe bench rc=$?"
fi
for w in $TESTS; do
  [ "${FUSED_TESTS:-1}" = "0" ] && break
  K="world$w"; [ "$w" = "4" ] && K="world4 and torch"
  timeout -k 5 ${TEST_TIMEOUT:-240} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_gpu.py -k "$K" 2>&1 | tee $OUT/gpu_tests_w$w.log | grep -v "^$" | tail -6
  echo "gpu tests world $w: rc=$?"
done
if [ "${AR:-0}" = "1" ]; then
  for w in $TESTS; do
    DITRON_AR_QUICK=1 timeout -k 5 ${TEST_TIMEOUT:-360} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_all_reduce_gpu.py -k "fused[$w]" 2>&1 | tee $OUT/ar_tests_w$w.log | grep -v "^$" | tail -6
    echo "all-reduce gpu tests world $w: rc=$?"
  done
fi
if [ "$BENCH_W" != "0" ] && [ "${AR:-0}" = "1" ]; then
  timeout -k 5 ${BENCH_TIMEOUT:-300} torchrun --nproc-per-node $BENCH_W benchmarks/bench_all_reduce.py --out $OUT/ar_bench_w$BENCH_W ${AR_ARGS:-} 2>&1 | tee $OUT/ar_bench_w$BENCH_W.log | grep -v "Warning\|warn(" | tail -40
  echo "all-reduce bench rc=$?"
fi
if [ "$BENCH_W" != "0" ] && [ "${FUSED_BENCH:-1}" = "1" ]; then
  timeout -k 5 ${BENCH_TIMEOUT:-300} torchrun --nproc-per-node $BENCH_W benchmarks/bench_fused.py --out $OUT/bench_w$BENCH_W "$@" 2>&1 | tee $OUT/bench_w$BENCH_W.log | grep -v "Warning\|warn(" | tail -60
  echo "bench rc=$?"
fi
