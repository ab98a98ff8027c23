"""The MoE ops' fused grouped GEMM vs the reference on one GPU (world size 1, one spawned rank):
bf16 and fp16, random data, odd routings (an expert with no rows, every row to one expert, row
counts no multiple of the tile, top-1 and top-2, 0 tokens), each tile of the benchmark, the
dispatch (gather + gate and up) and the combine (scatter, with and without accumulation, and
without an index), the TMA weights, and both ops captured in a CUDA graph and replayed. Every
case asserts that the fused path served it.

On 2 or more GPUs, `test_moe_multi_rank` runs the multi-rank dispatch (runtime/moe_dispatch.py;
passed on 2x H100, and with the route kernels on 2 and 4 of 4x H100, 2026-11-27) and combine
(runtime/moe_combine.py; passed on 2x H200, and with the route kernels 48 calls with stream waits
on 2x H100, 2026-11-27) on 2 ranks (and on every GPU when there are more than 2): several
consecutive calls on the same symmetric buffers, each routing drawn anew (random, an expert of every
rank without rows, the last rank receiving nothing, every row to rank 0; the combine sends the rows
back along the same routing), against the reference's NCCL all-to-all and torch._grouped_mm. The
dispatch and combine with bounded waits unless DITRON_TEST_WAIT_S=0 (a row that never lands
fails the test instead of hanging it; the dispatch: 96 calls passed on 2 and 4 H100s; the combine:
5 of 5 runs of 48 calls on 2x H100 since kernel_launch.stream_of, before which its first call read
rows before they landed, 2026-11-27; with stream waits 48 calls on 4 of 4x H100 too).

Run on the GPU machine: pytest -m gpu tests/gpu/test_moe_gpu.py
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch

from .ranks import report_and_close, spawn_ranks
from .test_fused_gpu import _check, _free_port, _rel

pytestmark = pytest.mark.gpu

POINTERS = dict(tma_a=False, tma_b=False)
TILES = ({},  # the default: 128 x 256, rows and weights through TMA descriptors
         dict(block_n=128, **POINTERS),
         dict(block_m=64, block_n=128, stages=4, warps=4, **POINTERS),
         dict(block_m=16, block_n=32, block_k=32, stages=2, warps=4, progs=7, **POINTERS),
         dict(block_n=128, tma_a=False), dict(block_m=64, block_n=64, block_k=64, warps=4),
         dict(block_n=128))


def _plan(op, **params):
    from ditron_inductor.scheduler.decide import plan_for
    from ditron_inductor.scheduler.task import Task

    task = Task(op=op, group_name="", world_size=1, m=0, k=0, ns=(0,), dtype=torch.bfloat16,
                device_type="cuda")
    return plan_for(task, **params).encode()


def _routing(tokens, experts, top_k, case, gen):
    if case == "one_expert":
        chosen = torch.stack([torch.arange(top_k) for _ in range(tokens)]).reshape(-1) + 1
        chosen %= experts
    else:
        chosen = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
        if case == "empty_expert":
            chosen = torch.where(chosen == 0, experts - 1, chosen)
            chosen = torch.where(chosen == 0, experts - 1, chosen)
        chosen = chosen.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=experts)
    return order, torch.cumsum(counts, 0).to(torch.int32)


def _cases(group_name, dtype, gen):
    from ditron_inductor.ops import (
        all_to_all_grouped_mm_reference,
        grouped_mm_all_to_all_reference,
    )
    from ditron_inductor.runtime.moe import stats
    from ditron_inductor.scheduler.task import ALL_TO_ALL_GROUPED_MM, GROUPED_MM_ALL_TO_ALL

    dev = torch.device("cuda")
    ops = torch.ops.ditron
    count = 0
    # every tile on the first case, the default tile on the others (each (tile, experts rounded
    # up to a power of 2, dtype, variant) is one more kernel to compile)
    for tokens, experts, top_k, k, n, case in (
            (37, 4, 2, 256, 384, "empty_expert"), (300, 8, 2, 512, 264, "random"),
            (129, 8, 1, 128, 136, "random"), (64, 8, 2, 512, 1024, "one_expert"),
            (1000, 32, 8, 1024, 512, "random"), (0, 4, 2, 128, 128, "random")):
        order, offsets = _routing(tokens, experts, top_k, case, gen)
        order, offsets = order.to(dev), offsets.to(dev)
        row_index = order // top_k
        rows = tokens * top_k
        x = torch.randn(tokens, k, device=dev, dtype=dtype)
        gate = (torch.randn(experts, n, k, device=dev, dtype=dtype) / k ** 0.5).transpose(-2, -1)
        up = torch.randn(experts, k, n, device=dev, dtype=dtype) / k ** 0.5
        down = (torch.randn(experts, k, n, device=dev, dtype=dtype) / n ** 0.5).transpose(-2, -1)
        h = torch.randn(rows, n, device=dev, dtype=dtype)
        for tile in (TILES if count == 0 else TILES[:1]):
            tag = f"tokens={tokens} E={experts} top{top_k} k={k} n={n} {case} {dtype} {tile}"
            plan = _plan(ALL_TO_ALL_GROUPED_MM, **tile)
            served = stats[ALL_TO_ALL_GROUPED_MM]
            args = (x, [tokens], [tokens], row_index, [gate, up], offsets, group_name, 1)
            out = ops.all_to_all_grouped_mm(*args, plan)
            assert stats[ALL_TO_ALL_GROUPED_MM] == served + 1, f"{tag}: dispatch not fused"
            if not rows:  # no token: empty outputs (the reference's collectives not run)
                assert [tuple(o.shape) for o in out] == [(0, k), (0, n), (0, n)], tag
                count += 1
                continue
            ref = all_to_all_grouped_mm_reference(*args)
            assert torch.equal(out[0], ref[0]), f"{tag}: rows differ"
            if rows:
                for o, r in zip(out[1:], ref[1:]):
                    _check(f"dispatch {tag}", o, r)
            for index, accumulate, sent in ((row_index, True, tokens), (order, False, rows),
                                            (None, False, rows)):
                served = stats[GROUPED_MM_ALL_TO_ALL]
                args = ([h], [down], offsets, index, accumulate, [sent], [sent], group_name, 1)
                out = ops.grouped_mm_all_to_all(*args, _plan(GROUPED_MM_ALL_TO_ALL, **tile))
                ref = grouped_mm_all_to_all_reference(*args)
                assert stats[GROUPED_MM_ALL_TO_ALL] == served + 1, f"{tag}: combine not fused"
                _check(f"combine index={index is not None} acc={accumulate} {tag}", out, ref)
            count += 1
    return count


def _graph_case(group_name, gen):
    """The dispatch and the combine captured in one CUDA graph and replayed on new inputs
    copied into the captured ones (no host value is baked into the fused path)."""
    from ditron_inductor.ops import (
        all_to_all_grouped_mm_reference,
        grouped_mm_all_to_all_reference,
    )
    from ditron_inductor.runtime.moe import stats
    from ditron_inductor.scheduler.task import ALL_TO_ALL_GROUPED_MM, GROUPED_MM_ALL_TO_ALL

    dev, dtype = torch.device("cuda"), torch.bfloat16
    tokens, experts, top_k, k, n = 200, 8, 2, 512, 384
    order, offsets = _routing(tokens, experts, top_k, "empty_expert", gen)
    order, offsets = order.to(dev), offsets.to(dev)
    row_index = order // top_k
    x = torch.randn(tokens, k, device=dev, dtype=dtype)
    w = (torch.randn(experts, n, k, device=dev, dtype=dtype) / k ** 0.5).transpose(-2, -1)
    down = (torch.randn(experts, k, n, device=dev, dtype=dtype) / n ** 0.5).transpose(-2, -1)
    ops = torch.ops.ditron
    d_plan, c_plan = _plan(ALL_TO_ALL_GROUPED_MM), _plan(GROUPED_MM_ALL_TO_ALL)

    def step():
        rows, h = ops.all_to_all_grouped_mm(x, [tokens], [tokens], row_index, [w], offsets,
                                            group_name, 1, d_plan)
        return rows, h, ops.grouped_mm_all_to_all([h], [down], offsets, row_index, True,
                                                  [tokens], [tokens], group_name, 1, c_plan)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    served = dict(stats)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    assert all(stats[op] == served[op] + 1 for op in served), "captured call not fused"
    for _ in range(2):
        x.copy_(torch.randn(tokens, k, device=dev, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref = all_to_all_grouped_mm_reference(x, [tokens], [tokens], row_index, [w], offsets,
                                              group_name, 1)
        assert torch.equal(outs[0], ref[0]), "graph replay: rows differ"
        _check("graph replay dispatch", outs[1], ref[1])
        _check("graph replay combine", outs[2], grouped_mm_all_to_all_reference(
            [ref[1]], [down], offsets, row_index, True, [tokens], [tokens], group_name, 1))


def _worker(rank, port, result_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=1,
                            device_id=torch.device("cuda", rank))
    status = "ok"
    try:
        gen = torch.Generator().manual_seed(0)
        n = sum(_cases(dist.group.WORLD.group_name, dtype, gen)
                for dtype in (torch.bfloat16, torch.float16))
        _graph_case(dist.group.WORLD.group_name, gen)
        print(f"moe gpu: {n} cases fused and checked, and a CUDA graph replayed", flush=True)
    except Exception:  # noqa: BLE001 - reported to the parent
        status = traceback.format_exc()
    report_and_close(result_dir, rank, status)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_moe_fused_world1(tmp_path):
    spawn_ranks(_worker, (_free_port(), str(tmp_path)), 1)
    status = (tmp_path / "rank0.txt").read_text()
    assert status == "ok", status


def _ep_call(group, world, rank, tokens, local_experts, k, case, dtype, gen):
    """One rank's dispatch arguments (x in rank-major order, the splits, row_index, offsets) for
    a routing of `case`: the counts and each received row's expert exchanged over NCCL, as an
    MoE layer exchanges them."""
    import torch.distributed as dist

    dev = torch.device("cuda")
    experts = world * local_experts
    expert = torch.randint(0, experts, (tokens,), generator=gen)
    if case == "all_to_rank0":
        expert %= local_experts
    elif case == "last_receives_nothing":
        expert %= (world - 1) * local_experts
    elif case == "empty_expert":
        expert = torch.where(expert % local_experts == 1, expert - 1, expert)
    expert = expert.sort().values.to(dev)
    x = torch.randn(tokens, k, device=dev, dtype=dtype)
    send = torch.bincount(expert // local_experts, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    input_splits, output_splits = send.tolist(), recv.tolist()
    received_expert = torch.empty(sum(output_splits), dtype=expert.dtype, device=dev)
    dist.all_to_all_single(received_expert, expert, output_splits, input_splits, group=group)
    local = received_expert % local_experts
    row_index = torch.argsort(local, stable=True)
    offsets = torch.cumsum(torch.bincount(local, minlength=local_experts), 0).to(torch.int32)
    return x, output_splits, input_splits, row_index, offsets


MULTI_RANK_CASES = ("random", "random", "empty_expert", "last_receives_nothing", "all_to_rank0",
                    "random")
LOCAL_EXPERTS, TOKENS = 4, 300


MULTI_RANK_TILES = TILES[:2] + TILES[3:4]  # TMA (the default), pointers, a small tile


def _routed_calls(group, world, rank, op, k, gen):
    """(tag, plan, dtype, a dispatch's arguments: x [TOKENS, k], splits, row_index, offsets)
    for each dtype, tile and routing case, consecutive calls on the same buffers."""
    for dtype in (torch.bfloat16, torch.float16):
        for tile in MULTI_RANK_TILES:
            plan = _plan(op, **tile)
            for case in MULTI_RANK_CASES:
                yield (f"world {world} rank {rank} {case} {dtype} {tile}", plan, dtype,
                       _ep_call(group, world, rank, TOKENS, LOCAL_EXPERTS, k, case, dtype, gen))


def _fused(op, args, plan, tag):
    """The op's output, asserting that its fused path (not the fallback) served the call."""
    from ditron_inductor.runtime.moe import stats

    served = stats[op]
    try:
        out = getattr(torch.ops.ditron, op)(*args, plan)
    except RuntimeError as exc:  # which call of the sequence (a bounded wait gave up)
        raise RuntimeError(f"{tag}: {exc}") from exc
    assert stats[op] == served + 1, f"{tag}: not fused"
    return out


def _expert_weights(k, n, dev, transposed):
    """Per dtype, this rank's experts [LOCAL_EXPERTS, k, n] (nn.Linear's layout, transposed)."""
    shape = (LOCAL_EXPERTS, n, k) if transposed else (LOCAL_EXPERTS, k, n)
    made = {dtype: torch.randn(shape, device=dev, dtype=dtype) / k ** 0.5
            for dtype in (torch.bfloat16, torch.float16)}
    return {dtype: w.transpose(-2, -1) if transposed else w for dtype, w in made.items()}


def _dispatch_calls(group, world, rank, dev, gen) -> str:
    """Consecutive multi-rank dispatch calls (gate and up) against the reference."""
    from ditron_inductor.ops import all_to_all_grouped_mm_reference
    from ditron_inductor.scheduler.task import ALL_TO_ALL_GROUPED_MM

    k, n, count = 512, 384, 0
    gate, up = _expert_weights(k, n, dev, True), _expert_weights(k, n, dev, False)
    for tag, plan, dtype, (x, out_splits, in_splits, row_index, offsets) in _routed_calls(
            group, world, rank, ALL_TO_ALL_GROUPED_MM, k, gen):
        print(f"dispatch call {count}: {tag}, rows {x.shape[0]}, sends {in_splits}, "
              f"receives {out_splits}", flush=True)  # where a run that does not end stopped
        args = (x, out_splits, in_splits, row_index, [gate[dtype], up[dtype]], offsets,
                group.group_name, world)
        out = _fused(ALL_TO_ALL_GROUPED_MM, args, plan, tag)
        ref = all_to_all_grouped_mm_reference(*args)
        assert torch.equal(out[0], ref[0]), f"{tag}: rows differ"
        if ref[0].shape[0]:
            for o, r in zip(out[1:], ref[1:]):
                _check(f"multi-rank dispatch {tag}", o, r)
        count += 1
    return f"{count} multi-rank dispatch calls fused and checked"


def _combine_calls(group, world, rank, dev, gen) -> str:
    """Consecutive multi-rank combine calls (down, back along each dispatch routing: its
    row_index, the splits reversed, as the MoE layer's forward combines) against the
    reference (passed on 2x H200)."""
    from ditron_inductor.ops import grouped_mm_all_to_all_reference
    from ditron_inductor.scheduler.task import GROUPED_MM_ALL_TO_ALL

    k, n, count = 384, 512, 0  # down: hidden 384 -> model 512
    down = _expert_weights(k, n, dev, True)
    for tag, plan, dtype, (_, out_splits, in_splits, row_index, offsets) in _routed_calls(
            group, world, rank, GROUPED_MM_ALL_TO_ALL, k, gen):
        print(f"combine call {count}: {tag}, rows {sum(out_splits)}, sends {out_splits}, "
              f"receives {in_splits}", flush=True)  # where a run that does not end stopped
        h = torch.randn(sum(out_splits), k, device=dev, dtype=dtype)
        args = ([h], [down[dtype]], offsets, row_index, False, in_splits, out_splits,
                group.group_name, world)
        out = _fused(GROUPED_MM_ALL_TO_ALL, args, plan, tag)
        ref = grouped_mm_all_to_all_reference(*args)
        assert out.shape == ref.shape, f"{tag}: shape {tuple(out.shape)}"
        if ref.shape[0]:
            err = _rel(out, ref) if torch.isfinite(out).all() else float("inf")
            assert err < 2e-2, (f"multi-rank combine {tag}: relative error {err:.3e}, "
                                f"{_wrong_rows(out, ref, in_splits)}; "
                                f"{_combine_buffer_later(ref, in_splits)}")
        count += 1
    return f"{count} multi-rank combine calls fused and checked"


def _combine_buffer_later(ref, received_splits) -> str:
    """After a wrong combine: its receive buffer a while later (the peers' writes of this call
    done by then: no barrier, a peer that passed is in its next call's collectives), every
    rank's table and this rank's flag words. Rows right there now came after the collect's copy
    (the wait let it read early); rows still wrong went elsewhere."""
    import time

    from ditron_inductor.runtime import moe_combine
    from ditron_inductor.runtime.context import _contexts

    torch.cuda.synchronize()
    time.sleep(2)
    received, n, world = ref.shape[0], ref.shape[1], len(received_splits)
    name, layout = moe_combine.context_of(world, received, n, ref.dtype)
    ctxs = [c for key, c in _contexts.items() if key[0] == name]
    if len(ctxs) != 1:
        return f"{len(ctxs)} combine contexts of this size"
    ctx = ctxs[0]
    recv = ctx.data.view(-1, layout.dtype, [layout.capacity, layout.k], layout.recv_offset)
    tables = [ctx.data.view(p, torch.int32, [2 * world], layout.table_offset).tolist()
              for p in range(world)]
    return (f"later, the receive buffer: {_wrong_rows(recv[:received], ref, received_splits)}; "
            f"each rank's table {tables}, my flag words "
            f"{moe_combine.flag_words(ctx, layout).tolist()}")


def _wrong_rows(out, ref, received_splits) -> str:
    """Which senders' rows came out wrong (the received rows are sender-major), and whether
    they are zeros: where a failing combine went wrong."""
    wrong = ~((out.float() - ref.float()).abs() <= 0.05 * ref.float().abs().max()).all(dim=1)
    parts, start = [], 0
    for sender, n in enumerate(received_splits):
        rows = slice(start, start + n)
        bad = wrong[rows]
        zeros = int((out[rows][bad] == 0).all(dim=1).sum()) if bad.any() else 0
        parts.append(f"from rank {sender}: {int(bad.sum())} of {n} rows wrong ({zeros} zeros)")
        start += n
    return "; ".join(parts)


def _multi_rank_worker(rank, world, port, result_dir, calls):
    import torch.distributed as dist

    # the dispatch's and combine's waits bounded (the plans' bound, plan_for reads it): a row
    # that never lands raises (DITRON_TEST_WAIT_S=0: unbounded, as a model's call waits)
    os.environ["DITRON_WAIT_TIMEOUT_S"] = os.environ.get("DITRON_TEST_WAIT_S", "60")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    # a rank left alone in a collective (its peer failed) is aborted by NCCL's watchdog after
    # the timeout instead of hanging the test
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank), timeout=timedelta(seconds=60))
    status = "ok"
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        torch.manual_seed(7)  # the weights: any, each rank its own experts
        done = calls(dist.group.WORLD, world, rank, torch.device("cuda"), gen)
        print(f"moe gpu world {world}: {done}", flush=True)
    except Exception:  # noqa: BLE001 - reported to the parent
        status = traceback.format_exc()
        print(f"rank {rank} failed: {status}", flush=True)  # before a close that may not end
    report_and_close(result_dir, rank, status)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
@pytest.mark.parametrize("world", [2, "all"])
@pytest.mark.parametrize("calls", [_dispatch_calls, _combine_calls],
                         ids=["dispatch", "combine"])
def test_moe_multi_rank(tmp_path, world, calls):
    """The dispatch passed on 2x H100 and 2x H200, and on 4 of 4x H100; the combine on 2x H200,
    2x H100 and 4 of 4x H100 (the module doc says with which waits)."""
    if world == "all":
        if torch.cuda.device_count() == 2:
            pytest.skip("2 GPUs: the world-2 case ran")
        world = torch.cuda.device_count()
    spawn_ranks(_multi_rank_worker, (world, _free_port(), str(tmp_path), calls), world)
    for rank in range(world):
        status = (tmp_path / f"rank{rank}.txt").read_text()
        assert status == "ok", f"rank {rank}: {status}"
