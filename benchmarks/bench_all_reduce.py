"""GEMM + all-reduce (+ residual + RMSNorm) benchmark: every contender side by side on W GPUs.

    torchrun --nproc-per-node 8 benchmarks/bench_all_reduce.py --out benchmarks/results/ar_h200x8

Per shape (M, K per rank, N; bf16 unless --dtype), op "matmul_all_reduce":
  nccl_cublas       a @ b, then NCCL all-reduce
  symm_one_shot     a @ b, copied into a symm_mem buffer, torch.ops.symm_mem.one_shot_all_reduce
  symm_two_shot     the same with torch.ops.symm_mem.two_shot_all_reduce_ (in place)
  ditron            torch.ops.ditron.matmul_all_reduce with the forced fused plan (one_shot for
                    M <= 256, else two_shot), and every plan in --plans for calibration
  gemm_only, comm_only
and op "matmul_all_reduce_rmsnorm": nccl_cublas = the unfused sequence (cuBLAS, NCCL, + residual,
RMSNorm in eager torch ops) vs ditron's fused op. Timing and the JSON/markdown row format are
bench_fused.py's (imported): {op, M, K, N, world, dtype, ms: {...}, plans: {...}, host_ms}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_fused import HOST_MS, bench, check_close, geomean, plan_text, safe  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SUITE = [(m, k, 8192) for k in (3584, 1024) for m in (2048, 8192, 128, 32, 1)]
EXTRA_PLANS = {  # label -> plan params, measured on every shape they apply to
    "one_shot": dict(algo="one_shot"),
    "two_shot_c8": dict(algo="two_shot", chunks=8, comm_sms=32),
    "two_shot_c16": dict(algo="two_shot", chunks=16, comm_sms=32),
    "two_shot_c16_s16": dict(algo="two_shot", chunks=16, comm_sms=16),
}
EPS = 1e-6


def _rmsnorm(h, w):
    from ditron_inductor.ops import rms_norm_reference

    return rms_norm_reference(h, w, EPS, False)


def run_shape(shape, dtype, group_name, world, args):
    M, K, N = shape
    dev = "cuda"
    c10d = torch.ops._c10d_functional
    inputs = [(torch.randn(M, K, device=dev, dtype=dtype),
               torch.randn(K, N, device=dev, dtype=dtype) / K ** 0.5) for _ in range(2)]
    residual = torch.randn(M, N, device=dev, dtype=dtype)
    weight = torch.rand(N, device=dev, dtype=dtype) + 0.5
    full = torch.randn(M, N, device=dev, dtype=dtype)

    def nccl_cublas(a, b):
        return c10d.wait_tensor(c10d.all_reduce(a @ b, "sum", group_name))

    def unfused_norm(a, b):
        h = nccl_cublas(a, b) + residual
        return h, _rmsnorm(h, weight)

    def gemm_only(a, b):
        return a @ b

    def comm_only(a, b):
        return c10d.wait_tensor(c10d.all_reduce(full, "sum", group_name))

    symm = {}

    def symm_buffer():
        if "buf" not in symm:  # allocated once per shape (a collective), like a real user would
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(M, N, dtype=dtype, device=dev)
            symm_mem.rendezvous(buf, group_name)
            symm["buf"] = buf
        return symm["buf"]

    def symm_one_shot(a, b):
        buf = symm_buffer()
        torch.mm(a, b, out=buf)
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)

    def symm_two_shot(a, b):
        buf = symm_buffer()
        torch.mm(a, b, out=buf)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
        return buf

    def ditron(params, norm):
        text = plan_text(params)
        if norm:
            return lambda a, b: torch.ops.ditron.matmul_all_reduce_rmsnorm(
                a, b, None, [], residual, weight, EPS, False, "sum", group_name, world, text)
        return lambda a, b: torch.ops.ditron.matmul_all_reduce(a, b, None, [], "sum",
                                                               group_name, world, text)

    def timed(name, fn, ref=None, pick=lambda out: out):
        def one():
            if ref is not None:
                check_close(f"{shape} {name}", pick(fn(*inputs[0])), ref)
            return bench(fn, inputs, args.iters, args.reps, label=name)
        return safe(name, one)

    from ditron_inductor.runtime.all_reduce import stats
    from ditron_inductor.scheduler.cost_model import ONE_SHOT_MAX_M

    forced = {"algo": "one_shot"} if M <= ONE_SHOT_MAX_M else {}  # {}: the runtime's defaults
    rows = []
    ref = nccl_cublas(*inputs[0])
    ms, plans = {}, {}
    HOST_MS.clear()
    ms["nccl_cublas"] = timed("nccl_cublas", nccl_cublas)
    ms["symm_one_shot"] = timed("symm_one_shot", symm_one_shot, ref)
    ms["symm_two_shot"] = timed("symm_two_shot", symm_two_shot, ref)
    ms["gemm_only"] = timed("gemm_only", gemm_only)
    ms["comm_only"] = timed("comm_only", comm_only)
    served = stats["matmul_all_reduce"]
    ms["ditron"] = timed("ditron", ditron(forced, False), ref)
    for label, params in EXTRA_PLANS.items():
        if params["algo"] == "one_shot" and M > ONE_SHOT_MAX_M:
            continue
        plans[label] = timed(label, ditron(params, False), ref)
    if stats["matmul_all_reduce"] == served:
        ms["ditron"] = float("nan")  # the fused path never served: do not report the fallback
    rows.append({"op": "matmul_all_reduce", "M": M, "K": K, "N": N, "world": world,
                 "dtype": args.dtype, "ms": ms, "plans": plans, "host_ms": dict(HOST_MS),
                 "chosen": str(forced or "default two_shot")})

    ref_y = unfused_norm(*inputs[0])[1]
    HOST_MS.clear()
    ms_n = {"nccl_cublas": timed("unfused", unfused_norm),
            "gemm_only": ms["gemm_only"], "comm_only": ms["comm_only"]}
    served = stats["matmul_all_reduce_rmsnorm"]
    ms_n["ditron"] = timed("ditron_norm", ditron(forced, True), ref_y, pick=lambda out: out[1])
    if stats["matmul_all_reduce_rmsnorm"] == served:
        ms_n["ditron"] = float("nan")
    rows.append({"op": "matmul_all_reduce_rmsnorm", "M": M, "K": K, "N": N, "world": world,
                 "dtype": args.dtype, "ms": ms_n, "plans": {}, "host_ms": dict(HOST_MS),
                 "chosen": str(forced or "default two_shot")})
    return rows


def write_table(rows, args, world):
    lines = [f"# GEMM + all-reduce on {world} GPUs ({args.dtype})", "",
             f"- command: `torchrun --nproc-per-node {world} benchmarks/bench_all_reduce.py "
             + " ".join(sys.argv[1:]) + "`",
             f"- torch {torch.__version__}, triton {__import__('triton').__version__}, "
             f"{torch.cuda.get_device_name()}", "",
             "Median ms per call (max over ranks); vs NCCL = NCCL+cuBLAS (unfused sequence for "
             "the RMSNorm rows) / ditron.", "",
             "| op | M | K | N | NCCL+cuBLAS | symm one-shot | symm two-shot | ditron | GEMM | "
             "AR | vs NCCL | plans |", "| --- " * 12 + "|"]
    speedups = []
    for r in rows:
        m = r["ms"]
        s = m["nccl_cublas"] / m["ditron"]
        speedups.append(s)
        cell = lambda key: f"{m[key]:.3f}" if key in m else "-"  # noqa: E731
        lines.append(f"| {r['op'].replace('matmul_', '')} | {r['M']} | {r['K']} | {r['N']} | "
                     f"{cell('nccl_cublas')} | {cell('symm_one_shot')} | {cell('symm_two_shot')} "
                     f"| {cell('ditron')} | {cell('gemm_only')} | {cell('comm_only')} | {s:.2f}x | "
                     + " ".join(f"{k}={v:.3f}" for k, v in r["plans"].items()) + " |")
    lines += ["", f"Geometric mean over NCCL+cuBLAS: {geomean(speedups):.3f}x"]
    text = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as fh:
        fh.write(text)
    with open(args.out + ".json", "w") as fh:
        json.dump({"rows": rows}, fh, indent=1)
    print(text, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ar_bench")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    import ditron_inductor.ops  # noqa: F401
    import ditron_inductor.runtime  # noqa: F401

    dtype = getattr(torch, args.dtype)
    rows, t0 = [], time.time()
    for shape in SUITE:
        new = run_shape(shape, dtype, group_name, world, args)
        rows += new
        if rank == 0:
            for r in new:
                print(f"{r['op']} {shape}: " + " ".join(f"{k}={v:.3f}" for k, v in r["ms"].items())
                      + " | " + " ".join(f"{k}={v:.3f}" for k, v in r["plans"].items())
                      + f" | host {r['host_ms']} ({time.time() - t0:.0f}s)", flush=True)
            with open(args.out + ".partial.json", "w") as fh:
                json.dump(rows, fh, indent=1)
    if rank == 0:
        write_table(rows, args, world)
    from ditron_inductor import runtime

    runtime.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
