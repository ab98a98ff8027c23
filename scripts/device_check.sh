#!/usr/bin/env bash
# Checks of the backend that need the GPU machine's torch (run from the repo root, `.whl/`
# carried: nvshmem4py, cuda-python, expecttest, py-spy, torchao): install the package so its entry
# points exist, then run the named steps.
#   bash scripts/device_check.sh [step ...]    (default: every step)
# Steps: torch_logs unit e2e_gloo demo_nccl demo_nccl_fused fused_w2 (the default); gpu_w1 (the
# fused GPU tests at world size 1, for a one-GPU machine), compute_parity (benchmarks/
# bench_compute_parity.py: every fused plan at world size 1 beside the unfused compute; PARITY_ARGS
# narrows it), rank_local_work (benchmarks/bench_rank_local_work.py: a TP-W rank's local work in
# the chosen training plans, transfers free, one GPU; RANK_WORK_ARGS), gemm_tiles
# (benchmarks/bench_gemm_tiles.py: the Triton GEMM's tiles beside cuBLAS where a chosen plan runs
# it; GEMM_TILES_ARGS); and on two or more GPUs: exit_gpu (programs that used the fused ops exit,
# tests/gpu/test_exit_gpu.py), ag_in_turn (the AG plans back to back on fresh inputs, alone and
# taking turns, free running: tests/gpu/test_fused_gpu.py -k free_running, or -k $AG_IN_TURN_K;
# DITRON_TEST_AG_PLANS=name,... runs those plans alone),
# ar_w2 (the all-reduce GPU tests on 2 ranks), ar_bench (benchmarks/bench_all_reduce.py on
# $(ranks) GPUs; AR_BENCH_ARGS narrows it), moe_multi_rank (the MoE dispatch and combine on every local
# GPU), moe_gpu (every MoE GPU test: world size 1 and the multi-rank ones), moe_bench
# (benchmarks/bench_moe.py at world size 1: the grouped GEMM tiles beside torch._grouped_mm;
# MOE_BENCH_ARGS narrows it), moe_ep (benchmarks/bench_moe_ep.py: the fused dispatch and combine against NCCL
# all-to-all + torch._grouped_mm), e2e_moe (benchmarks/e2e_moe.py: an MoE model's training step,
# Inductor, ditron, every MoE op fused, the fused combine alone; E2E_MOE_ARGS), fp8_tp (benchmarks/bench_fp8_tp.py: the fp8 plans per site against NCCL + _scaled_mm and async TP's fp8 ops),
# fused_sites (benchmarks/bench_fused.py --sites 8b: every AG/RS candidate plan at the Llama
# training step's sites, TP = the GPUs present, for each of FUSED_TOKENS: the rows of
# scheduler/evidence/measured_plans.json), power (benchmarks/bench_power.py: SM clock and power while
# the GEMM alone, the all-gather alone, NCCL + cuBLAS and ditron's AG plans each run), fp8_gpu (the FP8 plans at the world sizes present), e2e_llama (benchmarks/e2e_llama.py over every local GPU after its --no-comm bound on
# one; 180 + 400 s at most, so pick workloads to fit a call: E2E_ARGS="--workloads train,prefill",
# then "--workloads decode"; the contenders: Inductor, async TP, ditron and ditron without its
# causal-mask rewrite), train_profile (the training step of Inductor and ditron with the device
# time by kernel kind; TRAIN_CONTENDERS names others, e.g. inductor,ditron_keep_mask;
# E2E_ARGS adds options, e.g. "--fp8 tensorwise"), e2e_fp8 (the float8 training step as the scheduler decides,
# then with DITRON_PLAN=fused; FP8_PLANS picks one, E2E_ARGS adds options), decode_tp (benchmarks/e2e_decode.py over every local GPU, local parameters,
# guards skipped, the host's time split; DECODE_ARGS adds options, e.g. "--layers 32"),
# decode_split (benchmarks/e2e_decode.py --profile-device: a decode step's device time in GEMV/GEMM,
# attention, collectives, small ops and idle, 16 layers, B 1 and 16, prompt 512, Inductor, ditron,
# ditron+graph; WORLD=1 for one GPU; DECODE_SPLIT_ARGS adds options), calibrate (the world-1
# calibration of the Llama-3-8B TP 2 sites into a fresh cache, then each site's decision with and
# without it and a compile over a fake group of 2 ranks naming its evidence), ep_local
# (benchmarks/bench_ep_local_work.py: an EP-W rank's local work in the fused MoE dispatch and
# combine beside the unfused path's, W 2/4/8, one GPU; EP_LOCAL_ARGS adds options),
# fp8_parity (benchmarks/bench_fp8_parity.py at world size 1: the fp8 AG, RS and AR plans beside
# _scaled_mm; FP8_PARITY_ARGS adds options), gemv (benchmarks/bench_gemv.py: the decode GEMM
# template against cuBLAS at Llama's decode shapes; GEMV_ARGS adds options), mag
# (benchmarks/bench_matmul_all_gather.py on every local GPU: the GEMM + all-gather of its output
# beside cuBLAS + NCCL; MAG_ARGS adds options, e.g. "--tp 2,4,8" on one GPU), decode_gpu (the
# decode attention and decode GEMM templates' GPU tests, tests/gpu/test_decode_*_gpu.py),
# decode_attention (benchmarks/bench_decode_attention.py: the template beside SDPA, one GPU),
# launch_gpu (tests/gpu/test_kernel_launch_gpu.py: a kernel's first launch runs in its
# stream's order), step_graph_gpu (tests/gpu/test_step_graph_gpu.py: a whole compiled step
# replayed from StepGraph's CUDA graph), wait_bound_gpu (tests/gpu/test_wait_bound_gpu.py: a wait
# that gives up reports, raises naming its site, and the watcher ends the process; one GPU).
# Each step's log goes to $W (default /tmp/w), and after each step every log and JSON there is
# packed into $OUT/logs.tgz: the device tool brings back at most 8 files.
set -o pipefail
OUT=${OUT:-/tmp/out}; W=${W:-/tmp/w}; mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# the benchmarks' "machine" field: the device tool's kind, e.g. nvidia-h200-x4
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')  # H100 of "NVIDIA H100 80GB HBM3"
export MACHINE_KIND=${MACHINE_KIND:-nvidia-$card-x$(nvidia-smi -L | wc -l)}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
# EXTRA_PYTHONPATH: packages a step needs in other versions than the machine's (put first); e.g.
# e2e_moe --hf needs transformers' EP interface (5.24; the machine has 5.17): here
# `pip download --no-deps -d .device/hf transformers==5.24.0 regex` (.device carried), there
# `pip install --no-deps --target /tmp/hf .device/hf/*.whl` and EXTRA_PYTHONPATH=/tmp/hf
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"

# `limited SECONDS cmd ...`: cmd under a time limit. At the limit, before the kill, py-spy prints
# the Python and native stacks of cmd's descendants (torchrun's ranks), then SIGUSR1 has them print
# their Python threads' stacks (e2e_llama.py and the exit program register faulthandler for it):
# where a run that does not exit waits (py-spy found the NCCL teardown hang on 2x H100; SIGUSR1
# alone printed nothing there).
descendants() { local c; for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }
limited() {
  local limit=$1; shift
  "$@" & local pid=$! t=0 child
  while kill -0 "$pid" 2>/dev/null && [ "$t" -lt "$limit" ]; do sleep 1; t=$((t + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    echo "still running after ${limit} s: the stacks of its processes, then the kill"
    local all; all=$(descendants "$pid")  # torch.multiprocessing's ranks are grandchildren
    for child in "$pid" $all; do
      echo "=== process $child: $(tr '\0' ' ' < "/proc/$child/cmdline" | cut -c1-120)"
      command -v py-spy >/dev/null && timeout 60 py-spy dump --native --pid "$child" | head -120
    done
    for child in $all; do kill -USR1 "$child" 2>/dev/null; done; sleep 3
    kill -- "$pid"; sleep 5; kill -9 $all "$pid" 2>/dev/null
  fi
  wait "$pid"
}

# the ranks of the multi-GPU steps: every local GPU, or WORLD of them (e.g. WORLD=2 on 4 GPUs)
ranks() { echo "${WORLD:-$(nvidia-smi -L | wc -l)}"; }

torch_logs() { env TORCH_LOGS=+ditron,graph_breaks python3 -c "import torch; print('TORCH_LOGS accepted')"; }
unit() { timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider tests/test_backend.py \
  tests/test_lowering.py tests/test_scheduler.py tests/test_ops.py; }
e2e_gloo() { timeout -k 5 400 python3 -m pytest -q -p no:cacheprovider tests/test_e2e_gloo.py; }
demo_nccl() { timeout -k 5 120 python3 -m ditron_inductor.demo; }
demo_nccl_fused() { DITRON_PLAN=fused TORCH_LOGS=ditron timeout -k 5 120 python3 -m ditron_inductor.demo; }
fused_w2() { timeout -k 5 150 python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_fused_gpu.py -k "world2 and torch"; }
gpu_w1() { DITRON_AR_QUICK=1 timeout -k 5 400 python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_fused_gpu.py tests/gpu/test_all_reduce_gpu.py \
  -k "world1 or fused[1]"; }
compute_parity() { timeout -k 5 ${PARITY_LIMIT:-480} torchrun --nproc-per-node 1 \
  benchmarks/bench_compute_parity.py --out "$W/compute_parity" ${PARITY_ARGS:-}; }
rank_local_work() { timeout -k 5 ${RANK_WORK_LIMIT:-240} python3 \
  benchmarks/bench_rank_local_work.py --out "$W/rank_local_work" ${RANK_WORK_ARGS:-}; }
gemm_tiles() { timeout -k 5 ${GEMM_TILES_LIMIT:-300} python3 benchmarks/bench_gemm_tiles.py \
  --out "$W/gemm_tiles" ${GEMM_TILES_ARGS:-}; }
exit_gpu() { timeout -k 5 420 python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_exit_gpu.py; }
ag_in_turn() {  # the AG plans taking turns on fresh inputs, free running
  DITRON_TEST_AG_IN_TURN=1 limited ${AG_IN_TURN_LIMIT:-300} python3 -m pytest -q -s \
    -p no:cacheprovider tests/gpu/test_fused_gpu.py -k "${AG_IN_TURN_K:-free_running}"; }
ar_bench() { local world; world=$(ranks)  # AR_BENCH_ARGS: e.g. "--ms 1,16 --cols 4096"
  limited ${AR_BENCH_LIMIT:-300} torchrun --nproc-per-node "$world" \
    benchmarks/bench_all_reduce.py --out "$W/ar_bench_w$world" ${AR_BENCH_ARGS:-}; }
ar_w2() { DITRON_AR_QUICK=1 timeout -k 5 360 python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_all_reduce_gpu.py -k "fused[2]"; }
e2e_llama() {  # the no-communication bound on one GPU first, then every contender on all of them
  local world; world=$(ranks)
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 ${E2E_BOUND_LIMIT:-180} python3 benchmarks/e2e_llama.py \
    --no-comm --world "$world" --json "$W/e2e_llama_no_comm.json" ${E2E_ARGS:-} \
    --contenders inductor,ditron
  local bound=(); [ -s "$W/e2e_llama_no_comm.json" ] && bound=(--bound-json "$W/e2e_llama_no_comm.json")
  limited ${E2E_LIMIT:-400} torchrun --nproc-per-node "$world" benchmarks/e2e_llama.py \
    --json "$W/e2e_llama.json" "${bound[@]}" \
    --contenders inductor,inductor_async_tp,ditron,ditron_keep_mask ${E2E_ARGS:-}; }

moe_multi_rank() { limited ${MOE_LIMIT:-300} python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_moe_gpu.py -k "multi_rank ${MOE_ONLY:+and $MOE_ONLY}"; }
moe_gpu() { limited ${MOE_LIMIT:-400} python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_moe_gpu.py; }
moe_bench() { timeout -k 5 ${MOE_BENCH_LIMIT:-300} torchrun --nproc-per-node 1 \
  benchmarks/bench_moe.py --out "$W/moe_bench" ${MOE_BENCH_ARGS:-}; }
fp8_gpu() { timeout -k 5 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_gpu.py; }
fp8_tp() { local world; world=$(ranks)
  limited ${FP8_TP_LIMIT:-300} torchrun --nproc-per-node "$world" benchmarks/bench_fp8_tp.py \
    --out "$W/fp8_tp"; }
moe_ep() { local world; world=$(ranks)  # MOE_EP_ARGS: e.g. "--models mixtral"
  limited ${MOE_EP_LIMIT:-400} torchrun --nproc-per-node "$world" benchmarks/bench_moe_ep.py \
    --out "$W/moe_ep" ${MOE_EP_ARGS:-}; }
e2e_moe() { local world; world=$(ranks)  # E2E_MOE_ARGS: e.g. "--model qwen3 --tokens 4096"
  limited ${E2E_MOE_LIMIT:-400} torchrun --nproc-per-node "$world" benchmarks/e2e_moe.py \
    --out "$W/e2e_moe" ${E2E_MOE_ARGS:-}; }
fused_sites() { local world tokens; world=$(ranks)  # every AG/RS candidate
  for tokens in ${FUSED_TOKENS:-8192}; do  # per site, for each token count
    limited ${FUSED_LIMIT:-300} torchrun --nproc-per-node "$world" benchmarks/bench_fused.py \
      --sites ${FUSED_SITES:-8b} --tokens "$tokens" --no-mlp --iters 10 --reps 5 \
      --out "$W/fused_sites_$tokens"
  done; }
power() { local world; world=$(ranks)  # POWER_ARGS: e.g. "--shape 8192,4096,7168"
  limited ${POWER_LIMIT:-200} torchrun --nproc-per-node "$world" benchmarks/bench_power.py \
    --out "$W/power" ${POWER_ARGS:-}; }
train_profile() { local world; world=$(ranks)
  limited ${E2E_LIMIT:-300} torchrun --nproc-per-node "$world" benchmarks/e2e_llama.py \
    --workloads train --contenders ${TRAIN_CONTENDERS:-inductor,ditron} --profile-device 3 \
    --json "$W/e2e_train_profile.json" ${E2E_ARGS:-}; }
e2e_fp8() { local world; world=$(ranks)
  local run=(torchrun --nproc-per-node "$world" benchmarks/e2e_llama.py --workloads train
             --fp8 tensorwise --contenders inductor,inductor_async_tp,ditron ${E2E_ARGS:-})
  local plan  # FP8_PLANS: "scheduler" (as the scheduler decides), "fused" (DITRON_PLAN=fused)
  for plan in ${FP8_PLANS:-scheduler fused}; do
    if [ "$plan" = fused ]; then
      DITRON_PLAN=fused limited ${E2E_LIMIT:-240} "${run[@]}" --json "$W/e2e_fp8_fused.json"
    else
      limited ${E2E_LIMIT:-240} "${run[@]}" --json "$W/e2e_fp8.json"
    fi
  done; }
decode_tp() { local world; world=$(ranks)
  limited ${DECODE_LIMIT:-300} torchrun --nproc-per-node "$world" benchmarks/e2e_decode.py \
    --params local --batches 1,16 --prompts 1024 --new-tokens 128 --reps 2 --skip-guard-eval \
    --profile-host 50 --json "$W/e2e_decode_tp.json" ${DECODE_ARGS:-}; }
decode_split() { local world; world=$(ranks)
  limited ${DECODE_SPLIT_LIMIT:-270} torchrun --nproc-per-node "$world" benchmarks/e2e_decode.py \
    --params local --layers 16 --batches 1,16 --prompts 512 --new-tokens 64 --reps 2 \
    --contenders inductor,ditron,ditron+graph --profile-device 10 \
    --json "$W/e2e_decode_split.json" ${DECODE_SPLIT_ARGS:-}; }
fp8_parity() { timeout -k 5 ${FP8_PARITY_LIMIT:-300} torchrun --nproc-per-node 1 \
  benchmarks/bench_fp8_parity.py --out "$W/fp8_parity" ${FP8_PARITY_ARGS:-}; }
calibrate() { export XDG_CACHE_HOME="$W/xdg"
  limited 300 torchrun --nproc-per-node 1 -m ditron_inductor.calibrate --sites llama-8b --tp 2 \
    --budget 2 && python3 -m ditron_inductor.calibrate --show \
  && limited 120 python3 -m benchmarks.calibration_check --sites llama-8b --tp 2 \
  && limited 240 python3 -m benchmarks.calibration_check --compile --tp 2; }
ep_local() { limited ${EP_LOCAL_LIMIT:-300} python3 benchmarks/bench_ep_local_work.py \
  --worlds 2,4,8 --tokens 512,4096,16384 --reps 3 --out "$W/ep_local_work" ${EP_LOCAL_ARGS:-}; }
decode_gpu() { timeout -k 5 300 python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_decode_attention_gpu.py tests/gpu/test_decode_gemm_gpu.py; }
decode_attention() { timeout -k 5 ${DECODE_ATTENTION_LIMIT:-200} torchrun --nproc-per-node 1 \
  benchmarks/bench_decode_attention.py --out "$W/decode_attention" ${DECODE_ATTENTION_ARGS:-}; }
launch_gpu() { timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_kernel_launch_gpu.py; }
step_graph_gpu() { timeout -k 5 180 python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_step_graph_gpu.py; }
wait_bound_gpu() { timeout -k 5 300 python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_wait_bound_gpu.py; }
mag() { timeout -k 5 ${MAG_LIMIT:-300} torchrun --nproc-per-node "$(ranks)" \
  benchmarks/bench_matmul_all_gather.py --out "$W/matmul_all_gather" ${MAG_ARGS:-}; }
gemv() { timeout -k 5 ${GEMV_LIMIT:-400} torchrun --nproc-per-node 1 benchmarks/bench_gemv.py \
  --out "$W/gemv" ${GEMV_ARGS:-}; }

steps=${*:-torch_logs unit e2e_gloo demo_nccl demo_nccl_fused fused_w2}
for name in $steps; do
  t0=$SECONDS; "$name" >"$W/$name.log" 2>&1; rc=$?
  echo "$name: rc=$rc $((SECONDS - t0))s | $(grep -E 'passed|failed|PASS|FAIL|Error|accepted' "$W/$name.log" | tail -1)"
  tar czf "$OUT/logs.tgz" -C "$W" .  # after each step: a call cut at its limit keeps the rest
done
[ -f "$W/demo_nccl.log" ] && grep -h "FUSED\|not fused\|PASS\|FAIL" "$W/demo_nccl.log" | head -20
exit 0
