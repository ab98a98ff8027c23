"""The MoE kernels (templates/grouped_gemm.py) and their runtime (runtime/moe.py) on CPU under the
Triton interpreter, against the ops' reference composition: odd routings (an expert with no
rows, every row to one expert, row counts no multiple of the tile, top-1 and top-2), the
combine's scatter with and without accumulation, the routing weight in the epilogue, the
dispatch's push and its GEMM waiting on arrival counters, and the multi-rank runtimes' own steps
(runtime/moe_dispatch.py, runtime/moe_combine.py) on 2 and 3 emulated ranks over consecutive
calls, and the tile each multi-rank op runs for the rows it routes.

fp16 only: the interpreter computes tl.dot on bf16 operands wrongly (test_kernels_interpreter.py);
bf16 is checked on the GPU (tests/gpu/test_moe_gpu.py). Outputs start as NaN, so a row never
written fails; the experts' weights differ, so a wrong offset fails.
"""

import collections
import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from ditron_inductor.runtime import faults  # noqa: E402
from ditron_inductor.ops import task_of  # noqa: E402
from ditron_inductor.runtime import launch, moe  # noqa: E402
from ditron_inductor.scheduler.plan import TORCH, TRITON, GroupedMmPlan  # noqa: E402
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_TO_ALL_GROUPED_MM,
    GROUPED_MM_ALL_TO_ALL,
)
from ditron_inductor.runtime import moe_routes  # noqa: E402
from ditron_inductor.templates import grouped_gemm  # noqa: E402
from ditron_inductor.templates.flags import MAX_WORLD  # noqa: E402
from ditron_inductor.templates import moe_routes as moe_routes_kernels  # noqa: E402

F16 = torch.float16
PLAN = GroupedMmPlan(block_m=16, block_n=32, block_k=32, group_m=2, warps=4, stages=2, progs=3,
                     tma_a=False, tma_b=False)  # rows and weights through pointers
TMA_A = dataclasses.replace(PLAN, tma_a=True)  # the rows through a TMA descriptor (gathered first)
LIMIT = 50  # polls before a wait gives up (the interpreter runs producers first)


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def routing(tokens: int, experts: int, top_k: int, case: str, gen):
    """(x row of each (token, k) pair sorted by expert = row_index, offsets, the pairs' order)
    as the MoE layer builds them (tests/moe_ep.py)."""
    if case == "one_expert":
        chosen = torch.full((tokens, top_k), 2)
        chosen[:, 1:] = (torch.arange(1, top_k) + 2) % experts  # top-k distinct experts
    else:
        chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                              for _ in range(tokens)])
        if case == "empty_expert":  # expert 1 gets nothing
            chosen = torch.where(chosen == 1, (chosen + 2) % experts, chosen)
            chosen = torch.where(chosen == 1, 0, chosen)
    chosen = chosen.reshape(-1)
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=experts)
    return order // top_k, torch.cumsum(counts, 0).to(torch.int32), order, counts


def weights(experts, k, n, gen, transposed=False):
    if transposed:  # nn.Linear's layout [E, N, K], seen as [E, K, N]
        return (torch.randn(experts, n, k, generator=gen) / k ** 0.5).to(F16).transpose(-2, -1)
    return (torch.randn(experts, k, n, generator=gen) / k ** 0.5).to(F16)


CASES = [  # (tokens, experts, top_k, case)
    (13, 4, 2, "empty_expert"),  # 26 rows, expert 1 with none
    (21, 4, 1, "random"),  # top-1, 21 rows: no multiple of BLOCK_M
    (18, 4, 2, "one_expert"),  # every token's first expert is expert 2: 18 rows in one
    (7, 3, 1, "one_expert"),  # every row to one expert, the others empty
    (5, 8, 8, "random"),  # top-8 of 8: every token's rows to every expert
]


@pytest.mark.parametrize("plan", [PLAN, TMA_A], ids=["pointers", "tma_a"])
@pytest.mark.parametrize("tokens,experts,top_k,case", CASES)
def test_dispatch_gathers_rows_by_expert(tokens, experts, top_k, case, plan):
    """all_to_all_grouped_mm at world size 1: rows = x[row_index], each weight's grouped GEMM
    (a plain [E, K, N] weight and a transposed one, K and N no multiples of the blocks); the
    rows gathered in the first GEMM, or before the GEMMs, which read them through TMA (tma_a:
    blocks of rows reach into the next expert's, and past K into TMA's zero fill)."""
    gen = torch.Generator().manual_seed(tokens)
    k, ns = 40, (48, 33)
    x = torch.randn(tokens, k, generator=gen).to(F16)
    row_index, offsets, _, counts = routing(tokens, experts, top_k, case, gen)
    ws = [weights(experts, k, ns[0], gen), weights(experts, k, ns[1], gen, transposed=True)]
    args = (x, [tokens], [tokens], row_index, ws, offsets, "0", 1)
    before = moe.stats[ALL_TO_ALL_GROUPED_MM]
    rows, *outs = moe.all_to_all_grouped_mm_fused(task_of(ALL_TO_ALL_GROUPED_MM, *args), plan,
                                                  *args)
    assert moe.stats[ALL_TO_ALL_GROUPED_MM] == before + 1
    if plan.tma_a:  # the rows' layout takes a descriptor: the TMA loads ran, not pointers
        assert moe.rows_descriptor(rows, plan) is not None
    assert torch.equal(rows, x[row_index])
    ref_rows = x[row_index].float()
    for w, out in zip(ws, outs):
        ref = torch._grouped_mm(ref_rows, w.float(), offs=offsets)
        assert not out.isnan().any()
        assert rel_err(out, ref) < 2e-3, case
        for e in range(experts):  # each expert's rows by its own weight
            lo, hi = int(offsets[e]) - int(counts[e]), int(offsets[e])
            if hi > lo:
                assert rel_err(out[lo:hi], ref_rows[lo:hi] @ w[e].float()) < 2e-3


def test_dispatch_in_arrival_order_and_rows_past_the_last_offset():
    """row_index None: the rows as received; rows past offsets[-1] belong to no expert but are
    still the op's rows output."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 24, generator=gen).to(F16)
    offsets = torch.tensor([5, 5, 30], dtype=torch.int32)
    w = weights(3, 24, 16, gen)
    args = (x, [37], [37], None, [w], offsets, "0", 1)
    rows, out = moe.all_to_all_grouped_mm_fused(task_of(ALL_TO_ALL_GROUPED_MM, *args), PLAN,
                                                *args)
    assert torch.equal(rows, x)
    ref = torch._grouped_mm(x.float(), w.float(), offs=offsets)
    assert rel_err(out[:30], ref[:30]) < 2e-3


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("tokens,experts,top_k,case", CASES[:3] + CASES[4:])
def test_combine_scatters_rows_back(tokens, experts, top_k, case, accumulate):
    """grouped_mm_all_to_all at world size 1: y = grouped_mm(left, W), row j to row
    row_index[j] of zeros, as the reference's index_put: the pairs' order (a permutation), or
    with accumulate each pair's token, so that top-2 sums two rows on one."""
    gen = torch.Generator().manual_seed(tokens + 100)
    k, n = 36, 40  # K no multiple of BLOCK_K (the reference wants 16-byte fp32 rows)
    _, offsets, order, _ = routing(tokens, experts, top_k, case, gen)
    rows = tokens * top_k
    left = torch.randn(rows, k, generator=gen).to(F16)
    w = weights(experts, k, n, gen, transposed=True)
    index = order // top_k if accumulate else order
    sent = tokens if accumulate else rows
    args = ([left], [w], offsets, index, accumulate, [sent], [sent], "0", 1)
    out = moe.grouped_mm_all_to_all_fused(task_of(GROUPED_MM_ALL_TO_ALL, *args), PLAN, *args)
    y = torch._grouped_mm(left.float(), w.float(), offs=offsets)
    ref = torch.zeros(sent, n).index_put_((index,), y, accumulate=accumulate)
    assert out.dtype == F16 and out.shape == (sent, n)
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("accumulate", [False, True])
def test_combine_reads_rows_through_a_tma_descriptor(accumulate):
    """tma_a: the combine's rows through a TMA descriptor (blocks of rows reaching into the next
    expert's, an expert without rows, K no multiple of BLOCK_K); rows whose stride is no
    multiple of 16 bytes take pointers."""
    gen = torch.Generator().manual_seed(8)
    tokens, experts, top_k, k, n = 21, 4, 2, 40, 40
    _, offsets, order, _ = routing(tokens, experts, top_k, "empty_expert", gen)
    left = torch.randn(tokens * top_k, k, generator=gen).to(F16)
    w = weights(experts, k, n, gen, transposed=True)
    assert moe.rows_descriptor(left, TMA_A) is not None
    index = order // top_k if accumulate else order
    sent = tokens if accumulate else tokens * top_k
    args = ([left], [w], offsets, index, accumulate, [sent], [sent], "0", 1)
    out = moe.grouped_mm_all_to_all_fused(task_of(GROUPED_MM_ALL_TO_ALL, *args), TMA_A, *args)
    y = torch._grouped_mm(left.float(), w.float(), offs=offsets)
    ref = torch.zeros(sent, n).index_put_((index,), y, accumulate=accumulate)
    assert rel_err(out, ref) < 2e-3
    assert moe.rows_descriptor(torch.zeros(8, 36, dtype=F16), TMA_A) is None


def test_combine_without_index_and_a_sum_declined():
    gen = torch.Generator().manual_seed(3)
    left = torch.randn(19, 32, generator=gen).to(F16)
    w = weights(2, 32, 32, gen)
    offsets = torch.tensor([0, 19], dtype=torch.int32)
    args = ([left], [w], offsets, None, False, [19], [19], "0", 1)
    out = moe.grouped_mm_all_to_all_fused(task_of(GROUPED_MM_ALL_TO_ALL, *args), PLAN, *args)
    assert rel_err(out, torch._grouped_mm(left.float(), w.float(), offs=offsets)) < 2e-3
    two = ([left, left], [w, w], offsets, None, False, [19], [19], "0", 1)
    assert moe.grouped_mm_all_to_all_fused(task_of(GROUPED_MM_ALL_TO_ALL, *two), PLAN,
                                           *two) is None


def test_epilogue_applies_the_routing_weight_and_sums_a_tokens_experts():
    """The combine epilogue with the routing weight: out[token] = sum over its top-k of
    score * (row @ W_expert), world size 1's whole MoE output in one kernel after the gather."""
    gen = torch.Generator().manual_seed(4)
    tokens, experts, top_k, k, n = 23, 4, 2, 32, 24
    row_index, offsets, order, _ = routing(tokens, experts, top_k, "empty_expert", gen)
    scores = torch.rand(tokens * top_k, generator=gen)  # per (token, k) pair, in pair order
    left = torch.randn(tokens * top_k, k, generator=gen).to(F16)
    w = weights(experts, k, n, gen)
    out = torch.zeros(tokens, n)
    scale = scores[order].contiguous()
    moe.grouped_gemm(PLAN, left, w, offsets, out, rows=left.shape[0], c_index=row_index,
                     scale=scale, accumulate=True)
    y = torch._grouped_mm(left.float(), w.float(), offs=offsets) * scale[:, None]
    ref = torch.zeros(tokens, n).index_put_((row_index,), y, accumulate=True)
    assert rel_err(out, ref) < 2e-3


@triton.jit
def tile_map(offsets_ptr, out_ptr, M, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    t = tl.program_id(0)
    expert, start, count, i = grouped_gemm.expert_of_tile(offsets_ptr, t, M, E, BLOCK_M, E_P2)
    tl.store(out_ptr + 4 * t, expert)
    tl.store(out_ptr + 4 * t + 1, start)
    tl.store(out_ptr + 4 * t + 2, count)
    tl.store(out_ptr + 4 * t + 3, i)


def test_experts_of_tiles():
    """The tile -> expert map the kernel computes, against the host's: experts with 0 rows own
    no tile, a partial last tile each, then the rows past the last offset."""
    offsets = torch.tensor([0, 17, 17, 40, 41], dtype=torch.int32)
    m, bm = 45, 16

    tiles = 3 + 5
    out = torch.zeros(tiles, 4, dtype=torch.int32)
    tile_map[(tiles,)](offsets, out, m, 5, BLOCK_M=bm, E_P2=8)
    # expert 1: 17 rows in 2 tiles; expert 3: 23 rows in 2; expert 4: 1 row; then rows 41..44
    expected = [[1, 0, 17, 0], [1, 0, 17, 1], [3, 17, 23, 0], [3, 17, 23, 1], [4, 40, 1, 0],
                [5, 41, 4, 0], [5, 41, 4, 1], [5, 41, 4, 2]]
    assert out.tolist() == expected


class Rank:
    """An emulated rank's receive buffer and per-tile arrival counters."""

    def __init__(self, rows, k, tiles):
        self.recv = torch.full((rows, k), float("nan"), dtype=F16)
        self.counts = torch.zeros(tiles, dtype=torch.int32)
        self.err = faults.error_words("cpu")[1]


def test_dispatch_push_and_gemm_waiting_on_tiles_two_ranks():
    """World size 2, two calls: each rank puts its rows into the peers' receive buffers at the
    expert-major positions of the receivers' route tables (built by hand here; experts 0-1 on
    rank 0, 2-3 on rank 1, rank 0's expert 1 with no row), counted per destination tile; each
    rank's GEMM waits on its tiles' counters (the previous call's count plus this call's rows)
    and reads the buffer. Then a call with one tile's rows missing: its bounded wait reports
    ERR_ROWS instead of hanging."""
    world, local_experts, k, n, bm = 2, 2, 32, 24, 16
    gen = torch.Generator().manual_seed(5)
    ws = [weights(local_experts, k, n, gen) for _ in range(world)]
    max_rows, max_tiles = 64, 8
    ranks = [Rank(max_rows, k, max_tiles) for _ in range(world)]
    data_table = torch.tensor([r.recv.data_ptr() for r in ranks], dtype=torch.int64)
    count_table = torch.tensor([r.counts.data_ptr() for r in ranks], dtype=torch.int64)
    tables = [torch.zeros(moe_routes.table_words(world, max_rows), dtype=torch.int32)
              for _ in range(world)]
    table_table = torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64)
    previous = [torch.zeros(max_tiles, dtype=torch.int32) for _ in range(world)]
    for call, tokens in enumerate(((11, 20), (25, 3))):
        # each rank's tokens and their global expert (top-1), sent rank-major (sorted by
        # expert); rank 0's expert 1 gets none
        xs, experts_of = [], []
        for r in range(world):
            e = torch.randint(0, 4, (tokens[r],), generator=gen)
            experts_of.append(torch.where(e == 1, 0, e).sort().values)
            xs.append(torch.randn(tokens[r], k, generator=gen).to(F16))
        # receiver q's expert-major layout: per local expert, source rank order, then the
        # sender's order (moe_ep.expert_major_order)
        layouts = []
        for q in range(world):
            rows, tile_rows, offsets, start = [], [], [], 0
            for le in range(local_experts):
                ge = q * local_experts + le
                for p in range(world):
                    rows += [(p, int(i)) for i in torch.nonzero(experts_of[p] == ge).flatten()]
                count = len(rows) - start
                tile_rows += [min(bm, count - t * bm) for t in range(-(-count // bm))]
                start = len(rows)
                offsets.append(start)
            layouts.append((rows, tile_rows, torch.tensor(offsets, dtype=torch.int32)))
        # each receiver's table, built by hand: its senders' starts (rank-major arrival), its
        # own rows' ends per receiver, and the expert-major row and tile of each arrival
        sends = [torch.bincount(experts_of[p] // local_experts, minlength=world).tolist()
                 for p in range(world)]
        for q, (rows, tile_rows, offsets) in enumerate(layouts):
            arrivals = [(p, int(i)) for p in range(world)
                        for i in torch.nonzero(experts_of[p] // local_experts == q).flatten()]
            tile_of = [t for t, n in enumerate(tile_rows) for _ in range(n)]
            words = [sum(sends[p][q] for p in range(p_)) for p_ in range(world)]
            words += [sum(sends[q][:w + 1]) for w in range(world)]
            table = tables[q]
            table[:2 * world] = torch.tensor(words, dtype=torch.int32)
            for pos, row in enumerate(arrivals):
                table[2 * world + pos] = rows.index(row)
                table[2 * world + max_rows + pos] = tile_of[rows.index(row)]
        for p in range(world):
            moe_routes_kernels.put_rows_kernel[(triton.cdiv(tokens[p], 8),)](
                xs[p], xs[p], table_table, data_table, count_table, tokens[p], k, p, max_rows,
                table_table, 0, table_table, 0, 0, table_table, BLOCK_R=8, BLOCK_K=16,
                WORLD=world, WORLD_P2=world, EXPERT_MAJOR=True, HAS_INDEX=False)
        for q, (rows, tile_rows, offsets) in enumerate(layouts):
            rank = ranks[q]
            expect = previous[q].clone()
            expect[:len(tile_rows)] += torch.tensor(tile_rows, dtype=torch.int32)
            assert torch.equal(rank.counts, expect), (call, q)
            m = len(rows)
            out = torch.full((m, n), float("nan"), dtype=F16)
            grouped_gemm.grouped_gemm_kernel[(3,)](
                rank.recv, out, out, ws[q], offsets, out, out, out, out, rank.counts, expect,
                rank.err, m, n, k, local_experts, rank.recv.stride(0), rank.recv.stride(1),
                *ws[q].stride(), out.stride(0), out.stride(1), LIMIT, GATHER=False,
                WRITE_ROWS=False, SCATTER=False, SCALE=False, ACCUMULATE=False, WAIT=True,
                BLOCK_M=bm, BLOCK_N=16, BLOCK_K=16, E_P2=2, NUM_PROGS=3, GROUP_M=2)
            assert int(rank.err[0]) == 0
            received = torch.stack([xs[p][i] for p, i in rows]).float()
            assert torch.equal(rank.recv[:m].float(), received)
            ref = torch._grouped_mm(received, ws[q].float(), offs=offsets)
            assert rel_err(out, ref) < 2e-3, (call, q)
            previous[q] = expect
    # a third call on rank 1 with one tile's rows missing (its counter one short): that tile's
    # wait gives up and says so, leaving it unwritten; every other tile is computed (a tile
    # waiting on another's counter fails here)
    q = 1
    rank = ranks[q]
    rows, tile_rows, offsets = layouts[q]
    m = len(rows)
    missing = len(tile_rows) - 2  # a tile of the first expert or the second
    expect = rank.counts.clone()
    expect[:len(tile_rows)] += torch.tensor(tile_rows, dtype=torch.int32)
    counts = expect.clone()
    counts[missing] -= 1
    first_row = sum(tile_rows[:missing])
    recv = rank.recv.clone()
    recv[first_row:first_row + tile_rows[missing]] = float("nan")
    out = torch.full((m, n), float("nan"), dtype=F16)
    grouped_gemm.grouped_gemm_kernel[(3,)](
        recv, out, out, ws[q], offsets, out, out, out, out, counts, expect, rank.err, m, n, k,
        local_experts, recv.stride(0), recv.stride(1), *ws[q].stride(), out.stride(0),
        out.stride(1), LIMIT, GATHER=False, WRITE_ROWS=False, SCATTER=False, SCALE=False,
        ACCUMULATE=False, WAIT=True, BLOCK_M=bm, BLOCK_N=16, BLOCK_K=16, E_P2=2, NUM_PROGS=3,
        GROUP_M=2)
    assert int(rank.err[0]) == grouped_gemm.ERR_ROWS
    # no flag wait reports that code: READY, DONE and ARRIVED of up to MAX_WORLD ranks
    assert grouped_gemm.ERR_ROWS - 1 >= 3 * MAX_WORLD
    skipped = torch.zeros(m, dtype=torch.bool)
    skipped[first_row:first_row + tile_rows[missing]] = True
    assert out[skipped].isnan().all()
    ref = torch._grouped_mm(rank.recv[:m].float(), ws[q].float(), offs=offsets)
    assert rel_err(out[~skipped], ref[~skipped]) < 2e-3


def test_ops_take_the_fused_path_and_match_their_reference():
    """Both ops through their dispatch as a CUDA call takes it (the plan text decoded, the
    implementation looked up, the Task built) on a world-1 gloo group, against their reference,
    which runs the all-to-all."""
    import torch.distributed as dist

    from ditron_inductor import ops
    from ditron_inductor.scheduler.decide import plan_for

    gen = torch.Generator().manual_seed(6)
    tokens, experts, top_k, k, n = 19, 4, 2, 32, 48
    row_index, offsets, order, _ = routing(tokens, experts, top_k, "empty_expert", gen)
    x = torch.randn(tokens, k, generator=gen).to(F16)
    gate, up = weights(experts, k, n, gen, transposed=True), weights(experts, k, n, gen)
    down = weights(experts, n, k, gen, transposed=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        task = task_of(ALL_TO_ALL_GROUPED_MM, x, [tokens], [tokens], row_index, [gate, up],
                       offsets, group, 1)
        text = plan_for(task, block_m=16, block_n=32, block_k=32, group_m=2, warps=4,
                        progs=3).encode()
        args = (x, [tokens], [tokens], row_index, [gate, up], offsets, group, 1)
        served = dict(moe.stats)
        rows, *outs = ops._dispatch(ALL_TO_ALL_GROUPED_MM, text, True,
                                    ops.all_to_all_grouped_mm_reference, *args)
        ref_rows, *refs = ops.all_to_all_grouped_mm_reference(*args)
        assert torch.equal(rows, ref_rows)
        for out, ref in zip(outs, refs):
            assert rel_err(out, ref) < 5e-3
        h = torch.randn(tokens * top_k, n, generator=gen).to(F16)
        args = ([h], [down], offsets, row_index, True, [tokens], [tokens], group, 1)
        out = ops._dispatch(GROUPED_MM_ALL_TO_ALL, text, True,
                            ops.grouped_mm_all_to_all_reference, *args)
        assert rel_err(out, ops.grouped_mm_all_to_all_reference(*args)) < 5e-3
        assert {op: moe.stats[op] - served[op] for op in served} == {
            ALL_TO_ALL_GROUPED_MM: 1, GROUPED_MM_ALL_TO_ALL: 1}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transposed", [False, True])
def test_weights_through_tma_descriptors(transposed):
    """tma_b: the weights through a TMA descriptor over their 2-d view ([E * K, N], or [E * N,
    K] for nn.Linear's layout, whose N tail reaches into the next expert's rows), an expert
    with no rows between two with rows."""
    gen = torch.Generator().manual_seed(7)
    tokens, experts, top_k, k, n = 21, 4, 2, 64, 40
    row_index, offsets, _, _ = routing(tokens, experts, top_k, "empty_expert", gen)
    x = torch.randn(tokens, k, generator=gen).to(F16)
    w = weights(experts, k, n, gen, transposed=transposed)
    tma = dataclasses.replace(PLAN, tma_b=True)
    assert moe.weight_descriptor(w, tma)[1] == (2 if transposed else 1)
    args = (x, [tokens], [tokens], row_index, [w], offsets, "0", 1)
    rows, out = moe.all_to_all_grouped_mm_fused(task_of(ALL_TO_ALL_GROUPED_MM, *args), tma,
                                                *args)
    ref = torch._grouped_mm(x[row_index].float(), w.float(), offs=offsets)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 2e-3
    # K no multiple of the block in [E, K, N]: pointers instead
    assert moe.weight_descriptor(weights(experts, 40, n, gen), tma)[1] == 0


class EmulatedSymm:
    """One symmetric allocation on emulated ranks (host memory): rank `rank`'s view of it, as
    runtime/symm.SymmBuffer offers it (view(-1): my copy; view(q): rank q's)."""

    def __init__(self, copies, rank):
        self.copies, self.rank = copies, rank
        self.ptr_table = torch.tensor([c.data_ptr() for c in copies], dtype=torch.int64)
        self.words = copies[rank].view(torch.int32)

    def view(self, rank, dtype, shape, byte_offset=0):
        n = dtype.itemsize * int(torch.tensor(shape).prod())
        copy = self.copies[self.rank if rank < 0 else rank]
        return copy[byte_offset:byte_offset + n].view(dtype).view(shape)


class EmulatedContext:
    READY = 0

    def __init__(self, copies, rank, flag_copies=None):
        self.data, self.rank, self.world = EmulatedSymm(copies, rank), rank, len(copies)
        self.flags = EmulatedSymm(flag_copies or [torch.zeros(16 * len(copies), dtype=torch.uint8)
                                                  for _ in copies], rank)
        self.err = faults.error_words("cpu")[1]


def ep_routing(world, local_experts, tokens, k, case, gen):
    """Per sender: x in rank-major order and input_split_sizes; per receiver: output_split_sizes,
    row_index (an argsort of each received row's local expert) and offsets, and the reference
    outputs' rows (received[row_index])."""
    experts = world * local_experts
    xs, splits = [], []
    for p in range(world):
        e = torch.randint(0, experts, (tokens[p],), generator=gen)
        if case == "all_to_one":
            e = e % local_experts  # every row to rank 0
        elif case == "last_receives_nothing":
            e = e % ((world - 1) * local_experts)
        e = torch.where(e % local_experts == 1, e - 1, e)  # every rank's expert 1 gets none
        e = e.sort().values
        xs.append((torch.randn(tokens[p], k, generator=gen).to(F16), e))
        splits.append(torch.bincount(e // local_experts, minlength=world).tolist())
    receivers = []
    for q in range(world):
        parts = [(xs[p][0][xs[p][1] // local_experts == q], xs[p][1][xs[p][1] // local_experts
                                                                       == q])
                 for p in range(world)]
        received = torch.cat([x for x, _ in parts])
        local = torch.cat([e for _, e in parts]) % local_experts
        row_index = torch.argsort(local, stable=True)
        offsets = torch.cumsum(torch.bincount(local, minlength=local_experts), 0).to(torch.int32)
        receivers.append(([splits[p][q] for p in range(world)], row_index, offsets,
                          received[row_index]))
    return [x for x, _ in xs], splits, receivers


@pytest.mark.parametrize("world,tma_a,progs,rows,gemm", [
    (2, False, 0, True, TRITON), (3, False, 0, True, TRITON), (2, True, 0, True, TRITON),
    (3, True, 1, True, TRITON), (2, True, 0, False, TRITON), (2, False, 0, True, TORCH),
    (3, False, 0, False, TORCH)])
def test_multi_rank_dispatch_steps_match_the_reference(world, tma_a, progs, rows, gemm):
    """all_to_all_grouped_mm on 2 and 3 emulated ranks through the runtime's own steps
    (moe_dispatch.publish, push, compute), the signals played by running every rank's step
    before the next: two calls on the same buffers and counters (the second expecting on top of
    the first), then one in which the last rank receives nothing and one in which every row
    goes to rank 0, against the op's reference. TRITON: the first GEMM waits tile by tile;
    tma_a: it reads the receive buffer through TMA; progs 1: one program takes every tile in
    turn, waiting on each. TORCH: one wait for every tile, then torch._grouped_mm (the Triton
    GEMM never launched). rows False (no rows output stored): the later GEMM reads the receive
    buffer too, and the rows output is its view."""
    from ditron_inductor.runtime import moe_dispatch

    gen = torch.Generator().manual_seed(10 + world)
    local_experts, k, ns = 3, 40, (24, 33)
    plan = dataclasses.replace(PLAN, wait_timeout_s=LIMIT / 1e6, tma_a=tma_a, progs=progs,
                               rows=rows, dispatch_gemm=gemm)
    launched = []

    def grouped_gemm(*args, **kwargs):
        launched.append(1)
        return moe.grouped_gemm(*args, **kwargs)

    ws = [[weights(local_experts, k, n, gen, transposed=(i == 1)) for i, n in enumerate(ns)]
          for _ in range(world)]
    capacity = 64
    layout = moe_dispatch.dispatch_layout(world, capacity, k, F16, local_experts, PLAN.block_m)
    copies = [torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(world)]
    ctxs = [EmulatedContext(copies, r) for r in range(world)]
    states = [moe_dispatch.new_state(ctx, layout) for ctx in ctxs]
    recv = ctxs[0].data.view(-1, F16, [capacity, k], layout.recv_offset)
    assert (moe.rows_descriptor(recv, plan) is not None) or not tma_a
    calls = [("random", [13, 20, 7][:world]), ("random", [9, 4, 17][:world]),
             ("last_receives_nothing", [11, 6, 10][:world]), ("all_to_one", [5, 12, 8][:world])]
    for call, (case, tokens) in enumerate(calls):
        xs, splits, receivers = ep_routing(world, local_experts, tokens, k, case, gen)
        for ctx in ctxs:  # a row left unwritten shows as NaN
            ctx.data.view(-1, F16, [capacity, k], layout.recv_offset).fill_(float("nan"))
        for r, ctx in enumerate(ctxs):
            out_splits, row_index, offsets, _ = receivers[r]
            moe_dispatch.publish(ctx, layout, states[r], out_splits, splits[r], row_index,
                                 offsets, PLAN.block_m)
        waited = []
        for r, ctx in enumerate(ctxs):  # the last to push waits in its put's launch (TORCH)
            wait = (moe_dispatch.tiles_wait(ctx, layout, states[r], plan)
                    if r == world - 1 and moe_dispatch.library(ctx, layout, plan, ws[r])
                    else None)
            waited.append(moe_dispatch.push(ctx, layout, states[r], xs[r], wait))
        assert waited == [False] * (world - 1) + [gemm == TORCH]
        for r, ctx in enumerate(ctxs):
            out_splits, row_index, offsets, ref_rows = receivers[r]
            got, *outs = moe_dispatch.compute(ctx, layout, states[r], plan, sum(out_splits),
                                              ws[r], offsets, grouped_gemm, waited[r])
            assert int(ctx.err[0]) == 0, (call, r)
            counters = ctx.data.view(-1, torch.int32, [layout.tiles], 0)
            assert torch.equal(counters, states[r].expect), (call, r)
            assert torch.equal(got, ref_rows), (call, r)
            recv_ptr = ctx.data.view(-1, F16, [capacity, k], layout.recv_offset).data_ptr()
            assert (got.data_ptr() == recv_ptr) == (not rows) or not got.numel(), (call, r)
            for w, out in zip(ws[r], outs):
                if ref_rows.shape[0]:
                    ref = torch._grouped_mm(ref_rows.float(), w.float(), offs=offsets)
                    assert rel_err(out, ref) < 2e-3, (call, r, case)
                assert out.shape == (ref_rows.shape[0], w.shape[-1])
        if case == "last_receives_nothing":
            assert receivers[-1][3].shape[0] == 0
    assert all(int(s.expect.sum()) > 0 for s in states[:1])
    assert bool(launched) == (gemm == TRITON)


def test_one_wait_for_every_tile_before_the_library_gemm():
    """The dispatch whose GEMMs run in torch._grouped_mm first waits for every tile's counter
    (grouped_gemm.wait_tiles_kernel, BLOCK tiles a poll): counters at or past what they expect
    pass, in every block; a tile in the last block one row short gives up after the bound with
    the GEMM's own code, ERR_ROWS, and the counts it saw and expected."""
    from ditron_inductor.templates import flags

    _, err = faults.error_words("cpu")
    tiles = 39
    expect = torch.arange(1, tiles + 1, dtype=torch.int32)
    counts = expect + torch.arange(tiles, dtype=torch.int32) % 2
    grouped_gemm.wait_tiles_kernel[(1,)](counts, expect, tiles, LIMIT, err, BLOCK=16,
                                         PROXY_FENCE=False)
    assert int(err[0]) == 0
    counts[37] = expect[37] - 1
    try:
        grouped_gemm.wait_tiles_kernel[(1,)](counts, expect, tiles, LIMIT, err, BLOCK=16,
                                             PROXY_FENCE=False)
        assert int(err[0]) == grouped_gemm.ERR_ROWS
        report = faults.report()
        assert [int(report[flags.REPORT_SEEN]), int(report[flags.REPORT_EXPECTED])] == [37, 38]
    finally:
        faults.report().zero_()


def test_multi_rank_dispatch_declines_alike_on_every_rank(caplog):
    """The multi-rank dispatch declines for reasons that hold on every rank (CPU tensors, the
    rows sent below the plan's minimum), never for the rows a rank receives."""
    import logging

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, 16, generator=gen).to(F16)
    w = weights(2, 16, 16, gen)
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    for splits in ([3, 3], [6, 0]):  # two ranks' views
        args = (x, [2, 2], splits, torch.arange(4), [w], offsets, "0", 2)
        with caplog.at_level(logging.DEBUG, logger="ditron"):
            assert moe.all_to_all_grouped_mm_fused(task_of(ALL_TO_ALL_GROUPED_MM, *args), PLAN,
                                                   *args) is None
        assert "all_to_all_grouped_mm on 2 ranks: x on cpu" in caplog.text
    # the rows each rank sends (as many on every rank) below the minimum, whatever it receives
    caplog.clear()
    for splits in ([3, 3], [6, 0]):
        args = (x, [2, 2], splits, torch.arange(4), [w], offsets, "0", 2)
        with caplog.at_level(logging.DEBUG, logger="ditron"):
            assert moe.all_to_all_grouped_mm_fused(
                task_of(ALL_TO_ALL_GROUPED_MM, *args), dataclasses.replace(PLAN, min_rows=7),
                *args) is None
        assert "2 ranks: 6 rows to send, fewer than the plan's 7" in caplog.text


def emulated_all_to_all(sent, send_splits):
    """Rank p's received rows: rank q's rows for p (q's send_splits[q][p] rows, rank-major),
    q after q."""
    world = len(sent)
    starts = [[sum(send_splits[q][:p]) for p in range(world)] for q in range(world)]
    return [torch.cat([sent[q][starts[q][p]:starts[q][p] + send_splits[q][p]]
                       for q in range(world)]) for p in range(world)]


@pytest.mark.parametrize("world,tma_a,gemm", [(2, False, TRITON), (3, False, TRITON),
                                              (3, True, TRITON), (3, False, TORCH)],
                         ids=["2", "3", "3-tma_a", "3-torch"])
def test_multi_rank_combine_steps_match_the_reference(world, tma_a, gemm, monkeypatch):
    """grouped_mm_all_to_all on 2 and 3 emulated ranks through the runtime's own steps
    (moe_combine.publish, push, collect), the signals played by running every rank's step
    before the next, back along the dispatch's routings (random and uneven, an expert of every
    rank with no row, the last rank sending nothing back, every row from or to rank 0): fp16
    calls on the same buffers (the collect's wait setting the arrival counts back), then fp32,
    against the op's reference with its all-to-all emulated. tma_a: the GEMM reads its rows
    through TMA. TORCH: torch._grouped_mm in expert order, the put sending each row by its send
    index (the Triton GEMM never launched)."""
    from ditron_inductor import ops
    from ditron_inductor.runtime import moe_combine

    gen = torch.Generator().manual_seed(20 + world)
    # n: a partial second n-tile; torch._grouped_mm's: 16-byte rows
    local_experts, k, n, capacity = 3, 40, 36 if gemm == TRITON else 40, 64
    plan = dataclasses.replace(PLAN, tma_a=tma_a, wait_timeout_s=LIMIT / 1e6, combine_gemm=gemm)
    launched = []

    def grouped_gemm(*args, **kwargs):
        launched.append(1)
        return moe.grouped_gemm(*args, **kwargs)

    monkeypatch.setattr(ops, "_exchange", lambda rows, *splits: rows)  # the rows to send
    ranks = {}  # dtype -> (layout, contexts, states, weights)
    calls = [("random", [13, 20, 7], F16), ("random", [9, 4, 17], F16),
             ("last_receives_nothing", [11, 6, 10], F16), ("all_to_one", [5, 12, 8], F16),
             ("random", [17, 0, 0], F16), ("random", [8, 15, 6], torch.float32)]
    for call, (case, tokens, dtype) in enumerate(calls):
        if dtype not in ranks:
            layout = moe_combine.combine_layout(world, capacity, n, dtype)
            copies = [torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(world)]
            flags = [torch.zeros(4 * moe_combine.arrived_word(world, world), dtype=torch.uint8)
                     for _ in range(world)]
            ctxs = [EmulatedContext(copies, r, flags) for r in range(world)]
            ws = [weights(local_experts, k, n, gen, transposed=r % 2 == 1).to(dtype)
                  for r in range(world)]
            ranks[dtype] = (layout, ctxs, [moe_combine.new_state(c, layout) for c in ctxs], ws)
        layout, ctxs, states, ws = ranks[dtype]
        # the dispatch's routing: rank q's expert-major rows go back through its row_index
        _, back_splits, experts_side = ep_routing(world, local_experts, tokens[:world], k,
                                                  case, gen)
        sends = [splits for splits, _, _, _ in experts_side]
        lefts = [torch.randn(sum(sends[q]), k, generator=gen).to(dtype) for q in range(world)]
        for ctx in ctxs:  # a row left unwritten shows as NaN
            ctx.data.view(-1, dtype, [capacity, n], layout.recv_offset).fill_(float("nan"))
        for r, ctx in enumerate(ctxs):
            moe_combine.publish(ctx, layout, back_splits[r], sends[r])
        waited = []
        for q, ctx in enumerate(ctxs):  # the last to push waits in its put's launch
            _, row_index, offsets, _ = experts_side[q]
            wait = moe_combine.arrival_wait(ctx, layout, plan) if q == world - 1 else None
            waited.append(moe_combine.push(ctx, layout, states[q], plan, lefts[q], ws[q],
                                           offsets, row_index, grouped_gemm, wait))
        assert waited[-1] == (lefts[-1].shape[0] > 0) and not any(waited[:-1])
        refs = emulated_all_to_all([
            ops.grouped_mm_all_to_all_reference([lefts[q].float()], [ws[q].float()],
                                                experts_side[q][2], experts_side[q][1], False,
                                                back_splits[q], sends[q], "0", world)
            for q in range(world)], sends)
        for r, ctx in enumerate(ctxs):
            received = sum(back_splits[r])
            arrived = ctx.flags.view(-1, torch.int32, [world], 4 * moe_combine.arrived_word(world))
            # each sender's rows counted in its own word (set back where the put waited)
            assert arrived.tolist() == ([0] * world if waited[r] else back_splits[r])
            out = moe_combine.collect(ctx, layout, plan, None, received, waited[r])
            assert int(ctx.err[0]) == 0 and not arrived.any()
            assert out.shape == (received, n) and out.dtype == dtype
            assert not out.isnan().any(), (call, r, case)
            if received:
                assert rel_err(out, refs[r]) < 2e-3, (call, r, case)
    assert bool(launched) == (gemm == TRITON)


def test_the_put_kernels_last_program_waits_and_names_rows_that_never_land():
    """The waits in the put's launch (moe_dispatch.tiles_wait, moe_combine.arrival_wait) on rank
    0 of 2 whose peer never pushes: the dispatch's gives up with the tiles' code (ERR_ROWS), the
    combine's names the arrival count of rank 1; each after rank 0's own rows landed."""
    from ditron_inductor.runtime import moe_combine, moe_dispatch
    from ditron_inductor.templates.grouped_gemm import ERR_ROWS

    world, local_experts, k, capacity = 2, 3, 40, 64
    gen = torch.Generator().manual_seed(21)
    plan = dataclasses.replace(PLAN, wait_timeout_s=LIMIT / 1e6, dispatch_gemm=TORCH)
    layout = moe_dispatch.dispatch_layout(world, capacity, k, F16, local_experts, PLAN.block_m)
    ctxs = [EmulatedContext([torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(world)],
                            r) for r in range(world)]
    ctxs[1].data = EmulatedSymm(ctxs[0].data.copies, 1)
    states = [moe_dispatch.new_state(ctx, layout) for ctx in ctxs]
    xs, splits, receivers = ep_routing(world, local_experts, [9, 12], k, "random", gen)
    for r, ctx in enumerate(ctxs):
        out_splits, row_index, offsets, _ = receivers[r]
        moe_dispatch.publish(ctx, layout, states[r], out_splits, splits[r], row_index, offsets,
                             PLAN.block_m)
    try:
        assert moe_dispatch.push(ctxs[0], layout, states[0], xs[0],
                                 moe_dispatch.tiles_wait(ctxs[0], layout, states[0], plan))
        assert int(ctxs[0].err[0]) == ERR_ROWS
        recv = ctxs[0].data.view(-1, F16, [capacity, k], layout.recv_offset)
        mine = receivers[0][1].argsort()[:splits[0][0]]  # my rows for me, expert-major
        assert torch.equal(recv[mine], xs[0][:splits[0][0]])
    finally:
        faults.report().zero_()
    n = 24
    clayout = moe_combine.combine_layout(world, capacity, n, F16)
    flag_copies = [torch.zeros(4 * moe_combine.arrived_word(world, world), dtype=torch.uint8)
                   for _ in range(world)]
    cctxs = [EmulatedContext([torch.zeros(clayout.nbytes, dtype=torch.uint8)
                              for _ in range(world)], r, flag_copies) for r in range(world)]
    cctxs[1].data = EmulatedSymm(cctxs[0].data.copies, 1)
    cstates = [moe_combine.new_state(ctx, clayout) for ctx in cctxs]
    for r, ctx in enumerate(cctxs):  # each rank gets back what it sent, returns what it got
        moe_combine.publish(ctx, clayout, splits[r], receivers[r][0])
    sends, row_index, offsets, _ = receivers[0]
    assert splits[0][1] > 0  # rank 0 expects rows back from rank 1
    left = torch.randn(sum(sends), k, generator=gen).to(F16)
    try:
        assert moe_combine.push(cctxs[0], clayout, cstates[0], plan, left,
                                weights(local_experts, k, n, gen), offsets, row_index,
                                moe.grouped_gemm, moe_combine.arrival_wait(cctxs[0], clayout,
                                                                           plan))
        code = int(cctxs[0].err[0])
        assert moe_combine.wait_name(code - 1, world).startswith("the arrival count of rank 1")
    finally:
        faults.report().zero_()


def test_one_launch_signals_every_peer_then_waits():
    """The multi-rank ops' READY (moe_dispatch.signal_and_wait) on rank 1 of 3: one
    flags.wait_words_kernel writes the epoch into word READY + 1 of each peer's flags (not its
    own), then waits for READY of the ranks it sends to; a receiver's READY one epoch behind
    gives up after the signals went out, naming that rank."""
    from ditron_inductor.runtime import moe_dispatch

    world, epoch = 3, 6
    plan = dataclasses.replace(PLAN, wait_timeout_s=LIMIT / 1e6)
    flag_copies = [torch.zeros(4 * 2 * world, dtype=torch.int32).view(torch.uint8)
                   for _ in range(world)]
    ctx = EmulatedContext([torch.zeros(4, dtype=torch.uint8)] * world, 1, flag_copies)
    words = [c.view(torch.int32) for c in flag_copies]
    addrs = moe_dispatch.ready_addrs(ctx)
    assert addrs.tolist() == [c.data_ptr() + 4 for c in flag_copies]
    words[1][0], words[1][2] = epoch, epoch - 1  # rank 0 published; rank 2 one call behind
    try:
        moe_dispatch.signal_and_wait(ctx, plan, None, addrs, [4, 3, 0], epoch)
        assert int(ctx.err[0]) == 0
        assert [w[1].item() for w in words] == [epoch, 0, epoch]  # READY + 1 on each peer
        assert words[1].tolist()[:world] == [epoch, 0, epoch - 1]
        moe_dispatch.signal_and_wait(ctx, plan, None, addrs, [4, 3, 2], epoch + 1)
        assert int(ctx.err[0]) == ctx.READY + 0 + 1  # READY of rank 0, epoch 6 of 7
        assert [w[1].item() for w in words] == [epoch + 1, 0, epoch + 1]
    finally:
        faults.report().zero_()


def test_the_publish_kernels_last_program_signals_and_waits():
    """The dispatch's step 2 in its publish kernel (moe_dispatch.handshake) on rank 1 of 3,
    over several programs: after every program's routes the last one writes READY + 1 = the
    epoch on each peer and waits for READY of the ranks it sends to, its program count set
    back for the next call; a receiver one epoch behind gives up, naming it, after the
    signals went out."""
    from ditron_inductor.runtime import moe_dispatch, moe_routes

    world, local_experts, k, capacity = 3, 3, 8, 1024
    gen = torch.Generator().manual_seed(31)
    plan = dataclasses.replace(PLAN, wait_timeout_s=LIMIT / 1e6)
    layout = moe_dispatch.dispatch_layout(world, capacity, k, F16, local_experts, PLAN.block_m)
    copies = [torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(world)]
    flag_copies = [torch.zeros(4 * 2 * world, dtype=torch.int32).view(torch.uint8)
                   for _ in range(world)]
    words = [c.view(torch.int32) for c in flag_copies]
    ctx = EmulatedContext(copies, 1, flag_copies)
    state = moe_dispatch.new_state(ctx, layout)
    _, splits, receivers = ep_routing(world, local_experts, [150, 160, 170], k, "random", gen)
    out_splits, row_index, offsets, _ = receivers[1]
    assert sum(out_splits) > moe_routes.PUBLISH_MAX_ROWS  # more than one program
    table = ctx.data.view(-1, torch.int32, [layout.table_words], layout.table_offset)
    dst_row = table[moe_routes.split_words(world):][:sum(out_splits)]
    try:
        for epoch, behind in ((4, False), (5, True)):
            words[1][0], words[1][2] = epoch, epoch - behind  # rank 2 late in the second call
            assert moe_dispatch.publish(ctx, layout, state, out_splits, splits[1], row_index,
                                        offsets, PLAN.block_m,
                                        moe_dispatch.handshake(ctx, plan, state, splits[1],
                                                               epoch))
            assert [w[1].item() for w in words] == [epoch, 0, epoch]  # READY + 1 on each peer
            assert state.done.item() == 0
            assert torch.equal(dst_row[row_index], torch.arange(row_index.numel(),
                                                                dtype=torch.int32))
            assert int(ctx.err[0]) == (ctx.READY + 2 + 1 if behind else 0)
    finally:
        faults.report().zero_()


def test_one_launch_waits_for_every_flag_word_and_names_a_late_one():
    """The multi-rank ops' waits (moe_dispatch.wait_words: one flags.wait_words_kernel for all
    the words) on rank 1 of 3: READY of the ranks it sends to only (not its own, nor one it
    sends nothing), then the combine's ARRIVED counts (one of 0) taken back off the words; a
    READY one epoch behind, or an ARRIVED word a row short, gives up with that word's code."""
    from ditron_inductor.runtime import moe_combine, moe_dispatch
    from ditron_inductor.templates import flags

    world, arrived = 3, moe_combine.arrived_word(3)
    plan = dataclasses.replace(PLAN, wait_timeout_s=LIMIT / 1e6)

    def rank_one():
        flag_copies = [torch.zeros(4 * moe_combine.arrived_word(world, world), dtype=torch.uint8)
                       for _ in range(world)]
        return EmulatedContext([torch.zeros(4, dtype=torch.uint8)] * world, 1, flag_copies)

    counts = torch.tensor([4, 0, 7], dtype=torch.int32)
    ctx = rank_one()
    words = ctx.flags.words
    words[0] = 5  # rank 0's READY for epoch 5; rank 2's never comes, but rank 1 sends it none
    moe_dispatch.wait_ready(ctx, plan, None, [4, 3, 0], 5)
    words[arrived:] = counts
    launch.wait_words(ctx, plan, None, arrived, 0b111, 0, counts)
    assert int(ctx.err[0]) == 0 and not words[arrived:].any()
    try:
        words[arrived:] = counts - torch.tensor([0, 0, 1], dtype=torch.int32)
        launch.wait_words(ctx, plan, None, arrived, 0b111, 0, counts)
        code = int(ctx.err[0])
        assert moe_combine.wait_name(code - 1, world).startswith("the arrival count of rank 2")
        report = faults.report()
        assert [int(report[flags.REPORT_SEEN]), int(report[flags.REPORT_EXPECTED])] == [6, 7]
        faults.report().zero_()
        ctx = rank_one()
        ctx.flags.words[:world] = torch.tensor([5, 0, 4], dtype=torch.int32)
        moe_dispatch.wait_ready(ctx, plan, None, [4, 3, 2], 5)
        assert int(ctx.err[0]) == ctx.READY + 2 + 1  # READY of rank 2, epoch 4 of 5
    finally:
        faults.report().zero_()


def test_multi_rank_combine_declines_before_any_protocol_step(monkeypatch, caplog):
    """The multi-rank combine declines alike on every rank, before its context (symmetric
    memory, signals) is touched: accumulate, a sum of grouped GEMMs, CPU tensors, fewer rows
    received back than the plan's minimum."""
    import logging

    from ditron_inductor.runtime import moe_combine

    def no_protocol(*args, **kwargs):
        raise AssertionError("a protocol step before the decline")

    monkeypatch.setattr(moe_combine, "get_context", no_protocol)
    gen = torch.Generator().manual_seed(13)
    left = torch.randn(6, 16, generator=gen).to(F16)
    w = weights(2, 16, 16, gen)
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    for accumulate, lefts, plan, reason in (
            (True, [left], PLAN, "2 ranks: rows summed into one (accumulate)"),
            (False, [left, left], PLAN, "a sum of 2 grouped GEMMs"),
            (False, [left], PLAN, "2 ranks: rows on cpu"),
            (False, [left], dataclasses.replace(PLAN, min_rows=8),
             "2 ranks: 7 rows to receive, fewer than the plan's 8")):
        args = (lefts, [w] * len(lefts), offsets, torch.arange(6), accumulate, [3, 4], [6, 0],
                "0", 2)
        declined = collections.Counter(launch.declined)
        with caplog.at_level(logging.DEBUG, logger="ditron"):
            assert moe.grouped_mm_all_to_all_fused(task_of(GROUPED_MM_ALL_TO_ALL, *args), plan,
                                                   *args) is None
        assert reason in caplog.text
        # counted by reason, once (what benchmarks/e2e_moe.py reports beside the fused calls)
        (why,) = launch.declined - declined
        assert reason in why and (launch.declined - declined)[why] == 1


def test_multi_rank_ops_take_the_tile_and_engine_for_the_rows_per_expert(monkeypatch):
    """The plan the multi-rank dispatch and combine run (6 rows over 2 local experts here): the
    64-row tile where the rank routes at most small_expert_rows rows per local expert, the plan's
    own tile where it routes more or the plan names its tile (0); the dispatch's GEMMs in
    torch._grouped_mm where it stores its rows output and routes at least library_rows rows per
    local expert, or stores none and routes more than small_expert_rows and fewer than
    library_below_rows, else Triton's tiles; the combine's in torch._grouped_mm from
    library_combine_rows rows per local expert."""
    from ditron_inductor.runtime import moe_combine, moe_dispatch

    ran = []
    monkeypatch.setattr(moe_dispatch, "dispatch",
                        lambda plan, *a: ran.append((plan.block_m, plan.dispatch_gemm)))
    monkeypatch.setattr(moe_combine, "combine",
                        lambda plan, *a: ran.append((plan.block_m, plan.combine_gemm)))
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(6, 16, generator=gen).to(F16)
    w = weights(2, 16, 16, gen)
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    for small, library, combine_rows, rows, want_m, want_gemm, want_combine, below in (
            (3, 0, 0, True, 64, TRITON, TRITON, 0), (2, 0, 0, True, 16, TRITON, TRITON, 0),
            (0, 3, 0, True, 16, TORCH, TRITON, 0), (3, 4, 0, True, 64, TRITON, TRITON, 0),
            (0, 3, 0, False, 16, TRITON, TRITON, 0), (0, 0, 3, False, 16, TRITON, TORCH, 0),
            (0, 3, 4, True, 16, TORCH, TRITON, 0), (2, 0, 0, False, 16, TORCH, TRITON, 4),
            (2, 0, 0, False, 16, TRITON, TRITON, 3), (3, 0, 0, False, 64, TRITON, TRITON, 4)):
        plan = dataclasses.replace(PLAN, small_expert_rows=small, library_rows=library,
                                   library_combine_rows=combine_rows, rows=rows,
                                   library_below_rows=below)
        dispatch = (x, [3, 3], [3, 3], torch.arange(6), [w], offsets, "0", 2)
        moe.all_to_all_grouped_mm_fused(task_of(ALL_TO_ALL_GROUPED_MM, *dispatch), plan,
                                        *dispatch)
        combine = ([x], [w], offsets, torch.arange(6), False, [3, 3], [3, 3], "0", 2)
        moe.grouped_mm_all_to_all_fused(task_of(GROUPED_MM_ALL_TO_ALL, *combine), plan, *combine)
        assert ran == [(want_m, want_gemm), (want_m, want_combine)], (small, library, rows)
        ran.clear()


def test_multi_rank_ops_compare_the_ranks_shapes_before_any_protocol_step(monkeypatch):
    """The multi-rank dispatch and combine hand faults.check_shapes what must agree on every
    rank (the dispatch: x's rows, width and dtype and the local experts; the combine: the rows
    it gets back, their width and dtype) before they make or touch a context."""
    from ditron_inductor.runtime import moe_combine, moe_dispatch

    checked = []

    def check_shapes(op, group_name, shapes, bound_s):
        checked.append((op, group_name, shapes, bound_s))
        raise faults.ShapesDiffer("stop")

    def no_protocol(*args, **kwargs):
        raise AssertionError("a protocol step before the shape check")

    for module in (moe_dispatch, moe_combine):
        monkeypatch.setattr(module, "problem", lambda *args: "")  # past the CPU decline
        monkeypatch.setattr(module, "get_context", no_protocol)
    monkeypatch.setattr(faults, "check_shapes", check_shapes)
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(6, 16, generator=gen).to(F16)
    w = weights(2, 16, 24, gen)
    offsets = torch.tensor([2, 5], dtype=torch.int32)
    plan = dataclasses.replace(PLAN, wait_timeout_s=3.0)
    with pytest.raises(faults.ShapesDiffer):
        moe_dispatch.dispatch(plan, x, [2, 3], [6, 0], torch.arange(5), [w], offsets, "0", 2,
                              moe.grouped_gemm)
    with pytest.raises(faults.ShapesDiffer):
        moe_combine.combine(plan, x, w, offsets, torch.arange(6), False, [4, 2], [6, 0], "0", 2,
                            moe.grouped_gemm)
    assert checked == [("all_to_all_grouped_mm", "0", (6, 16, "torch.float16", 2), 3.0),
                       ("grouped_mm_all_to_all", "0", (6, 24, "torch.float16"), 3.0)]
