"""A program that compiles a tensor-parallel layer pair with ditron and then shuts down one way:

    python -m tests.exit_program --shutdown destroy|none|runtime [--device cuda]
        [--workload train|infer] [--async-tp]

train: a sequence-parallel pair, forward and backward (all-gather and reduce-scatter ops); infer:
a plain TP pair under `mode="reduce-overhead"` without gradients (the all-reduce op, captured in
CUDA graphs on GPUs), as prefill runs it. --async-tp (CUDA): a second copy of the pair compiled
by Inductor with PyTorch's async TP (symmetric memory enabled for the group), run as the first:
the mix of e2e_llama.py's contenders in one process.

destroy: `destroy_process_group()` then exit; none: exit with the process group alive; runtime:
`ditron_inductor.runtime.shutdown()`, then `destroy_process_group()`. Each rank prints how many
ditron ops its graphs hold; the launcher exits with the first non-zero rank exit code (a rank
that aborts at exit shows here), or 2 when a rank is still running after --timeout (a hang),
after it asked that rank for the Python stack of each of its threads (SIGUSR1, `faulthandler`):
where the exit waits. The exit tests run it with the ditron log on.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import time


def rank_main(rank: int, world: int, port: int, device: str, shutdown: str,
              workload: str, async_tp: bool) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher's question on a hang
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch._inductor import list_mode_options
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)

    from ditron_inductor.lowering import graph_pass

    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    pair = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False))
    pair = pair.to(device=device, dtype=dtype)
    mesh = DeviceMesh(device, list(range(world)))
    if workload == "train":
        parallelize_module(pair, mesh, {"0": ColwiseParallel(input_layouts=Shard(0)),
                                        "1": RowwiseParallel(output_layouts=Shard(0))})
        compiled = torch.compile(pair, backend="ditron", options={"ditron.plan": "fused"})
        x = torch.randn(256, 256, device=device, dtype=dtype, requires_grad=True)
        for _ in range(2):
            compiled(x).float().sum().backward()
    else:  # torch.compile takes a mode or options, not both
        parallelize_module(pair, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        options = {"ditron.plan": "fused", **list_mode_options("reduce-overhead")}
        runs = [torch.compile(pair, backend="ditron", options=options)]
        if async_tp:
            import torch.distributed._symmetric_memory as symm_mem

            symm_mem.enable_symm_mem_for_group(mesh.get_group().group_name)
            runs.append(torch.compile(pair, options={**list_mode_options("reduce-overhead"),
                                                     "_micro_pipeline_tp": True}))
        x = torch.randn(64, 256, device=device, dtype=dtype)
        with torch.no_grad():
            for run in runs:
                for _ in range(3):  # warm-up, record, replay
                    run(x)
    if device == "cuda":
        torch.cuda.synchronize()
    fused = sum(c.fused for r in graph_pass.reports for c in r.candidates)
    print(f"rank {rank}: {fused} ditron ops", flush=True)
    if shutdown == "runtime" and "ditron_inductor.runtime" in sys.modules:
        sys.modules["ditron_inductor.runtime"].shutdown()
    if shutdown in ("destroy", "runtime"):
        dist.destroy_process_group()
    sys.exit(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shutdown", choices=["destroy", "none", "runtime"], default="destroy")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workload", choices=["train", "infer"], default="train")
    parser.add_argument("--async-tp", action="store_true",
                        help="infer on CUDA: also the pair under Inductor's async TP")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args(argv)
    if args.async_tp and (args.device, args.workload) != ("cuda", "infer"):
        parser.error("--async-tp: with --device cuda --workload infer only (symmetric memory)")

    import torch.distributed as dist

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, args.world_size + 1, is_master=True,
                          wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args.world_size, store.port, args.device,
                                                 args.shutdown, args.workload, args.async_tp))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:  # its threads' stacks to stderr, then the kill
        os.kill(procs[r].pid, signal.SIGUSR1)
    if hung:
        time.sleep(5)
    for r in hung:
        procs[r].kill()
        procs[r].join()
    codes = [p.exitcode for p in procs]
    print(f"exit codes {codes}" + (f"; ranks {hung} still running after {args.timeout:.0f} s"
                                    if hung else ""), flush=True)
    if hung:
        return 2
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
