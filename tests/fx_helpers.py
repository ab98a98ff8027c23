"""Building and printing small post-grad-like graphs for the pass's unit tests.

Graphs are traced with make_fx on fake tensors under a fake process group, with Inductor's
decompositions, so they hold the same ATen ops as Inductor's post-grad graphs without compiling
any kernel; `dynamo_graph` captures the graph dynamo hands a backend instead (the rewrites run
before AOTAutograd).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.testing._internal.distributed.fake_pg import FakeStore


def dynamo_graph(fn, *args, dynamic: bool = False) -> tuple[torch.fx.GraphModule, list]:
    """The graph and example inputs dynamo passes a backend for fn(*args)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True, dynamic=dynamic)(*args)
    return captured[0]


def checked_rewrite(rewrite, fn, *args) -> tuple[Any, torch.fx.GraphModule]:
    """(what `rewrite` returns, the graph it rewrote in place): dynamo's graph of fn(*args),
    after checking that the rewritten graph computes what the original did on the same inputs."""
    gm, inputs = dynamo_graph(fn, *args)
    before = gm(*inputs)
    result = rewrite(gm)
    after = gm(*inputs)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return result, gm


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0):
    """The default process group, faked: collectives trace but move no data."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def trace(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*args)


def trace_data_dependent(fn, *args) -> torch.fx.GraphModule:
    """`trace` with a shape environment: `.tolist()` / `.item()` give unbacked SymInts, as Dynamo
    leaves them under `capture_scalar_outputs`, while the inputs' shapes stay static."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
             for a in args]
    with mode:
        return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*fakes)


def _short(target) -> str:
    if target is operator.getitem:
        return "getitem"
    if not isinstance(target, torch._ops.OperatorBase):  # a Python function: torch.sym_sum
        return getattr(target, "__name__", str(target))
    name = str(target)
    for prefix in ("aten.", "_c10d_functional.", "ditron."):
        if name.startswith(prefix):
            return name[len(prefix):].removesuffix(".default")
    return name


def _arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    return repr(a)


def graph_text(gm: torch.fx.GraphModule) -> str:
    """One line per call: `name = op(args)`, with op names short and nodes by name."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            lines.append(f"{node.name} = {_short(node.target)}({', '.join(_arg(a) for a in node.args)})")
        elif node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
    return "\n".join(lines) + "\n"


# torch 2.13 renamed these; the ops they put in graphs are the same.
all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
all_reduce = funcol.all_reduce
all_to_all = funcol.all_to_all_single
