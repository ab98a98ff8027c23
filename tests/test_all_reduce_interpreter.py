"""The GEMM + all-reduce (+ residual + RMSNorm) kernels under the Triton interpreter, on emulated
ranks (see test_kernels_interpreter.py): each rank owns host tensors (its symmetric buffer with
the runtime's layout for the kernel; its flag words; its device epoch words), reached through
tables of their addresses.

The interpreter runs one rank at a time, so producers run first: the GEMM partials (and the READY
flags of a chunked GEMM) of every rank before any kernel, then each phase of the kernel (SEND,
REDUCE, COPY, NORMALISE) on every rank before the next phase on any.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by the kernels

import pytest
import torch

pytest.importorskip("triton")

from ditron_inductor.runtime import faults  # noqa: E402
from ditron_inductor.ops import rms_norm_reference  # noqa: E402
from ditron_inductor.templates import flags  # noqa: E402
from ditron_inductor.templates import all_reduce_lamport, all_reduce_push  # noqa: E402
from ditron_inductor.runtime.all_reduce import (  # noqa: E402
    _buffer_elements,
    region_elements,
    row_block,
)
from ditron_inductor.templates.all_reduce_lamport import EMPTY_BITS  # noqa: E402

LIMIT = 50  # polls before a wait gives up


def table(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


class Ranks:
    """W emulated ranks with the state one all-reduce context holds on each GPU."""

    def __init__(self, world, m, n, dtype, data_numel=None):
        self.world, self.m, self.n = world, m, n
        self.data_numel = data_numel or 2 * m * n
        self.data = [torch.full((self.data_numel,), float("nan"), dtype=dtype)
                     for _ in range(world)]
        self.flags = [torch.zeros(flags.FLAG_WORDS, dtype=torch.int32) for _ in range(world)]
        self.epoch = [torch.tensor([0, 1], dtype=torch.int32) for _ in range(world)]
        self.arrive = [torch.zeros(1 + flags.MAX_CHUNKS, dtype=torch.int32) for _ in range(world)]
        self.err = [faults.error_words("cpu")[1] for _ in range(world)]
        self.data_table, self.flag_table = table(self.data), table(self.flags)

    def write_partials(self, partials):
        for r, p in enumerate(partials):  # what cuBLAS writes into the symmetric buffer
            self.data[r][: self.m * self.n] = p.reshape(-1)

    def check_call_finished(self, epoch):
        """No wait gave up, the epoch advanced and the arrival counters are reset."""
        for r in range(self.world):
            assert int(self.err[r][0]) == 0, f"rank {r}: wait gave up (code {int(self.err[r][0])})"
            assert self.epoch[r].tolist() == [epoch, epoch + 1]
            assert int(self.arrive[r].abs().sum()) == 0  # arrival counters reset


def launch_args(ranks, r, h, y, residual, weight):
    return (ranks.data_table, ranks.flag_table, ranks.flags[r], ranks.epoch[r], ranks.arrive[r],
            ranks.err[r], h, y if y is not None else h,
            residual if residual is not None else h, weight if weight is not None else h)


def new_outs(ranks, weight):
    dtype = ranks.data[0].dtype
    shape = (ranks.m, ranks.n)
    return [(torch.full(shape, float("nan"), dtype=dtype),
             torch.full(shape, float("nan"), dtype=dtype) if weight is not None else None)
            for _ in range(ranks.world)]


def started(ranks, r, progs):
    """Rank r's STARTED words: [program, rank that raised it]."""
    return ranks.flags[r][flags.STARTED: flags.STARTED + progs * ranks.world].view(progs, ranks.world)


def push(ranks, residuals, weight, eps, w_fp32, progs, block, outs=None, chunks=0,
         algo="push", gemm=None, rows=None, copy_progs=None, row_block=0):
    """A push kernel (push or push_all): every rank's SEND phase (which raises STARTED, after
    push_all's stores), then every rank's REDUCE (push pushes the sums there), COPY, and with a
    norm NORMALISE; chunks > 0: the GEMM in
    row chunks, each followed by its READY; gemm(r): rank r's GEMM, which raises its READY
    flags itself (chunks of `rows` rows), runs instead. copy_progs: COPY and NORMALISE on that
    many programs (a multiple of progs), as the runtime launches them beside the GEMM.
    row_block: the runtime's ROW_BLOCK (runtime.all_reduce.row_block): COPY normalises the whole
    rows of its blocks, NORMALISE has nothing left to do."""
    m, n, world = ranks.m, ranks.n, ranks.world
    epoch = int(ranks.epoch[0][1])
    rows = rows or (-(-m // chunks) if chunks else m)
    chunked = chunks > 0 or gemm is not None
    for r in range(world):  # the GEMM chunks and their READY copies run first
        if gemm is not None:
            gemm(r)
            continue
        for j in range(-(-m // rows) if chunks else 0):
            ranks.flags[r][flags.READY + j] = ranks.epoch[r][1]
    outs = outs or new_outs(ranks, weight)
    phases = ["SEND", "REDUCE"] + ([] if algo == "push_all" else ["COPY"]) \
        + (["NORMALISE"] if weight is not None else [])
    for phase in phases:
        for r in range(world):
            h, y = outs[r]
            args = (*launch_args(ranks, r, h, y, residuals and residuals[r], weight), m, n, eps,
                    r)
            consts = dict(HAS_RES=residuals is not None, NORM=weight is not None,
                          W_FP32=w_fp32, BLOCK=block, BLOCK_N=block, SEND=phase == "SEND",
                          REDUCE=phase == "REDUCE", NORMALISE=phase == "NORMALISE",
                          **flags.world_constants(world))
            if algo == "push_all":
                stride = region(ranks, algo)
                all_reduce_push.push_all_kernel[(progs,)](*args, stride, stride, LIMIT,
                                                          ROW_BLOCK=row_block, **consts)
            else:
                grid = copy_progs if phase in ("COPY", "NORMALISE") and copy_progs else progs
                all_reduce_push.push_kernel[(grid,)](
                    *args, rows, progs, LIMIT, CHUNKED=chunked, COPY=phase == "COPY",
                    ROW_BLOCK=row_block, **consts)
    ranks.check_call_finished(epoch)
    for r in range(world):
        if not chunked:  # every program of every rank raised STARTED on every rank
            assert started(ranks, r, progs).eq(epoch).all()
        if algo != "push_all":
            pushed = ranks.flags[r][flags.PUSHED: flags.PUSHED + progs * world]
            assert pushed.tolist() == [epoch] * (progs * world), "a program did not push"
    return outs


def ranks_for(path, world, m, n, dtype):
    """Ranks whose buffers have the runtime's size and layout for this path's kernel (lamport:
    every word the empty mark, -0.0, to begin with)."""
    if path not in ("push_all", "lamport", "lamport_all"):
        return Ranks(world, m, n, dtype)
    ranks = Ranks(world, m, n, dtype, _buffer_elements(path, m * n, world)[1])
    if path in LAMPORT:
        for data in ranks.data:
            data.fill_(-0.0)
    return ranks


def region(ranks, algo):
    """The runtime's region size for these ranks' buffers (the kernels' `slots` / `stride`)."""
    return region_elements(ranks.data_numel, algo, ranks.world)


LAMPORT = ("lamport", "lamport_all")  # the kernels whose receive words hold the empty mark


def lamport(ranks, residuals, weight, eps, w_fp32, progs, block, outs=None, algo="lamport",
            row_block=0):
    """A lamport kernel: every rank's SEND, then REDUCE, COPY (lamport_all: none) and (with a
    norm) NORMALISE. After the call every receive word holds the empty mark again. row_block:
    as push's."""
    m, n, world = ranks.m, ranks.n, ranks.world
    epoch = int(ranks.epoch[0][1])
    stride = region(ranks, algo)
    outs = outs or new_outs(ranks, weight)
    phases = ["SEND", "REDUCE"] + (["COPY"] if algo == "lamport" else []) \
        + (["NORMALISE"] if weight is not None else [])
    for phase in phases:
        for r in range(world):
            h, y = outs[r]
            consts = dict(HAS_RES=residuals is not None, NORM=weight is not None,
                          W_FP32=w_fp32, BLOCK=block, BLOCK_N=block, SEND=phase == "SEND",
                          REDUCE=phase == "REDUCE", NORMALISE=phase == "NORMALISE",
                          ROW_BLOCK=row_block, **flags.world_constants(world))
            if algo == "lamport":
                consts["COPY"] = phase == "COPY"
            kernel = (all_reduce_lamport.lamport_kernel if algo == "lamport"
                      else all_reduce_lamport.lamport_all_kernel)
            kernel[(progs,)](*launch_args(ranks, r, h, y, residuals and residuals[r], weight),
                             m, n, eps, r, stride, LIMIT, **consts)
    ranks.check_call_finished(epoch)
    for r in range(world):
        received = ranks.data[r][stride:].view(torch.int16)
        assert received.eq(EMPTY_BITS).all(), f"rank {r}: a receive word was not marked empty"
    return outs


def reference(partials, residual, weight, eps, w_fp32, dtype):
    summed = sum(p.float() for p in partials).to(dtype)  # the all-reduce, rounded once
    h = summed if residual is None else (summed.float() + residual.float()).to(dtype)
    y = None if weight is None else rms_norm_reference(h, weight, eps, w_fp32)
    return h, y


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def check(outs, partials, residuals, weight, eps, w_fp32, dtype):
    """Each rank matches the reference with its own residual (the ranks' residuals differ here):
    fp32 to rounding, 16-bit types to about one unit in the last place (the interpreter's bf16
    casts may round differently). Without residuals every rank has the same bits."""
    for r, (h, y) in enumerate(outs):
        if residuals is None:
            assert torch.equal(h, outs[0][0]), "ranks disagree on h"
        ref = reference(partials, residuals and residuals[r], weight, eps, w_fp32, dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(h, ref[0], atol=1e-5, rtol=1e-5)
            if ref[1] is not None:
                torch.testing.assert_close(y, ref[1], atol=1e-4, rtol=1e-4)
            continue
        assert rel_err(h, ref[0]) < 1e-2
        if ref[1] is not None:
            assert rel_err(y, ref[1]) < 2e-2


SHAPES = [  # (world, M, N, dtype, residual, norm, weight_in_fp32), run by every push kernel
    (2, 1, 40, torch.float32, True, True, True),  # fewer elements than blocks: a partial row
    (4, 7, 72, torch.float16, True, True, False),  # a partial last block
    (3, 10, 40, torch.float16, False, False, False),
    (8, 5, 64, torch.float32, False, True, False),
]
_16_BIT = {torch.float32: torch.float16}  # lamport's empty mark is one 16-bit word
CASES = [  # (world, M, N, dtype, residual, norm, weight_in_fp32, path)
    *[(*shape, path) for path in ("push", "push_all") for shape in SHAPES],
    *[(w, m, n, _16_BIT.get(dtype, dtype), *rest, path) for path in LAMPORT
      for w, m, n, dtype, *rest in SHAPES],
    (2, 256, 16, torch.bfloat16, True, True, True, "push"),  # bfloat16, many block rows
    (4, 13, 40, torch.float32, True, True, True, "push_chunked"),
    (2, 120, 24, torch.float16, True, True, False, "push_chunked"),
    (4, 13, 40, torch.bfloat16, True, True, True, "lamport"),  # several block rows a program
    # blocks of whole rows (BLOCK 16): the copy-out normalises them (one row, two rows a block;
    # a last block with a row past M)
    (2, 37, 16, torch.float32, True, True, True, "push_rows"),
    (4, 21, 8, torch.bfloat16, True, True, False, "push_rows"),
    (3, 45, 8, torch.float16, False, True, False, "push_rows_chunked"),
    # the one-shots and lamport with blocks of whole rows: REDUCE (lamport: COPY) normalises
    (3, 5, 16, torch.float32, True, True, True, "push_all_rows"),
    (2, 9, 8, torch.bfloat16, True, True, False, "lamport_all_rows"),
    (4, 21, 8, torch.float16, True, True, True, "lamport_rows"),
    (2, 1, 16, torch.bfloat16, False, True, False, "lamport_rows"),  # one row, one owner
]


@pytest.mark.parametrize("world,m,n,dtype,res,norm,w_fp32,path", CASES)
def test_all_reduce_rmsnorm(world, m, n, dtype, res, norm, w_fp32, path):
    """Several calls in a row on one set of ranks: the device epoch advances by itself."""
    gen = torch.Generator().manual_seed(m * 31 + n)
    algo = path.split("_rows")[0]  # the kernel; _rows: its blocks hold whole rows
    ranks = ranks_for(algo, world, m, n, dtype)
    weight = (torch.randn(n, generator=gen) * 0.5 + 1).to(torch.float32 if w_fp32 else dtype) \
        if norm else None
    for call in range(3 if m < 100 else 2):
        partials = [torch.randn(m, n, generator=gen).to(dtype) for _ in range(world)]
        residuals = [torch.randn(m, n, generator=gen).to(dtype) for _ in range(world)] \
            if res else None
        ranks.write_partials(partials)
        rows = row_block(n, 16) if "_rows" in path else 0  # as the runtime does
        assert rows or "_rows" not in path
        if algo in LAMPORT:
            outs = lamport(ranks, residuals, weight, 1e-6, w_fp32, progs=3, block=16, algo=algo,
                           row_block=rows)
        else:
            outs = push(ranks, residuals, weight, 1e-6, w_fp32, progs=3, block=16,
                        chunks=2 * world if path.endswith("chunked") else 0,
                        algo="push_all" if algo == "push_all" else "push",
                        row_block=rows)
        check(outs, partials, residuals, weight, 1e-6, w_fp32, dtype)
        assert int(ranks.epoch[0][0]) == call + 1


@pytest.mark.parametrize("path", ["push", "push_all", *LAMPORT])
def test_replay_same_launch_arguments(path):
    """What a CUDA graph replays: the very same launch arguments (output, residual and weight
    tensors, no host epoch) call after call; new partials land in place, the device epoch
    advances by itself and every replay is right."""
    world, m, n = 2, 6, 40
    dtype = torch.float16 if path in LAMPORT else torch.float32  # lamport: 16-bit only
    gen = torch.Generator().manual_seed(7)
    ranks = ranks_for(path, world, m, n, dtype)
    weight = torch.randn(n, generator=gen).to(dtype)
    residuals = [torch.empty(m, n, dtype=dtype) for _ in range(world)]
    outs = new_outs(ranks, weight)
    for replay in range(4):
        partials = [torch.randn(m, n, generator=gen) for _ in range(world)]
        for residual in residuals:
            residual.copy_(torch.randn(m, n, generator=gen))
        ranks.write_partials(partials)
        if path in LAMPORT:
            lamport(ranks, residuals, weight, 1e-5, True, progs=2, block=16, outs=outs,
                    algo=path)
        else:
            push(ranks, residuals, weight, 1e-5, True, progs=2, block=16, outs=outs, algo=path)
        check(outs, partials, residuals, weight, 1e-5, True, dtype)
        assert ranks.epoch[1].tolist() == [replay + 1, replay + 2]


@pytest.mark.parametrize("world,m,n,k,dtype,group_m,b_trans,bias", [
    (3, 37, 48, 40, torch.float16, 1, False, True),  # M, K not multiples of the tile
    (2, 64, 40, 32, torch.float32, 2, True, False),  # a partial column block; B given as B^T
])
def test_push_beside_ready_gemm(world, m, n, k, dtype, group_m, b_trans, bias):
    """The persistent GEMM of templates/gemm_ready.py writes each rank's partial into its
    buffer and raises READY per chunk of GROUP_M row-blocks (counters reset after); the push
    kernel beside it (CHUNKED) waits on those flags; its COPY and NORMALISE run as a second
    launch on twice the programs. Two calls in a row (the epoch advances)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ditron_inductor.templates.gemm_ready import gemm_ready_kernel

    gen = torch.Generator().manual_seed(m + n)
    ranks = Ranks(world, m, n, dtype)
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)
    rows = group_m * tile["BLOCK_M"]
    chunks = -(-m // rows)
    weight = torch.randn(n, generator=gen).to(dtype)
    for call in range(2):
        a = [torch.randn(m, k, generator=gen).to(dtype) for _ in range(world)]
        b = [(torch.randn(k, n, generator=gen) / k ** 0.5).to(dtype) for _ in range(world)]
        biases = [torch.randn(n, generator=gen).to(dtype) if bias else None for _ in range(world)]
        residuals = [torch.randn(m, n, generator=gen).to(dtype) for _ in range(world)]
        partials = []

        def gemm(r):
            partial = ranks.data[r][: m * n].view(m, n)
            bd = (TensorDescriptor.from_tensor(b[r].t().contiguous(), [32, 16]) if b_trans
                  else TensorDescriptor.from_tensor(b[r], [16, 32]))
            gemm_ready_kernel[(3,)](
                TensorDescriptor.from_tensor(a[r], [16, 16]), bd, partial,
                partial if biases[r] is None else biases[r], ranks.flags[r], ranks.arrive[r][1:],
                ranks.epoch[r], m, n, k, HAS_BIAS=bias, B_TRANS=b_trans, GROUP_M=group_m,
                NUM_PROGS=3, **tile)
            ref = a[r].double() @ b[r].double() + (biases[r].double() if bias else 0)
            assert rel_err(partial, ref) < 2e-3
            ready = ranks.flags[r][flags.READY: flags.READY + flags.MAX_CHUNKS]
            assert ready[:chunks].eq(call + 1).all() and ready[chunks:].eq(0).all()
            assert int(ranks.arrive[r].abs().sum()) == 0, "a chunk counter was not reset"
            partials.append(partial.clone())

        outs = push(ranks, residuals, weight, 1e-6, False, progs=3, block=16, gemm=gemm,
                    rows=rows, copy_progs=6)
        check(outs, partials, residuals, weight, 1e-6, False, dtype)


def test_chunk_never_ready_is_reported_not_a_hang():
    """Push beside the GEMM's chunks, chunks whose READY never came: the first bounded wait
    gives up and names READY; the later waits (the other chunks, then PUSHED in COPY, whose
    code is higher) neither wait again nor replace the first flag's code."""
    world, m, n = 2, 4, 16
    ranks = Ranks(world, m, n, torch.float32)
    ranks.write_partials([torch.ones(m, n)] * world)
    h = torch.empty(m, n)
    all_reduce_push.push_kernel[(1,)](*launch_args(ranks, 0, h, None, None, None), m, n, 1e-6, 0,
                                      1, 1, LIMIT, HAS_RES=False, NORM=False,
                                      W_FP32=False, BLOCK=16, BLOCK_N=16, CHUNKED=True,
                                      **flags.world_constants(world))
    assert int(ranks.err[0][0]) == flags.ERR_READY


def test_push_missing_peer_is_reported_not_a_hang():
    """A peer whose program never started: the bounded wait gives up and names STARTED."""
    world, m, n = 2, 1, 16
    ranks = Ranks(world, m, n, torch.float32)
    ranks.write_partials([torch.ones(m, n)] * world)
    h = torch.empty(m, n)
    all_reduce_push.push_kernel[(1,)](*launch_args(ranks, 0, h, None, None, None), m, n, 1e-6, 0,
                                      m, 1, LIMIT, HAS_RES=False, NORM=False,
                                      W_FP32=False, BLOCK=16, BLOCK_N=16, REDUCE=True, COPY=False,
                                      **flags.world_constants(world))
    assert int(ranks.err[0][0]) == flags.ERR_STARTED
    assert started(ranks, 1, 1)[0].tolist() == [1, 0]  # rank 0 raised its own on rank 1


@pytest.mark.parametrize("algo", LAMPORT)
def test_lamport_sends_negative_zero_as_zero(algo):
    """Partials holding -0.0 (the empty mark) and sums that round to -0.0: sent as +0.0, so no
    receiver waits forever, and the results are right."""
    world, m, n, dtype = 2, 3, 32, torch.float16
    ranks = ranks_for(algo, world, m, n, dtype)
    partials = [torch.randn(m, n).to(dtype) for _ in range(world)]
    partials[0][0] = -0.0
    partials[1][0] = -0.0  # a row whose sum is -0.0
    partials[0][1, :4] = -1e-8  # rounds to -0.0 in float16
    ranks.write_partials(partials)
    outs = lamport(ranks, None, None, 1e-6, False, progs=2, block=16, algo=algo)
    check(outs, partials, None, None, 1e-6, False, dtype)
    assert outs[0][0][0].eq(0).all()


@pytest.mark.parametrize("algo", LAMPORT)
def test_lamport_missing_peer_is_reported_not_a_hang(algo):
    """A peer that never sent: the bounded poll gives up and names the lamport data."""
    world, m, n = 2, 1, 16
    ranks = ranks_for(algo, world, m, n, torch.float16)
    ranks.write_partials([torch.ones(m, n, dtype=torch.float16)] * world)
    h = torch.empty(m, n, dtype=torch.float16)
    args = (*launch_args(ranks, 0, h, None, None, None), m, n, 1e-6, 0, region(ranks, algo),
            LIMIT)
    consts = dict(HAS_RES=False, NORM=False, W_FP32=False, BLOCK=16, BLOCK_N=16,
                  **flags.world_constants(world))
    if algo == "lamport":
        all_reduce_lamport.lamport_kernel[(1,)](*args, COPY=False, **consts)  # rank 1 never sends
    else:
        all_reduce_lamport.lamport_all_kernel[(1,)](*args, **consts)
    assert int(ranks.err[0][0]) == flags.ERR_SENT


def test_plans_and_declines():
    from ditron_inductor.runtime.all_reduce import _declines
    from ditron_inductor.scheduler.choose import choose_device_plan
    from ditron_inductor.scheduler.policy import all_reduce_params
    from ditron_inductor.scheduler.task import MATMUL_ALL_REDUCE_RMSNORM, Task

    task = Task(op=MATMUL_ALL_REDUCE_RMSNORM, group_name="0", world_size=8, m=128, k=3584,
                ns=(8192,), dtype=torch.bfloat16, device_type="cuda", reduce_op="sum")
    # fused where it measured a gain: decode sizes replayed in CUDA graphs
    plan, why = choose_device_plan(task, cuda_graphs=True)
    assert plan.impl == "fused" and plan.algo == all_reduce_params(task)["algo"], why
    plan, why = choose_device_plan(task, cuda_graphs=False)
    assert plan is None and "eagerly" in why
    plan, why = choose_device_plan(Task(**{**task.__dict__, "m": 2048}), cuda_graphs=True)
    assert plan is None and "no fused kernel measured a gain" in why  # 8 ranks
    assert choose_device_plan(Task(**{**task.__dict__, "m": 1024}), cuda_graphs=True)[0] is None
    by_m = {m: choose_device_plan(Task(**{**task.__dict__, "m": m}), cuda_graphs=True)[0].algo
            for m in (1, 8, 9, 512)}
    assert by_m == {1: "push_all", 8: "push_all", 9: "push", 512: "push"}
    four = Task(**{**task.__dict__, "world_size": 4})  # lamport: measured on 4 GPUs
    assert {m: all_reduce_params(Task(**{**four.__dict__, "m": m}))["algo"]
            for m in (8, 16, 17, 128, 256)} == {8: "lamport_all", 16: "lamport_all",
                                                17: "lamport", 128: "lamport", 256: "push"}
    prefill = all_reduce_params(Task(**{**four.__dict__, "m": 2048}))  # measured on 4 GPUs
    assert prefill["overlap"] and prefill["gemm"] == "triton"
    plain = Task(**{**task.__dict__, "op": "matmul_all_reduce"})
    assert choose_device_plan(plain, cuda_graphs=True)[0].impl == "fused"
    assert choose_device_plan(Task(**{**plain.__dict__, "m": 513}), cuda_graphs=True)[0] is None
    assert all_reduce_params(task) == {"algo": "push"}

    a, b = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(8, 16, dtype=torch.bfloat16)
    w16, w32 = torch.empty(16, dtype=torch.bfloat16), torch.empty(16)
    assert _declines(a, b, None, None, w16, False, "sum", [4, 16]) is None
    assert _declines(a, b, None, None, w32, True, "sum", [4, 16]) is None
    assert "dtype" in _declines(a, b, None, None, w32, False, "sum", [4, 16])
    assert "reduce_op" in _declines(a, b, None, None, None, False, "avg", [4, 16])
    assert "dtype" in _declines(a.float(), b.float(), None, None, None, False, "sum", [4, 16])
    # a plan naming a kernel that does not exist is an error, not a silent fallback
    from ditron_inductor.scheduler.plan import AllReducePlan

    with pytest.raises(ValueError, match="one_shot"):
        AllReducePlan(algo="one_shot")
    with pytest.raises(ValueError, match="overlap=True is for algo='push'"):
        AllReducePlan(algo="push_all", overlap=True)
    for deleted in ("push_scatter", "copy_engine_two_shot"):
        with pytest.raises(ValueError, match="not one of"):
            AllReducePlan(algo=deleted)


def test_push_grid():
    """Blocks of one 16-byte vector per thread and peer, about 32 or more programs with work,
    never more programs than MAX_PROGS or than the SMs leave (all must be resident)."""
    from ditron_inductor.runtime.all_reduce import push_grid

    assert push_grid(8, 1 * 8192, 132) == (4, 256, 1)  # decode: 1024 elements per rank
    assert push_grid(8, 32 * 8192, 132) == (32, 1024, 4)
    assert push_grid(8, 128 * 8192, 132) == (128, 1024, 4)
    assert push_grid(8, 1024 * 8192, 132) == (128, 4096, 8)
    assert push_grid(8, 256 * 8192, 132) == (64, 4096, 8)  # 4096 from 64 blocks up
    assert push_grid(8, 1024 * 8192, 100) == (96, 4096, 8)
    # 16384 on 32 warps from a block for each of the 128 programs up
    assert push_grid(8, 2048 * 8192, 132) == (128, 16384, 32)
    assert push_grid(8, 2048 * 8192 - 8, 132) == (128, 4096, 8)
    assert push_grid(1, 2048 * 4096, 132, norm=True) == (128, 16384, 32)
    assert push_grid(2, 40, 132) == (1, 256, 1)
    assert push_grid(8, 128 * 8192, 132, block=512, progs=7) == (7, 512, 2)
    assert push_grid(8, 1 * 8192, 132, norm=True) == (1, 1024, 4)  # the norm's 4 warps
    assert push_grid(1, 1 * 8192, 132) == (32, 256, 1)  # push_all: every element


def test_decode_grid_blocks_of_whole_rows():
    """The one-shots with a norm over rows of a power of two 1024..16384: one row a block
    (N / 512 warps), so their copy-out normalises it; the two-shot, a plan's own block, no norm,
    or rows of another N keep push_grid's."""
    from ditron_inductor.runtime.all_reduce import decode_grid, push_grid, row_block
    from ditron_inductor.scheduler.plan import AllReducePlan

    lamport_all, push_all = AllReducePlan(algo="lamport_all"), AllReducePlan(algo="push_all")
    assert decode_grid(lamport_all, 1, 1, 4096, 132, norm=True) == (1, 4096, 8)
    assert decode_grid(lamport_all, 1, 1, 8192, 132, norm=True) == (1, 8192, 16)
    assert decode_grid(push_all, 1, 8, 1024, 132, norm=True) == (8, 1024, 4)
    assert row_block(4096, decode_grid(lamport_all, 1, 7, 4096, 132, norm=True)[1]) == 4096
    # as push_grid: the two-shot (lamport), a plan's own block, no norm, rows of another N
    lamport = AllReducePlan(algo="lamport")
    assert decode_grid(lamport, 2, 16, 4096, 132, norm=True) == push_grid(2, 16 * 4096, 132,
                                                                          norm=True)
    assert decode_grid(lamport_all, 1, 1, 4096, 132, norm=False) == push_grid(1, 4096, 132)
    assert decode_grid(lamport_all, 1, 3, 4000, 132, norm=True) == push_grid(1, 12000, 132,
                                                                              norm=True)
    assert decode_grid(AllReducePlan(algo="lamport", block=1024), 2, 16, 4096, 132,
                       norm=True) == push_grid(2, 16 * 4096, 132, block=1024, norm=True)
    assert decode_grid(lamport_all, 1, 1, 32768, 132, norm=True) == push_grid(1, 32768, 132,
                                                                              norm=True)


def test_cublas_chunks_raise_ready_after_each_chunk(monkeypatch):
    """The cuBLAS GEMM beside push: row chunks of `rows` rows in order, READY[j] raised by a
    copy of the device epoch word after chunk j."""
    from types import SimpleNamespace

    from ditron_inductor.runtime import all_reduce as runtime

    queued = []
    monkeypatch.setattr(runtime, "matmul_into", lambda a, b, bias, out, **kw: queued.append(
        ("gemm", out.shape[0], kw["first_row"])))
    monkeypatch.setattr(runtime.driver, "memcpy",
                        lambda dst, src, n, stream: queued.append(("ready", dst, src, n)))
    monkeypatch.setattr(runtime, "current_stream", lambda: 0)
    ctx = SimpleNamespace(flag_addr=lambda i: 1000 + i)
    dev = SimpleNamespace(epoch=torch.zeros(2, dtype=torch.int32))
    a, b, partial = torch.zeros(10, 4), torch.zeros(4, 3), torch.zeros(10, 3)
    runtime._cublas_chunks(ctx, dev, a, b, None, partial, 4)
    epoch = dev.epoch.data_ptr() + 4
    ready = [1000 + flags.READY + j for j in range(3)]
    assert queued == [("gemm", 4, 0), ("ready", ready[0], epoch, 4), ("gemm", 4, 4),
                      ("ready", ready[1], epoch, 4), ("gemm", 2, 8), ("ready", ready[2], epoch, 4)]


def test_ready_gemm_tile_from_the_plan():
    """The GEMM beside push takes its tile from the plan where it names one (gemm_block_n,
    gemm_stages, gemm_warps), the default tile elsewhere; chunks are whole row-blocks."""
    from ditron_inductor.runtime.all_reduce import _ready_gemm_rows, tile_launch
    from ditron_inductor.scheduler.plan import AllReducePlan, from_params

    def plan(**params):
        return from_params(AllReducePlan, {"overlap": True, "gemm": "triton", **params})

    assert tile_launch(plan(chunks=8).tile) == dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                                                    num_warps=8, num_stages=3)
    tile = tile_launch(plan(gemm_block_n=128, gemm_stages=4, gemm_warps=4).tile)
    assert (tile["BLOCK_M"], tile["BLOCK_N"], tile["num_stages"], tile["num_warps"]) == \
        (128, 128, 4, 4)
    assert plan().for_world(4).chunks == 8 and plan(gemm="cublas").for_world(4).chunks == 8
    assert plan(gemm="cublas").for_world(8).chunks == 16  # 2W row chunks of cuBLAS
    assert _ready_gemm_rows(plan(chunks=16), 2048) == 128  # 16 row-blocks, one a chunk
    assert _ready_gemm_rows(plan(chunks=8), 2000) == 256
    assert _ready_gemm_rows(plan(chunks=64), 16384) == 256  # at most MAX_CHUNKS chunks


@pytest.mark.parametrize("gemm", ["cublas", "triton"])
def test_push_beside_the_gemm_leaves_every_block_to_the_copy_launch(monkeypatch, gemm):
    """Beside the GEMM, REDUCE (few programs) puts every sum into the buffers and the COPY
    launch finishes them all; after the GEMM, REDUCE finishes my own blocks itself. Which one a
    launch does follows its CHUNKED: both launches of the overlapped plan must pass it, or my own
    blocks would be finished by neither."""
    from types import SimpleNamespace

    from ditron_inductor.runtime import all_reduce as runtime
    from ditron_inductor.scheduler.plan import AllReducePlan, from_params

    launches = []
    monkeypatch.setattr(runtime, "launch", lambda kernel, grid, *args, **meta: launches.append(
        (kernel, meta)))
    monkeypatch.setattr(runtime, "gemm_beside",
                        lambda ctx, dev, queue_gemm, side_kernel: side_kernel("side"))
    monkeypatch.setattr(runtime, "matmul_into", lambda *args, **kw: None)
    monkeypatch.setattr(runtime, "num_sms", lambda device: 132)
    ctx = SimpleNamespace(world=2, rank=1, data=torch.zeros(1 << 16), timeout_s=600.0)
    a, b, partial = torch.zeros(64, 8), torch.zeros(8, 16), torch.zeros(64, 16)
    consts = dict(NORM=True, HAS_RES=True, W_FP32=False)
    for overlap in (True, False):
        launches.clear()
        plan = from_params(AllReducePlan, {"algo": "push", "overlap": overlap, "gemm": gemm,
                                           "chunks": 4})
        runtime._push(ctx, None, plan, a, b, None, partial, False, (), consts, 1e-6)
        assert [kernel for kernel, _ in launches] == [runtime.push_kernel] * (2 if overlap else 1)
        assert [meta.get("CHUNKED", False) for _, meta in launches] == [overlap] * len(launches)


@pytest.mark.parametrize("params,m,n,row", [
    (dict(algo="lamport_all"), 1, 1024, 1024),  # a one-shot: a row a block
    (dict(algo="push_all"), 3, 2048, 2048),
    (dict(algo="lamport_all"), 1, 1000, 0),  # rows of another N: push_grid's blocks
    (dict(algo="lamport"), 16, 1024, 0),  # the two-shot: its own blocks, no rows
    (dict(algo="lamport", block=1024), 16, 1024, 1024),  # unless a plan names a block of rows
])
def test_runtime_launches_rows_where_measured(monkeypatch, params, m, n, row):
    """all_reduce_fused's launch of the decode kernels with a norm: BLOCK and ROW_BLOCK as
    decode_grid and _lamport decide them (on 2 ranks emulated in host memory, launch recorded)."""
    from ditron_inductor.runtime import all_reduce
    from ditron_inductor.scheduler.decide import plan_for
    from ditron_inductor.scheduler.task import Task
    from tests.host_ranks import HostContext, all_reduce_on_host

    task = Task(op="matmul_all_reduce_rmsnorm", group_name="0", world_size=2, m=m, k=8,
                ns=(n,), dtype=torch.bfloat16, device_type="cuda")
    ctx = HostContext(2, 0, 1 << 22)
    ctx.connect([ctx, HostContext(2, 1, 16)])
    launched = []
    all_reduce_on_host(monkeypatch, ctx, lambda kernel, grid, args, meta: launched.append(
        (grid, meta["BLOCK"], meta["ROW_BLOCK"])))
    a, b = torch.randn(m, 8, dtype=torch.bfloat16), torch.randn(8, n, dtype=torch.bfloat16)
    residual, weight = torch.randn(m, n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    all_reduce.all_reduce_fused(task, plan_for(task, **params), a, b, None, [], residual, weight,
                                1e-6, False, "sum")
    (grid, block, row_block_launched), = launched
    assert row_block_launched == row and (not row or block == row)


@pytest.mark.parametrize("algo,world,m,n,res,norm,w_fp32,dtype,computed", [
    # rows not a multiple of the chunks, N not a power of two
    ("copy_engine", 2, 37, 96, True, True, False, torch.float16, False),
    ("copy_engine", 2, 16, 64, False, False, False, torch.bfloat16, False),  # the all-reduce alone
    # two peers, the weight's rounding in fp32
    ("copy_engine", 3, 21, 128, True, True, True, torch.float16, False),
    ("copy_engine", 4, 10, 64, True, True, True, torch.float16, False),  # three peers
    # the grouped-GEMM ops: a computed [1, M, N] tensor copied in where the GEMM writes
    ("copy_engine", 3, 37, 96, True, True, False, torch.float16, True),
    ("copy_engine", 2, 16, 64, False, False, False, torch.bfloat16, True),
])
def test_copy_engine_all_reduce_on_host_ranks(monkeypatch, algo, world, m, n, res, norm,
                                              w_fp32, dtype, computed):
    """The copy-engine plan end to end on ranks emulated in host memory (tests/host_ranks.py:
    the copy-engine copies move real bytes; the sum + norm kernel runs in the interpreter), each
    rank a thread whose flag waits spin on the words until the peers set them, three calls on
    new inputs. copy_engine: cuBLAS's row chunks into my slot, each chunk copied into my slot on
    every peer, READY and DONE raised, waited and cleared, then h = the sum + my residual and y =
    its RMSNorm. After the calls every flag is as the first call found it (READY 0, DONE 1),
    which is what lets a CUDA graph replay a captured call. (float16 where y is compared to an ulp: the interpreter
    truncates float32 to bfloat16, a GPU rounds to nearest.)"""
    import threading
    import time

    from ditron_inductor.runtime import all_reduce
    from ditron_inductor.scheduler.decide import plan_for
    from ditron_inductor.scheduler.task import Task
    from tests.host_ranks import HostContext, all_reduce_on_host

    k, calls = 24, 3
    torch.manual_seed(0)
    a = [[torch.randn(m, k, dtype=dtype) for _ in range(world)] for _ in range(calls)]
    b = [torch.randn(k, n, dtype=dtype) for _ in range(world)]
    residual = [torch.randn(m, n, dtype=dtype) if res else None for _ in range(world)]
    weight = torch.rand(n, dtype=dtype) + 0.5 if norm else None
    op = f"{'grouped_mm' if computed else 'matmul'}_all_reduce{'_rmsnorm' if norm else ''}"
    task = Task(op=op, group_name="0", world_size=world, m=m, k=1 if computed else k, ns=(n,),
                dtype=dtype, device_type="cuda")
    if computed:  # what the graph computed: the products, rounded
        a = [[(x.float() @ b[r].float()).to(dtype) for r, x in enumerate(one)] for one in a]
    plan = plan_for(task, algo=algo)
    elements = world * m * n
    ctxs = [HostContext(world, r, elements * 2) for r in range(world)]
    for c in ctxs:
        c.connect(ctxs)
    launched, one_launch = [], threading.Lock()  # the interpreter runs one kernel at a time

    def on_launch(kernel, grid, args, meta):
        with one_launch:
            launched.append(kernel)
            kernel[grid](*args, **meta)

    all_reduce_on_host(monkeypatch, None, on_launch)
    this_rank = threading.local()
    monkeypatch.setattr(all_reduce, "get_context", lambda *args, **kw: ctxs[this_rank.r])
    waits = []  # (rank, flag word, value)

    def wait_geq(ctx, plan, stream, idx, value):  # a stream's wait, as the driver's
        waits.append((ctx.rank, idx, value))
        deadline = time.monotonic() + 60
        while int(ctx.flag_words[idx]) < value:
            assert time.monotonic() < deadline, f"rank {ctx.rank}: flag {idx} never reached"
            time.sleep(1e-4)

    monkeypatch.setattr(all_reduce, "wait_geq", wait_geq)
    outs, failures = {}, []

    def call(x, r):
        if not computed:
            return all_reduce.all_reduce_fused(task, plan, x, b[r], None, [], residual[r],
                                               weight, 1e-6, w_fp32, "sum")
        x = x.view(1, m, n)
        if not norm:
            return all_reduce.grouped_mm_all_reduce_fused(task, plan, x, "sum", "0",
                                                          world).view(m, n), None
        h, y = all_reduce.grouped_mm_all_reduce_rmsnorm_fused(
            task, plan, x, residual[r], weight, 1e-6, w_fp32, "sum", "0", world)
        assert h.shape == y.shape == x.shape
        return h.view(m, n), y.view(m, n)

    def rank(r):
        this_rank.r = r
        try:
            outs[r] = [call(a[i][r], r) for i in range(calls)]
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    assert set(launched) == {all_reduce.sum_slots_norm_kernel}
    # the groups of W flag words each call waits on, in order (DONE before its copies, READY
    # before the sum), and each group's value after the calls
    waited, after = (1, 0), (1, 0)
    for r in range(world):
        peers = [(r + i) % world for i in range(1, world)]
        assert [w[1:] for w in waits if w[0] == r] == [
            (group * world + p, 1) for group in waited for p in peers] * calls
    for q, c in enumerate(ctxs):
        peers = [p for p in range(world) if p != q]
        for group, value in zip(waited, after):
            assert [int(c.flag_words[group * world + p]) for p in peers] == [value] * (world - 1)
    for i in range(calls):
        summed = torch.stack([a[i][q].float() if computed else a[i][q].float() @ b[q].float()
                              for q in range(world)]).sum(0)
        for r in range(world):
            h, y = outs[r][i]
            want_h = summed.to(dtype) if residual[r] is None else (summed.to(dtype) + residual[r])
            torch.testing.assert_close(h, want_h, atol=0.1, rtol=0.02)
            if norm:
                torch.testing.assert_close(y, rms_norm_reference(h, weight, 1e-6, w_fp32),
                                           atol=0, rtol=0.002)  # an ulp of y from the same h
            else:
                assert y is None


def test_sum_slots_norm_kernel_rounds_as_the_reference():
    """The copy-engine all-reduce's sum + norm kernel alone: h is the sum over the slots in
    fp32 rounded once, plus the residual rounded again (bit-exact against torch in that order),
    and y the reference's RMSNorm of h, on rows cut into tiles of 2 with a ragged last one
    (float16: the interpreter truncates float32 to bfloat16, a GPU rounds to nearest)."""
    from ditron_inductor.templates.reduce import sum_slots_norm_kernel

    world, m, n, dtype = 3, 5, 48, torch.float16
    torch.manual_seed(1)
    slots = torch.randn(world, m, n, dtype=dtype)
    residual, weight = torch.randn(m, n, dtype=dtype), torch.rand(n, dtype=dtype) + 0.5
    h, y = torch.empty(m, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
    sum_slots_norm_kernel[(3,)](slots, m * n, h, y, residual, weight, m, n, 1e-6, WORLD=world,
                                HAS_RES=True, NORM=True, W_FP32=False, ROWS=2, BLOCK_N=64)
    want_h = (slots.float().sum(0).to(dtype).float() + residual.float()).to(dtype)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(y, rms_norm_reference(want_h, weight, 1e-6, False), atol=0,
                               rtol=0.002)


def test_copy_engine_declines_what_it_cannot_serve(monkeypatch):
    """Before its protocol starts (alike on every rank: shapes and the capture agree), the
    copy-engine plan declines rows wider than its sum kernel holds and a CUDA-graph capture
    before any eager call made the context (whose setup is collective): the op then runs its
    reference path; nothing was queued."""
    from ditron_inductor.runtime import all_reduce
    from ditron_inductor.runtime.launch import declined
    from ditron_inductor.scheduler.decide import plan_for
    from ditron_inductor.scheduler.plan import COPY_ENGINE_MAX_N
    from ditron_inductor.scheduler.task import Task
    from tests.host_ranks import HostContext, all_reduce_on_host

    ctx = HostContext(2, 0, 1 << 22)
    ctx.connect([ctx, HostContext(2, 1, 1 << 22)])
    queued = []
    all_reduce_on_host(monkeypatch, ctx, lambda *args: queued.append(args))
    monkeypatch.setattr(all_reduce, "matmul_into", lambda *args, **kw: queued.append(args))

    def call(m, n):
        task = Task(op="matmul_all_reduce", group_name="0", world_size=2, m=m, k=8, ns=(n,),
                    dtype=torch.bfloat16, device_type="cuda")
        a, b = torch.randn(m, 8, dtype=torch.bfloat16), torch.randn(8, n, dtype=torch.bfloat16)
        return all_reduce.all_reduce_fused(task, plan_for(task, algo="copy_engine"), a, b, None,
                                           [], None, None, 0.0, False, "sum")

    before = dict(declined)
    assert call(4, COPY_ENGINE_MAX_N + 8) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert call(4, 64) is None
    new = {msg: n - before.get(msg, 0) for msg, n in declined.items() if n != before.get(msg, 0)}
    assert sorted(new) == ["CUDA graph capture before any eager call of this size class",
                           f"the copy-engine all-reduce's sum holds whole rows: "
                           f"N={COPY_ENGINE_MAX_N + 8} > {COPY_ENGINE_MAX_N}"]
    assert queued == [] and not ctx.flag_words.any()
