"""GEMM + all-reduce (+ residual + RMSNorm) benchmark: every contender side by side on W GPUs.

    torchrun --nproc-per-node 8 benchmarks/bench_all_reduce.py --out benchmarks/results/all_reduce_h200x8_<variant measured>

Per shape (M, K per rank, N; bf16 unless --dtype), op "matmul_all_reduce":
  nccl_cublas       a @ b, then NCCL all-reduce
  symm_one_shot     a @ b written into a symm_mem buffer, torch.ops.symm_mem.one_shot_all_reduce
  symm_two_shot     the same with torch.ops.symm_mem.two_shot_all_reduce_ (in place)
  ditron            torch.ops.ditron.matmul_all_reduce with the fused plan the runtime picks
                    unprompted (the scheduler's all_reduce_params), and every plan in EXTRA_PLANS
                    for calibration
  gemm_only, comm_only (and from M=512 gemm_triton_only: the persistent Triton GEMM on the SMs
  that push beside it leaves)
and op "matmul_all_reduce_rmsnorm": nccl_cublas = the unfused sequence (cuBLAS, NCCL, + residual,
RMSNorm in eager torch ops), nccl_inductor = the same with the residual add and norm compiled by
Inductor (one fused kernel, what a compiled model without ditron runs), vs ditron's fused op.
Timing and the JSON/markdown row format are bench_fused.py's (imported): {op, M, K, N, world,
dtype, ms: {...}, plans: {...}, host_ms}, plus graph_ms: the same contenders timed as CUDA-graph replays (bench_fused.bench_graph), where decode
steps are served and the host's launch cost is gone; plans hold {eager, graph} per candidate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_fused import (  # noqa: E402
    HOST_MS,
    bench,
    bench_graph,
    check_close,
    geomean,
    plan_text,
    safe,
)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SUITE = [(m, k, 8192) for k in (3584, 1024) for m in (2048, 8192, 128, 32, 1)]
EXTRA_PLANS = {  # label -> (plan params, rows it applies to), measured for calibration
    # (the push beside cuBLAS's row chunks, slower everywhere but at M=8192, gave way to the
    # prefill plans at the end; docs/performance.md)
    "push_b256": (dict(algo="push", block=256), lambda m: 8 < m <= 128),
    "push_b512": (dict(algo="push", block=512), lambda m: 8 < m <= 256),
    "push_b1024": (dict(algo="push", block=1024), lambda m: 8 < m <= 2048),
    "push_b2048": (dict(algo="push", block=2048), lambda m: 256 <= m),
    "push_b4096": (dict(algo="push", block=4096, warps=8), lambda m: m >= 128),
    "all": (dict(algo="push_all"), lambda m: m <= 32),
    "lamport": (dict(algo="lamport"), lambda m: m <= 2048),
    "lamport_all": (dict(algo="lamport_all"), lambda m: m <= 32),  # push_all with the empty mark
    "lamport_b512": (dict(algo="lamport", block=512), lambda m: 8 < m <= 256),
    # the decode kernels' blocks of 1024 (at every decode M of N 4096 / 8192, then a barrier and
    # a second pass for the norm): the one-shots' before runtime decode_grid gave them a row a
    # block, the two-shot's still
    "lamport_b1024": (dict(algo="lamport", block=1024), lambda m: 8 < m <= 256),
    "lamport_all_b1024": (dict(algo="lamport_all", block=1024), lambda m: m <= 32),
    "all_b1024": (dict(algo="push_all", block=1024), lambda m: m <= 32),
    "lamport_all_b1024_gemv": (dict(algo="lamport_all", block=1024, gemm="gemv"),
                               lambda m: m == 1),
    "all_b1024_gemv": (dict(algo="push_all", block=1024, gemm="gemv"), lambda m: m == 1),
    "lamport_b4096": (dict(algo="lamport", block=4096, warps=8), lambda m: m >= 128),
    "push": (dict(algo="push"), lambda m: m <= 8),
    # prefill: push on few SMs alone, and beside the GEMM (cuBLAS row chunks, or the persistent
    # Triton GEMM raising READY per chunk on the other SMs). 8-warp programs (push_p32,
    # tri_c8_p32; other 8-warp variants were slower still): NVLink-latency-bound on few SMs
    # (all_reduce_h200x4_overlap_triton_gemm_8warps.md); 32 warps and blocks of 16384 (*_b16k) hold 4x the bytes in flight
    "push_p32": (dict(algo="push", progs=32), lambda m: m >= 1024),
    "tri_c8_p32": (dict(algo="push", overlap=True, gemm="triton", chunks=8, progs=32),
                   lambda m: m >= 512),
    # after the GEMM with 2x / 4x the bytes in flight of push_b4096 (the norm's rows: 2 / 4 a
    # block at N = 4096)
    "push_b8k": (dict(algo="push", block=8192, warps=16), lambda m: m >= 1024),
    "push_b16k": (dict(algo="push", block=16384, warps=32), lambda m: m >= 1024),
    "push_p16_b16k": (dict(algo="push", progs=16, block=16384, warps=32), lambda m: m >= 1024),
    "push_p32_b16k": (dict(algo="push", progs=32, block=16384, warps=32), lambda m: m >= 1024),
    "tri_c8_p16_b16k": (dict(algo="push", overlap=True, gemm="triton", chunks=8, progs=16,
                             block=16384, warps=32), lambda m: m >= 1024),
    "tri_c8_p32_b16k": (dict(algo="push", overlap=True, gemm="triton", chunks=8, progs=32,
                             block=16384, warps=32), lambda m: m >= 1024),
    "tri_c16_p16_b16k": (dict(algo="push", overlap=True, gemm="triton", chunks=16, progs=16,
                              block=16384, warps=32), lambda m: m >= 1024),
    "lap_c4_p16_b16k": (dict(algo="push", overlap=True, chunks=4, progs=16, block=16384,
                             warps=32), lambda m: m >= 1024),
    "tri_c16_p16_b16k_bn128": (dict(algo="push", overlap=True, gemm="triton", chunks=16,
                                    progs=16, block=16384, warps=32, gemm_block_n=128),
                               lambda m: m >= 1024),
    "tri_c16_p16_b16k_s4": (dict(algo="push", overlap=True, gemm="triton", chunks=16, progs=16,
                                 block=16384, warps=32, gemm_stages=4), lambda m: m >= 1024),
    "tri_c16_p16_b16k_w4": (dict(algo="push", overlap=True, gemm="triton", chunks=16, progs=16,
                                 block=16384, warps=32, gemm_block_n=128, gemm_warps=4),
                            lambda m: m >= 1024),
    "tri_c16_p8_b16k": (dict(algo="push", overlap=True, gemm="triton", chunks=16, progs=8,
                             block=16384, warps=32), lambda m: m >= 1024),
    "tri_c32_p16_b16k": (dict(algo="push", overlap=True, gemm="triton", chunks=32, progs=16,
                              block=16384, warps=32), lambda m: m >= 1024),
    # cuBLAS row chunks on every SM, each chunk's partial copied to every peer by the copy
    # engine beside the next chunk's GEMM, then one kernel sums, adds the residual, normalises
    "ce_c2": (dict(algo="copy_engine", chunks=2), lambda m: m >= 512),
    "ce_c4": (dict(algo="copy_engine", chunks=4), lambda m: m >= 512),
    "ce_c8": (dict(algo="copy_engine", chunks=8), lambda m: m >= 512),
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

    def residual_norm(s, res, w):
        h = s + res
        return h, _rmsnorm(h, w)

    inductor_tail = torch.compile(residual_norm)  # one fused Inductor kernel, as a compiled model

    def nccl_inductor_norm(a, b):
        return inductor_tail(nccl_cublas(a, b), residual, weight)

    def gemm_only(a, b):
        return a @ b

    def gemm_triton_only(a, b):  # the persistent Triton GEMM on the SMs push beside it leaves
        from ditron_inductor.runtime.launch import num_sms, triton_gemm
        from ditron_inductor.scheduler.plan import GemmTile

        out = torch.empty(M, N, device=dev, dtype=dtype)
        return triton_gemm(a, b, None, out, GemmTile(), num_progs=num_sms(a.device) - 32)

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
        text = plan_text("matmul_all_reduce_rmsnorm", world, shape, params)
        if norm:
            return lambda a, b: torch.ops.ditron.matmul_all_reduce_rmsnorm(
                a, b, None, [], residual, weight, EPS, False, "sum", group_name, world, text)
        return lambda a, b: torch.ops.ditron.matmul_all_reduce([a], [b], None, [], "sum",
                                                               group_name, world, text)

    def timed(name, fn, ref=None, pick=lambda out: out):
        """(eager ms, CUDA-graph ms) of one contender, checked against the reference first."""
        t0 = time.time()

        def one():
            if ref is not None:  # a failing rank skips the contender on every rank
                failed = None
                try:
                    out = pick(fn(*inputs[0]))
                except Exception as exc:  # noqa: BLE001 - made collective below
                    out, failed = ref, exc
                flag = torch.tensor([failed is not None], device="cuda", dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank skips, or none
                if flag.item():
                    raise RuntimeError(f"a rank failed: {failed}")
                check_close(f"{shape} {name}", out, ref)
            return bench(fn, inputs, args.iters, args.reps, label=name)
        eager = safe(name, one)
        graph = safe(name + " (graph)", bench_graph, fn, inputs, args.iters, args.reps)
        if dist.get_rank() == 0 and args.verbose:
            print(f"  {shape} {name}: {eager:.3f} / {graph:.3f} ms ({time.time() - t0:.1f} s)",
                  flush=True)
        return eager, graph

    from ditron_inductor.runtime.all_reduce import stats

    def measure(contenders, op, plans_too):
        """rows' ms (eager) and graph_ms dicts; ditron is NaN where the fused path never served."""
        ms, graph_ms, plans = {}, {}, {}
        HOST_MS.clear()
        for name, (fn, ref, pick) in contenders.items():
            served = stats[op]
            ms[name], graph_ms[name] = timed(name, fn, ref, pick)
            if name == "ditron" and stats[op] == served:
                ms[name] = graph_ms[name] = float("nan")  # never report the fallback as ditron
        for label, (params, applies) in EXTRA_PLANS.items():
            if plans_too and applies(M) and (not args.plans or label in args.plans.split(",")):
                eager, graph = timed(label, ditron(params, op.endswith("rmsnorm")), *ref_of[op])
                plans[label] = {"eager": eager, "graph": graph}
        return ms, graph_ms, plans

    ref = nccl_cublas(*inputs[0])
    ref_y = unfused_norm(*inputs[0])[1]
    ref_of = {"matmul_all_reduce": (ref, lambda out: out),
              "matmul_all_reduce_rmsnorm": (ref_y, lambda out: out[1])}
    same = (None, lambda out: out)
    rows = []
    # ditron = the plan the runtime picks without being told (the scheduler's all_reduce_params)
    ms, graph_ms, plans = measure({
        "nccl_cublas": (nccl_cublas, None, same[1]),
        "symm_one_shot": (symm_one_shot, ref, same[1]),
        "symm_two_shot": (symm_two_shot, ref, same[1]),
        "gemm_only": (gemm_only, *same),
        **({"gemm_triton_only": (gemm_triton_only, *same)} if M >= 512 else {}),
        "comm_only": (comm_only, *same),
        "ditron": (ditron({}, False), *ref_of["matmul_all_reduce"]),
    }, "matmul_all_reduce", True)
    rows.append({"op": "matmul_all_reduce", "M": M, "K": K, "N": N, "world": world,
                 "dtype": args.dtype, "ms": ms, "graph_ms": graph_ms, "plans": plans,
                 "host_ms": dict(HOST_MS)})
    ms_n, graph_n, plans_n = measure({
        "nccl_cublas": (unfused_norm, None, same[1]),
        "nccl_inductor": (nccl_inductor_norm, *ref_of["matmul_all_reduce_rmsnorm"]),
        "ditron": (ditron({}, True), *ref_of["matmul_all_reduce_rmsnorm"]),
    }, "matmul_all_reduce_rmsnorm", M <= 2048 or bool(args.plans))
    for key in ("gemm_only", "comm_only"):
        ms_n[key], graph_n[key] = ms[key], graph_ms[key]
    rows.append({"op": "matmul_all_reduce_rmsnorm", "M": M, "K": K, "N": N, "world": world,
                 "dtype": args.dtype, "ms": ms_n, "graph_ms": graph_n, "plans": plans_n,
                 "host_ms": dict(HOST_MS)})
    return rows


COLUMNS = [("nccl_cublas", "NCCL+cuBLAS"), ("nccl_inductor", "NCCL+cuBLAS, Inductor norm"),
           ("symm_one_shot", "symm one-shot"),
           ("symm_two_shot", "symm two-shot"), ("ditron", "ditron"), ("gemm_only", "GEMM"),
           ("comm_only", "AR")]


def table(rows, key, title):
    """One markdown table of the rows' `key` timings ("ms": eager, "graph_ms": CUDA graph)."""
    lines = [f"## {title}", "", "| op | M | K | N | " + " | ".join(c for _, c in COLUMNS)
             + " | vs NCCL | vs Inductor norm | bound/ditron | plans |",
             "| --- " * (len(COLUMNS) + 8) + "|"]
    speedups = {}
    for r in rows:
        m = r[key]
        s = m["nccl_cublas"] / m["ditron"]
        speedups.setdefault(r["op"], []).append(s)
        s_ind = f"{m['nccl_inductor'] / m['ditron']:.2f}x" if "nccl_inductor" in m else "-"
        if "nccl_inductor" in m:
            speedups.setdefault(r["op"] + " (vs Inductor norm)", []).append(
                m["nccl_inductor"] / m["ditron"])
        bound = max(m.get("gemm_only", float("nan")), m.get("comm_only", float("nan")))
        sub = "eager" if key == "ms" else "graph"
        lines.append(f"| {r['op'].replace('matmul_', '')} | {r['M']} | {r['K']} | {r['N']} | "
                     + " | ".join(f"{m[c]:.3f}" if c in m else "-" for c, _ in COLUMNS)
                     + f" | {s:.2f}x | {s_ind} | {bound / m['ditron']:.2f} | "
                     + " ".join(f"{k}={v[sub]:.3f}" for k, v in r["plans"].items()) + " |")
    lines.append("")
    for op, values in speedups.items():
        lines.append(f"Geometric mean over NCCL+cuBLAS, {op}: {geomean(values):.3f}x")
    return lines


def write_table(rows, args, world):
    lines = [f"# GEMM + all-reduce on {world} GPUs ({args.dtype})", "",
             f"- command: `torchrun --nproc-per-node {world} benchmarks/bench_all_reduce.py "
             + " ".join(sys.argv[1:]) + "`",
             f"- torch {torch.__version__}, triton {__import__('triton').__version__}, "
             f"{torch.cuda.get_device_name()}", "",
             "Median ms per call (max over ranks). all_reduce rows: a @ b then the all-reduce; "
             "all_reduce_rmsnorm rows: then + residual and RMSNorm, NCCL+cuBLAS being the unfused "
             "sequence (cuBLAS, NCCL, eager torch ops), and NCCL+cuBLAS, Inductor norm the same "
             "with the residual add and norm compiled by Inductor (one kernel, as in a compiled "
             "model). ditron = the plan the runtime picks "
             "unprompted; plans = every candidate, for calibration. bound = max(GEMM, AR).", ""]
    lines += table(rows, "ms", "Eager (host launches every call)") + [""]
    lines += table(rows, "graph_ms", f"CUDA graph ({args.iters} calls captured, replayed)")
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
    ap.add_argument("--verbose", action="store_true", help="one line per contender (rank 0)")
    ap.add_argument("--ms", default="", help="these M instead of the suite's, e.g. 1,256")
    ap.add_argument("--cols", type=int, default=8192, help="N with --ms (Llama-3-8B: 4096)")
    ap.add_argument("--ks", default="", help="only these K per rank, e.g. 3584")
    ap.add_argument("--plans", default="", help="only these EXTRA_PLANS labels, e.g. push_p16")
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
    only = lambda text: {int(x) for x in text.split(",") if x}  # noqa: E731
    ms, ks = only(args.ms), only(args.ks)
    shapes = ([(m, k, args.cols) for k in sorted(ks or {3584, 1024}, reverse=True)
               for m in sorted(ms)] if ms else [s for s in SUITE if not ks or s[1] in ks])
    for shape in shapes:
        new = run_shape(shape, dtype, group_name, world, args)
        rows += new
        if rank == 0:
            for r in new:
                print(f"{r['op']} {shape}: eager "
                      + " ".join(f"{k}={v:.3f}" for k, v in r["ms"].items()) + " | graph "
                      + " ".join(f"{k}={v:.3f}" for k, v in r["graph_ms"].items()) + " | plans "
                      + " ".join(f"{k}={v['eager']:.3f}/{v['graph']:.3f}"
                                 for k, v in r["plans"].items())
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
