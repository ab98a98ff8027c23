"""The copy-engine all-gather's stream operations in the order it queues them, on one rank
emulated in host memory (tests/host_ranks.py), its peer's shard already in the peer's buffer:
what runs before the GEMM of my rows and what waits for what, and the product it computes."""

from types import SimpleNamespace

import pytest
import torch

from ditron_inductor.runtime import all_gather
from ditron_inductor.scheduler.plan import AllGatherPlan
from ditron_inductor.scheduler.task import Task
from tests.host_ranks import HostContext, host_driver

MAIN, LOCAL, COPY = "main", "local", "copy"


class RecordingContext(HostContext):
    """HostContext with the all-gather's streams and events as names, the signals recorded."""

    def __init__(self, world, rank, nbytes, ops):
        super().__init__(world, rank, nbytes)
        self.ops = ops
        self.local = SimpleNamespace(cuda_stream=LOCAL)
        self.side = SimpleNamespace(cuda_stream=COPY)
        self.ev_start, self.ev_end, self.ev_buffer, self.ev_ready = (
            "ev_start", "ev_end", "ev_buffer", "ev_ready")
        self.ev_chunks = [f"ev_chunk{c}" for c in range(world)]
        self.ev_sides = [f"ev_side{i}" for i in range(4)]
        self.chunk_flags = torch.zeros(world, dtype=torch.int32)

    def signal(self, stream, epoch, dst_addrs):
        # the flag's name from its word on the peer: W words of READY, then W of DONE
        words = {(dst - base) // 4 for dst in dst_addrs for base in self.flag_bases
                 if 0 <= dst - base < 4 * len(self.flag_words)}
        self.ops.append(("signal", stream, "READY" if max(words) < self.world else "DONE"))
        super().signal(stream, epoch, dst_addrs)


def _run(monkeypatch, ready_before_gemm, shape, gemm="cublas", **plan_options):
    """Rank 0 of 2 gathers its shard and rank 1's (placed in rank 1's buffer beforehand) and
    multiplies; returns (the queued operations, rank 0's context, the product, the reference)."""
    ROWS, K, N = shape
    ops = []
    world, rank = 2, 0
    torch.manual_seed(0)
    shards = [torch.randn(ROWS, K, dtype=torch.bfloat16) for _ in range(world)]
    w = torch.randn(K, N, dtype=torch.bfloat16)
    nbytes = 2 * ROWS * K * 2  # two parities of one shard
    ctxs = [RecordingContext(world, r, nbytes, ops) for r in range(world)]
    for ctx in ctxs:
        ctx.connect(ctxs)
    # the call's epoch is 1 (parity 1): rank 1's shard in its buffer and its READY raised
    half = nbytes // 2
    ctxs[1].data.local[half:].view(torch.bfloat16)[:ROWS * K].copy_(shards[1].view(-1))
    ctxs[0].flag_words[ctxs[0].READY + 1] = 1

    host_driver(all_gather, monkeypatch)
    fake = all_gather.driver
    fake.record = lambda ev, stream: ops.append(("record", stream, ev))
    fake.stream_wait = lambda stream, ev: ops.append(("stream_wait", stream, ev))
    memmove, write = fake.memcpy, fake.write
    fake.memcpy = lambda dst, src, n, stream: (ops.append(("memcpy", stream, dst)),
                                               memmove(dst, src, n, stream))
    fake.write = lambda stream, addr, v: (ops.append(("write", stream, addr)),
                                          write(stream, addr, v))
    monkeypatch.setattr(all_gather, "wait_geq", lambda ctx, plan, stream, idx, value: (
        ops.append(("wait_geq", stream, idx)) if value > 0 else None))
    monkeypatch.setattr(all_gather, "current_stream", lambda: MAIN)
    monkeypatch.setattr(all_gather, "get_context", lambda *a, **k: ctxs[rank])
    # my shard's two local copies as one kernel (before the Triton GEMM), done on the host
    monkeypatch.setattr(all_gather, "num_sms", lambda device: 2)
    monkeypatch.setattr(all_gather, "preload", lambda *args, **meta: None)
    monkeypatch.setattr(all_gather, "launch", lambda kernel, grid, src, buffer, mine, words, stream,
                        **meta: (ops.append(("copy_twice", stream, buffer.data_ptr())),
                                 buffer.copy_(src), mine.copy_(src)))
    real_matmul = all_gather.matmul_into
    monkeypatch.setattr(all_gather, "matmul_into", lambda a, b, bias, out, **kw: (
        ops.append(("gemm", MAIN, a.data_ptr())), real_matmul(a, b, bias, out, **kw)))
    monkeypatch.setattr(all_gather, "triton_gemm", lambda a, b, bias, out, tile, **kw: (
        ops.append(("gemm", MAIN, a.data_ptr())), real_matmul(a, b, bias, out)))

    plan = AllGatherPlan(gemm=gemm, groups=(1, 1), ready_before_gemm=ready_before_gemm,
                         **plan_options)
    task = Task(op="all_gather_matmul", group_name="g", world_size=world, m=world * ROWS, k=K,
                ns=(N,), dtype=torch.bfloat16, device_type="cuda")
    gathered, out = all_gather.all_gather_matmul_fused(task, plan, shards[rank], [w], [None], 0,
                                                       "g", world)
    full = torch.cat(shards)
    torch.testing.assert_close(gathered, full)
    return ops, ctxs[0], out, full.float() @ w.float()


# (a rank's shard rows, K, N): odd sizes too (shards that are no whole 4-byte words)
@pytest.mark.parametrize("shape", [(8, 16, 24), (5, 7, 3)])
@pytest.mark.parametrize("ready_before_gemm", [False, True])
def test_all_gather_queues_the_buffer_copy_and_the_barrier_before_the_gemm(monkeypatch,
                                                                         ready_before_gemm,
                                                                         shape):
    ops, ctx, out, ref = _run(monkeypatch, ready_before_gemm, shape)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    rows, k, _ = shape
    my_buffer = ctx.data_addrs[0] + rows * k * 2  # the half of epoch 1's parity
    buffer_copy = next(op for op in ops if op[0] == "memcpy" and op[2] == my_buffer)
    first_gemm = next(i for i, op in enumerate(ops) if op[0] == "gemm")
    peer_ready_waits = [i for i, op in enumerate(ops)
                        if op[0] == "wait_geq" and op[2] == ctx.READY + 1]
    pull = next(i for i, op in enumerate(ops) if op[0] == "memcpy" and op[1] == COPY)
    if ready_before_gemm:
        # my buffer's copy and READY on the main stream, then the peer's READY waited for there,
        # all before the GEMM of my rows; the pull after the barrier's event, with no flag wait
        assert buffer_copy[1] == MAIN
        assert ("signal", MAIN, "READY") in ops[:first_gemm]
        assert [ops[i][1] for i in peer_ready_waits] == [MAIN]
        assert peer_ready_waits[0] < first_gemm
        assert ops.index(("stream_wait", COPY, "ev_ready")) < pull
        # my rows of the gathered A copied beside the GEMM, after my buffer's copy
        local_copy = next(i for i, op in enumerate(ops) if op[0] == "memcpy" and op[1] == LOCAL)
        assert ops.index(("stream_wait", LOCAL, "ev_buffer")) < local_copy
    else:
        # both local copies beside the GEMM of my rows; the pull waits for the peer's flag
        assert buffer_copy[1] == LOCAL
        assert ("signal", LOCAL, "READY") in ops
        assert [ops[i][1] for i in peer_ready_waits] == [COPY]
        assert peer_ready_waits[0] < pull
        assert ("record", MAIN, "ev_ready") not in ops


def test_barrier_beside_leaves_the_gemm_of_my_rows_unwaited(monkeypatch):
    """barrier_beside: the peers' READY waited for on the local copies' stream, which raises the
    pulls' event; the main stream queues no flag wait before the GEMM of my rows."""
    ops, ctx, out, ref = _run(monkeypatch, True, (8, 16, 24), barrier_beside=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    first_gemm = next(i for i, op in enumerate(ops) if op[0] == "gemm")
    assert ("signal", MAIN, "READY") in ops[:first_gemm]  # my buffer's copy still goes first
    waits = [op for op in ops if op[0] == "wait_geq" and op[2] == ctx.READY + 1]
    assert [op[1] for op in waits] == [LOCAL]
    barrier, raised = ops.index(waits[0]), ops.index(("record", LOCAL, "ev_ready"))
    pull = next(i for i, op in enumerate(ops) if op[0] == "memcpy" and op[1] == COPY)
    assert barrier < raised < ops.index(("stream_wait", COPY, "ev_ready")) < pull
    assert not any(op[0] == "wait_geq" and op[1] == MAIN for op in ops[:first_gemm])


@pytest.mark.parametrize("shape", [(8, 16, 24), (5, 7, 3)])
@pytest.mark.parametrize("ready_before_gemm", [False, True])
def test_triton_gemm_follows_both_local_copies_on_the_main_stream(monkeypatch, ready_before_gemm,
                                                                  shape):
    """gemm="triton" reads my rows from the gathered A: my shard written to my buffer and my rows
    by one kernel on the main stream before READY (where the shard is no whole 4-byte words, the
    buffer's copy there and my rows copied after it), then my chunk flag, then the GEMM. Nothing
    on the local copies' stream."""
    ops, ctx, out, ref = _run(monkeypatch, ready_before_gemm, shape, gemm="triton")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    ready = ops.index(("signal", MAIN, "READY"))
    rows, k, _ = shape
    my_buffer = ctx.data_addrs[0] + rows * k * 2  # the half of epoch 1's parity
    copies = [(i, op) for i, op in enumerate(ops) if op[0] in ("copy_twice", "memcpy")
              and op[1] != COPY]
    assert all(op[1] == MAIN for _, op in copies)
    kind = "copy_twice" if rows * k * 2 % 4 == 0 else "memcpy"
    assert [op for i, op in copies if i < ready] == [(kind, MAIN, my_buffer)]
    assert len(copies) == (1 if kind == "copy_twice" else 2)
    my_flag = ops.index(("write", MAIN, ctx.chunk_flags.data_ptr()))
    assert copies[-1][0] < my_flag < next(i for i, op in enumerate(ops) if op[0] == "gemm")
    assert not any(op[1] == LOCAL for op in ops)
