"""On one GPU: a bounded wait whose flag never comes reports on the host without a
synchronisation, eagerly and replayed from a CUDA graph; the call's check raises WaitTimeout
naming the flag (and, eagerly, the call site); a process whose host then blocks is ended by the watcher (runtime/faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests import REPO_ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SITE = "layers.0.self_attn.q_proj (graph 0/0 forward)"
PROGRAM = r"""
import socket, time
import torch, torch.distributed as dist
from ditron_inductor.runtime import faults, launch
from ditron_inductor.runtime.context import get_context
from ditron_inductor.scheduler.plan import AllGatherPlan
from tests.gpu.test_wait_bound_gpu import SITE

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
ctx = get_context("all_gather_matmul", dist.group.WORLD.group_name, "auto", 1 << 20)
plan = AllGatherPlan(wait_timeout_s=0.2)
sited = AllGatherPlan(wait_timeout_s=0.2, site=SITE)  # a site's own error words, eagerly
stream = torch.cuda.current_stream().cuda_stream
ctx.flags.words[ctx.READY] = 1  # epoch 1 is there; nobody signals epoch 2
launch.wait_geq(ctx, plan, stream, ctx.READY, 1)  # compiles the kernel
torch.cuda.synchronize()
assert not faults.failed()
for how in ("eager", "graph"):
    if how == "graph":
        faults.report().zero_(); ctx.err[0] = 0; torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch.wait_geq(ctx, plan, torch.cuda.current_stream().cuda_stream, ctx.READY, 2)
        start = time.monotonic(); graph.replay()
    else:
        start = time.monotonic(); launch.wait_geq(ctx, sited, stream, ctx.READY, 2)
    while not faults.failed() and time.monotonic() < start + 30:
        time.sleep(0.005)  # no synchronisation: the report is host memory
    print(f"{how}: reported after {time.monotonic() - start:.2f} s", flush=True)
    try:
        launch.check_errors(ctx, sited if how == "eager" else plan, "all_gather_matmul")
        print(f"{how}: no error")
    except faults.WaitTimeout as e:
        print(f"{how}: WaitTimeout: {e}", flush=True)
    torch.cuda.synchronize()
faults.report().zero_(); ctx.err[0] = 0; torch.cuda.synchronize()
faults.watch(grace_s=0.5)
launch.check_errors(ctx, plan, "all_gather_matmul")  # notes the op, as every call does
launch.wait_geq(ctx, plan, stream, ctx.READY, 3)
torch.cuda.synchronize()
time.sleep(60)  # a host blocked elsewhere: the watcher ends the process
print("not ended", flush=True)
"""


def test_a_wait_that_gives_up_reports_raises_and_ends_the_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=env, timeout=300)
    print(proc.stdout, proc.stderr[-3000:])
    from ditron_inductor.runtime import faults

    assert proc.returncode == faults.EXIT_CODE, proc.stderr[-3000:]
    for how in ("eager", "graph"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"{how}: reported"))
        assert float(line.split()[-2]) < 5.0, line  # the bound, 0.2 s, plus slack
        where = f" at {SITE}" if how == "eager" else ""  # the graph's call names no site
        assert (f"{how}: WaitTimeout: ditron: all_gather_matmul{where} on rank 0 of 1: a wait on "
                "READY of rank 0") in proc.stdout
        assert "gave up after 0.2 s (it saw epoch 1, expected 2)" in proc.stdout
    assert "a wait on READY of rank 0" in proc.stderr  # the watcher's message
    assert "not ended" not in proc.stdout
