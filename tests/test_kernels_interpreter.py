"""The fused ops' Triton kernels on CPU under the Triton interpreter, on emulated ranks.

Each emulated rank owns host tensors (its flag words, its error word). There is no concurrency
in the interpreter, so producers (transfers, and flag writes, the driver's stream writes, done on
the host) run before the consumers that wait on them; a wait that could never finish is bounded
(limit) and must report its flag instead of hanging.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by the kernels

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from ditron_inductor.runtime import faults  # noqa: E402
from ditron_inductor.templates import ag_gemm, flags, reduce, schedule, transfer  # noqa: E402
from ditron_inductor.scheduler.task import (  # noqa: E402
    ALL_GATHER_MATMUL,
    MATMUL_ALL_REDUCE,
    Task,
)

BLOCKS = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
LIMIT = 50  # polls before a wait gives up (the interpreter runs producers first)


class Rank:
    def __init__(self, world):
        self.flags = torch.zeros(2 * world, dtype=torch.int32)  # READY[w], DONE[w]
        self.err = faults.error_words("cpu")[1]


def run_ag_gemm(gathered, w, bias, flags, err, rows, rank, epoch, tma, progs=3, limit=LIMIT):
    m, k = gathered.shape
    n = w.shape[1]
    out = torch.full((m, n), float("nan"), dtype=gathered.dtype)
    has_bias = bias is not None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        b_trans = w.stride(0) == 1
        ad = TensorDescriptor.from_tensor(gathered, [16, 32])
        bd = TensorDescriptor.from_tensor(w.t(), [32, 32]) if b_trans else TensorDescriptor.from_tensor(w, [32, 32])
        cd = TensorDescriptor.from_tensor(out, [16, 32])
        ag_gemm.ag_gemm_tma_kernel[(progs,)](
            ad, bd, cd, bias if has_bias else out, flags, err, m, n, k, rows, rank * rows, epoch,
            limit, HAS_BIAS=has_bias, WAIT=True, B_TRANS=b_trans, NUM_PROGS=progs, **BLOCKS)
    else:
        ag_gemm.ag_gemm_kernel[(progs,)](
            gathered, w, out, bias if has_bias else out, flags, err, m, n, k,
            gathered.stride(0), gathered.stride(1), w.stride(0), w.stride(1), out.stride(0),
            out.stride(1), rows, rank * rows, epoch, limit, HAS_BIAS=has_bias, WAIT=True,
            NUM_PROGS=progs, **BLOCKS)
    return out


def ref_mm(a, w, bias=None):
    out = a.double() @ w.double()
    if bias is not None:
        out += bias.double()
    return out


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


# bf16 GEMMs are checked on GPUs only: the Triton interpreter (3.9) computes tl.dot on bf16
# operands wrongly (it treats their bits as integers); its bf16 loads, stores and sums are right.
@pytest.mark.parametrize("dtype", [torch.float16])
@pytest.mark.parametrize("tma", [False, True])
def test_all_gather_matmul_protocol(dtype, tma):
    """Two epochs of the AG protocol on 3 emulated ranks: shards into symmetric buffers, READY on
    every peer, ring-order pulls that raise chunk flags, then the persistent GEMM waiting on them
    (M not a multiple of the block, chunks not block-aligned)."""
    torch.manual_seed(0)
    world, rows, k, n = 3, 20, 48, 64
    ranks = [Rank(world) for _ in range(world)]

    def signal(r, word, epoch):  # word of every peer of r = epoch
        for p in range(world):
            if p != r:
                ranks[p].flags[word] = epoch
    w = torch.randn(k, n, dtype=dtype)
    w_t = torch.randn(n, k, dtype=dtype).t()  # a transposed weight (nn.Linear layout)
    bias = torch.randn(n, dtype=dtype)
    for epoch in (1, 2):
        shards = [torch.randn(rows, k, dtype=dtype) for _ in range(world)]
        symm = [s.clone() for s in shards]  # each rank's symmetric buffer, after its local copy
        for r in range(world):  # producers: every rank says its shard is ready
            signal(r, r, epoch)
        ref_a = torch.cat(shards)
        for r in range(world):
            chunk_flags = torch.zeros(world, dtype=torch.int32)
            chunk_flags.fill_(epoch - 1)  # the previous epoch's flags are still there
            gathered = torch.empty(world * rows, k, dtype=dtype)
            gathered[r * rows:(r + 1) * rows] = symm[r]
            chunk_flags[r] = epoch
            for i in range(1, world):  # ring-order pulls, each followed by its chunk flag
                p = (r + i) % world
                flags.wait_flags_kernel[(1,)](ranks[r].flags, p, 1, epoch, LIMIT, ranks[r].err)
                gathered[p * rows:(p + 1) * rows] = symm[p]
                chunk_flags[p] = epoch
            signal(r, world + r, epoch)
            assert int(ranks[r].err[0]) == 0
            for weight, b in ((w, None), (w_t, bias)):
                out = run_ag_gemm(gathered, weight, b, chunk_flags, ranks[r].err, rows, r,
                                  epoch, tma)
                assert int(ranks[r].err[0]) == 0
                assert not torch.isnan(out).any()
                assert rel_err(out, ref_mm(ref_a, weight, b)) < 1e-2
        for r in range(world):  # every peer reported DONE for this epoch
            assert all(int(ranks[r].flags[world + p]) == epoch for p in range(world) if p != r)


@pytest.mark.parametrize("words,progs", [(1, 1), (37, 2), (64, 3), (1000, 4)])
def test_copy_twice_writes_both_destinations_and_nothing_else(words, progs):
    """The all-gather's local copies (my shard -> my symmetric buffer and my rows of the gathered
    A) as one kernel: every word lands in both, on sizes that are not a multiple of BLOCK or of
    the grid's stride, and the words around the destinations stay as they were."""
    torch.manual_seed(words)
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32)
    buffer = torch.full((words + 8,), -7, dtype=torch.int32)
    gathered = torch.full((3 * words,), -9, dtype=torch.int32)
    mine = gathered[words:2 * words]  # rank 1's rows of a gathered A of 3 ranks
    transfer.copy_twice_kernel[(progs,)](src, buffer[4:], mine, words, BLOCK=16)
    assert torch.equal(buffer[4:4 + words], src) and torch.equal(mine, src)
    assert (buffer[:4] == -7).all() and (buffer[4 + words:] == -7).all()
    assert (gathered[:words] == -9).all() and (gathered[2 * words:] == -9).all()


@pytest.mark.parametrize("rank, world, rows, k", [(1, 3, 5, 6), (0, 2, 4, 8), (3, 4, 7, 2)])
def test_all_gathers_local_copies_land_where_the_protocol_reads_them(rank, world, rows, k):
    """runtime/all_gather.copy_twice_args builds the local copies' launch: my shard lands in my
    symmetric buffer at the parity's byte offset (what the peers pull) and in my rows of the
    gathered A (chunk `rank`), and nothing else of either is written."""
    from ditron_inductor.runtime.all_gather import copy_twice_args
    from ditron_inductor.runtime.symm import SymmBuffer

    class Ctx:  # the two fields copy_twice_args reads of an OpContext
        pass
    ctx = Ctx()
    ctx.rank = rank
    shard_bytes = rows * k * 2
    local = torch.zeros(4 * shard_bytes, dtype=torch.uint8)
    ctx.data = SymmBuffer(local, [local] * world)
    a2d = torch.randn(rows, k, dtype=torch.float16)
    gathered = torch.full((world * rows, k), float("nan"), dtype=torch.float16)
    off = 2 * shard_bytes  # the odd parity's half
    kernel, grid, *args = copy_twice_args(ctx, a2d, gathered, off, programs=2)
    kernel[grid](*args, BLOCK=8)
    symm = local.view(torch.float16)
    assert torch.equal(symm[off // 2:off // 2 + rows * k].view(rows, k), a2d)
    assert not symm[:off // 2].any() and not symm[off // 2 + rows * k:].any()
    assert torch.equal(gathered[rank * rows:(rank + 1) * rows], a2d)
    others = torch.cat([gathered[:rank * rows], gathered[(rank + 1) * rows:]])
    assert others.isnan().all()
    # a shard of an odd number of 2-byte elements is not whole words: two memcpys instead
    assert copy_twice_args(ctx, a2d[:, :1][:1], gathered, off, programs=2) is None


def test_all_gather_matmul_missing_chunk_reports_flag():
    """A chunk whose flag never reaches the epoch: the bounded wait records which one."""
    world, rows, k, n = 2, 16, 32, 32
    gathered = torch.randn(world * rows, k, dtype=torch.float16)
    w = torch.randn(k, n, dtype=torch.float16)
    flags = torch.tensor([5, 4], dtype=torch.int32)  # chunk 1 is one epoch behind
    err = faults.error_words("cpu")[1]
    run_ag_gemm(gathered, w, None, flags, err, rows, 0, 5, tma=False, progs=1)
    assert int(err[0]) == 1 + 1  # code = chunk + 1


@pytest.mark.parametrize("k, kernel", [(20, "ag_gemm_kernel"), (32, "ag_gemm_tma_kernel")])
def test_triton_gemm_takes_pointers_where_tma_declines_the_operands(monkeypatch, k, kernel):
    """runtime/launch.triton_gemm on an all-gather plan's tile: K not a multiple of 8 (rows TMA
    cannot take) runs the pointer kernel, K = 32 the TMA one; both wait on the chunk flags."""
    from ditron_inductor.runtime import launch
    from ditron_inductor.scheduler.plan import AllGatherPlan, GemmTile

    launched, real_launch = [], launch.launch
    monkeypatch.setattr(launch, "launch", lambda kern, grid, *args, **meta: (
        launched.append(kern), real_launch(kern, grid, *args, **meta)))
    world, rows, n, epoch = 2, 16, 32, 3
    torch.manual_seed(k)
    gathered = torch.randn(world * rows, k, dtype=torch.float16)
    w = torch.randn(k, n, dtype=torch.float16)
    out = torch.full((world * rows, n), float("nan"), dtype=torch.float16)
    err = faults.error_words("cpu")[1]
    plan = AllGatherPlan(tile=GemmTile(block_m=16, block_n=32, block_k=32, group_m=2))
    launch.triton_gemm(gathered, w, None, out, plan.tile, err=err, rows_per_chunk=rows,
                       flags=torch.full((world,), epoch, dtype=torch.int32), first_row=rows,
                       epoch=epoch, num_progs=4, limit=LIMIT)
    assert launched == [getattr(ag_gemm, kernel)] and int(err[0]) == 0
    assert rel_err(out, ref_mm(gathered, w)) < 1e-2


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter_protocol(reduce_op):
    """GEMM+RS on 4 emulated ranks: each rank computes its partials (torch's GEMM standing in for
    cuBLAS) in ring order (rank+1 first), pushes each into the owner's receive slot and notifies
    it; owners wait for every READY and reduce their slots with reduce_slots_kernel."""
    torch.manual_seed(1)
    world, rows, k, n = 4, 12, 40, 48
    dtype = torch.float16
    ranks = [Rank(world) for _ in range(world)]
    recv = [torch.full((world, rows, n), float("nan"), dtype=dtype) for _ in range(world)]
    a = [torch.randn(world * rows, k, dtype=dtype) for _ in range(world)]
    b = [torch.randn(k, n, dtype=dtype) for _ in range(world)]
    bias = [torch.randn(n, dtype=dtype) for _ in range(world)]
    epoch = 1
    for r in range(world):
        order = [(r + i) % world for i in range(1, world)] + [r]
        assert order[0] == (r + 1) % world and order[-1] == r
        for p in order:
            part = torch.addmm(bias[r].float(), a[r][p * rows:(p + 1) * rows].float(),
                               b[r].float()).to(dtype)
            recv[p][r] = part  # the copy-engine push
            ranks[p].flags[r] = epoch  # READY[r] on p
    for r in range(world):
        flags.wait_flags_kernel[(1,)](ranks[r].flags, 0, world, epoch, LIMIT, ranks[r].err)
        assert int(ranks[r].err[0]) == 0
        out = torch.empty(rows, n, dtype=dtype)
        reduce.reduce_slots_kernel[(3,)](recv[r], out, rows * n, rows * n, world,
                                         0.25 if reduce_op == "avg" else 1.0, BLOCK=256)
        ref = sum(ref_mm(a[q][r * rows:(r + 1) * rows], b[q], bias[q]) for q in range(world))
        if reduce_op == "avg":
            ref = ref / world
        assert rel_err(out, ref) < 1e-2


def test_reduce_slots_bf16():
    world, n = 3, 1000
    src = torch.randn(world, n, dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    reduce.reduce_slots_kernel[(4,)](src, out, n, n, world, 1.0 / world, BLOCK=256)
    assert rel_err(out, src.double().mean(0)) < 1e-2


def test_wait_gives_up_and_names_the_flag():
    words = torch.tensor([3, 3, 2], dtype=torch.int32)
    err = faults.error_words("cpu")[1]
    flags.wait_flags_kernel[(1,)](words, 0, 3, 3, LIMIT, err)
    assert int(err[0]) == 3  # flag 2 (+1)
    err = faults.error_words("cpu")[1]
    flags.wait_flags_kernel[(1,)](words, 0, 2, 3, LIMIT, err)
    assert int(err[0]) == 0


def task_of(op, world):
    return Task(op=op, group_name="0", world_size=world, m=8, k=8, ns=(8,), dtype=torch.bfloat16,
                device_type="cuda")


def ring(world, rank):
    return task_of(ALL_GATHER_MATMUL, world).ring_order(rank)


@triton.jit
def schedule_kernel(ring_ptr, blocks_ptr, rank, ROWS: tl.constexpr, WORLD: tl.constexpr,
                    WORLD_P2: tl.constexpr):
    """ring_ptr[i] = the i-th rank of `rank`'s ring; blocks_ptr[i, q] = the block of block row i
    that rank q reduces."""
    ranks = tl.arange(0, WORLD_P2)
    tl.store(ring_ptr + ranks, schedule.ring_member(rank, ranks, WORLD), mask=ranks < WORLD)
    rows = tl.arange(0, ROWS)
    tl.store(blocks_ptr + rows[:, None] * WORLD + ranks[None, :],
             schedule.owned_block(rows[:, None], ranks[None, :], WORLD),
             mask=ranks[None, :] < WORLD)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_kernels_follow_the_tasks_schedule(world):
    rows = 4
    task = task_of(MATMUL_ALL_REDUCE, world)
    for rank in range(world):
        order = torch.full((world,), -1, dtype=torch.int32)
        blocks = torch.full((rows, world), -1, dtype=torch.int32)
        schedule_kernel[(1,)](order, blocks, rank, ROWS=rows,
                              **flags.world_constants(world))
        assert order.tolist() == task.ring_order(rank)
    # every block once, block row i holding one block of each rank, as the Task assigns them
    assert sorted(blocks.flatten().tolist()) == list(range(rows * world))
    for i in range(rows):
        assert [task.block_owner(g) for g in blocks[i].tolist()] == list(range(world))


def test_chunk_groups_follow_the_ring():
    from ditron_inductor.runtime.all_gather import chunk_groups, chunk_runs
    from ditron_inductor.scheduler.plan import default_groups

    assert sum(default_groups(8)) == 8 and default_groups(8)[0] == 1

    groups = chunk_groups(ring(8, 6), [1, 3, 4])
    assert groups == [[6], [7, 0, 1], [2, 3, 4, 5]]
    assert chunk_runs([7, 0, 1]) == [(7, 7), (0, 1)]
    assert [c for g in chunk_groups(ring(4, 1), default_groups(4)) for c in g] == [1, 2, 3, 0]


@triton.jit
def _wait_all_kernel(flags_ptr, wants_ptr, epoch, limit, err_ptr, PER_FLAG: tl.constexpr):
    i = tl.arange(0, 8)
    on = i < 6
    want = tl.load(wants_ptr + i, mask=on, other=0) if PER_FLAG else epoch
    flags.wait_all(flags_ptr + i, on, want, limit, err_ptr, 3)


@pytest.mark.parametrize("per_flag", [False, True])
def test_wait_all_reports_the_late_lane_with_what_it_saw_and_expected(per_flag):
    """flags.wait_all polls its flags together against one epoch, or one value per flag (the
    MoE dispatch's tile counters): flags at or past theirs pass; the one most behind gives up
    after the bound with its lane, the value seen and the one expected (lanes past the mask
    never count)."""
    wants = torch.tensor([5, 7, 2, 9, 4, 6, 0, 0], dtype=torch.int32)
    epoch = 5
    base = wants if per_flag else torch.full((8,), epoch, dtype=torch.int32)
    values = base + torch.tensor([0, 1, 2, 0, 3, 1, -99, -99], dtype=torch.int32)
    err = faults.error_words("cpu")[1]
    _wait_all_kernel[(1,)](values, wants, epoch, LIMIT, err, PER_FLAG=per_flag)
    assert int(err[0]) == 0
    values[3] -= 2
    values[1] -= 1
    try:
        _wait_all_kernel[(1,)](values, wants, epoch, LIMIT, err, PER_FLAG=per_flag)
        assert int(err[0]) == 3
        report = faults.report()
        want = int(base[3])
        assert [int(report[flags.REPORT_SEEN]), int(report[flags.REPORT_EXPECTED]),
                int(report[flags.REPORT_PEER])] == [want - 2, want, 3]
    finally:
        faults.report().zero_()
