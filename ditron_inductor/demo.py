"""Demo: a tensor-parallel transformer block compiled with `backend="ditron"`.

    python -m ditron_inductor.demo                  # CPU ranks over gloo (2), or one rank per GPU
    python -m ditron_inductor.demo --world-size 4 --device cpu

Launches its ranks (CPU + gloo by default; one per CUDA GPU over NCCL where there are at least
two), runs a small sequence-parallel attention + MLP block with DTensor's tensor-parallel plans
forward and backward, prints on rank 0 which subgraphs became which ditron op (and why the others
did not), and checks the output and every gradient against eager: the last line says PASS or
FAIL, and the exit code is non-zero on FAIL.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import multiprocessing as mp
import os
import sys
import time
import traceback

PASS_LINE = "PASS: compiled block matches eager (output, input grad, parameter grads)"
FAIL_PREFIX = "FAIL:"

# Model sizes: small enough for a 2-core machine.
DIM, HEAD_DIM, HIDDEN, BATCH, SEQ = 64, 16, 160, 2, 16


def build_block():
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = nn.RMSNorm(DIM)
            self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
            self.o = nn.Linear(DIM, DIM, bias=False)
            self.mlp_norm = nn.RMSNorm(DIM)
            self.gate = nn.Linear(DIM, HIDDEN, bias=False)
            self.up = nn.Linear(DIM, HIDDEN)
            self.down = nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            y = self.attn_norm(x)
            b, s, _ = y.shape
            q, k, v = (p(y).view(b, s, -1, HEAD_DIM).transpose(1, 2)
                       for p in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
            z = self.mlp_norm(h)
            return h + self.down(F.silu(self.gate(z)) * self.up(z))

    return Block()


def rank_main(rank: int, world_size: int, device: str, port: int, timeout_s: float) -> None:
    """One rank: exit code 0 (PASS), 1 (FAIL, said on rank 0) or 3 (an error, its traceback)."""
    faulthandler.enable(all_threads=True)  # a rank that aborts says where each thread was
    try:
        import torch
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        try:
            ok = run_block(rank, world_size, device)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(3)
    sys.exit(0 if ok else 1)


def run_block(rank: int, world_size: int, device: str) -> bool:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module)

    from ditron_inductor.lowering import graph_pass

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    torch.manual_seed(0)  # the same full weights and input on every rank
    mesh = DeviceMesh(device, list(range(world_size)))
    block = build_block().to(device)
    plan = {name: ColwiseParallel(input_layouts=Shard(1)) for name in ("q", "k", "v", "gate", "up")}
    plan.update({name: RowwiseParallel(output_layouts=Shard(1)) for name in ("o", "down")})
    plan.update({name: SequenceParallel() for name in ("attn_norm", "mlp_norm")})
    parallelize_module(block, mesh, plan)
    full_x = torch.randn(BATCH, SEQ, DIM, device=device)
    x = full_x.chunk(world_size, dim=1)[rank].contiguous()  # this rank's sequence shard
    grad_out = torch.randn(BATCH, SEQ, DIM, device=device).chunk(world_size, dim=1)[rank]

    def run(model):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.backward(grad_out)
        grads = {n: p.grad.full_tensor() for n, p in block.named_parameters()}
        return out.detach(), xi.grad, grads

    say(f"ditron demo: {world_size} ranks, {device} + {'nccl' if device == 'cuda' else 'gloo'}, "
        f"block dim={DIM} hidden={HIDDEN} heads={DIM // HEAD_DIM}, tokens {BATCH}x{SEQ} "
        f"(sequence-parallel)")
    t0 = time.perf_counter()
    first = len(graph_pass.reports)
    compiled = torch.compile(block, backend="ditron")
    out_c, xg_c, pg_c = run(compiled)
    t_compile = time.perf_counter() - t0
    reports = list(graph_pass.reports)[first:]
    out_e, xg_e, pg_e = run(block)

    fused = 0
    say(f"\ncompiled forward + backward in {t_compile:.1f} s; collective + matmul candidates:")
    for report in reports:
        say(f"  graph {report.graph}: {report.summary()}")
        for c in report.candidates:
            fused += c.fused
            layers = f"  [layer {', '.join(c.layers)}]" if c.layers else ""
            if c.fused:
                say(f"    FUSED     {c.task}{layers}\n"
                    f"              -> torch.ops.ditron.{c.task.split()[0]}, plan: {c.plan} "
                    f"({c.reason})")
            else:
                say(f"    not fused {c.task}{layers}\n              reason: {c.reason}")
    if not reports:
        say("  (none: no graph was compiled)")

    rtol, atol = (1e-4, 1e-5) if device == "cpu" else (1e-3, 1e-4)
    problems = []
    for what, got, want in ([("output", out_c, out_e), ("input grad", xg_c, xg_e)]
                            + [(f"grad of {n}", pg_c[n], pg_e[n]) for n in pg_e]):
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as e:
            problems.append(f"rank {rank}: {what}: {str(e).splitlines()[0]}")
    everyone = [None] * world_size
    dist.all_gather_object(everyone, problems)
    problems = [p for ps in everyone for p in ps]
    say(f"\n{fused} subgraph(s) became ditron ops on rank 0; checked output, input grad and "
        f"{len(pg_e)} parameter grads on {world_size} ranks (rtol={rtol}, atol={atol})")
    if problems:
        say("\n".join(problems))
        say(f"{FAIL_PREFIX} compiled block differs from eager ({len(problems)} mismatches)")
        return False
    say(PASS_LINE)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ditron_inductor.demo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cpu: gloo ranks; cuda: one NCCL rank per GPU; auto: cuda when at "
                             "least 2 GPUs are present, else cpu")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (default: 2 on cpu, every GPU on cuda)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    args = parser.parse_args(argv)

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus >= 2 else "cpu")
    if device == "cuda" and gpus == 0:
        parser.error("--device cuda: no CUDA GPU is present")
    world_size = args.world_size or (gpus if device == "cuda" else 2)
    if device == "cuda" and world_size > gpus:
        parser.error(f"--world-size {world_size}: only {gpus} GPUs are present")
    for size, what in ((DIM // HEAD_DIM, "heads"), (HIDDEN, "hidden"), (SEQ, "sequence")):
        if size % world_size:
            parser.error(f"--world-size {world_size} does not divide the {what} ({size})")

    # A cached graph skips the pass and so its report; one compile thread per rank.
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    if device == "cpu":
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    import torch.distributed as dist

    # The launcher hosts the rendezvous store on a port the OS picks.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world_size, device, store.port, args.timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(2)  # let the others report, then stop them
            break
        time.sleep(0.2)
    timed_out = any(p.is_alive() for p in procs) and time.monotonic() >= deadline
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if timed_out:
        print(f"{FAIL_PREFIX} timed out after {args.timeout:.0f} s (exit codes {codes})", flush=True)
        return 2
    if any(codes):
        if codes[0] != 1:  # rank 0 did not print the verdict
            print(f"{FAIL_PREFIX} ranks exited with codes {codes}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
