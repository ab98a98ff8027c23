"""GEMM + reduce-scatter with the reduction beside the GEMM (templates/reduce_scatter.py, and the
GEMM of templates/gemm_ready.py with SLICES = W) under the Triton interpreter, on the emulated
ranks of test_all_reduce_interpreter.py: every rank's GEMM first (it raises READY per chunk),
then every rank's pull."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by the kernels

import pytest
import torch

pytest.importorskip("triton")

from ditron_inductor.templates import flags  # noqa: E402
from ditron_inductor.templates.reduce_scatter import pull_reduce_kernel  # noqa: E402
from tests.test_all_reduce_interpreter import LIMIT, Ranks, rel_err  # noqa: E402

TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)


def ready_gemm(ranks, r, a, b, bias, slice_blocks, per_chunk, half, b_trans):
    """Rank r's partial a @ b (+ bias) into the half of its buffer of the call's epoch parity."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ditron_inductor.templates.gemm_ready import gemm_ready_kernel

    (m, k), n = a.shape, b.shape[1]
    b_desc = (TensorDescriptor.from_tensor(b.t().contiguous(), [32, 16]) if b_trans
              else TensorDescriptor.from_tensor(b, [16, 32]))
    gemm_ready_kernel[(3,)](
        TensorDescriptor.from_tensor(a, [16, 16]), b_desc, ranks.data[r],
        ranks.data[r] if bias is None else bias, ranks.flags[r], ranks.arrive[r][1:],
        ranks.epoch[r], m, n, k, slice_blocks, half, HAS_BIAS=bias is not None,
        B_TRANS=b_trans, GROUP_M=ranks.world * per_chunk, NUM_PROGS=3, SLICES=ranks.world,
        PARITY=True, **TILE)


def pull(ranks, r, out, per_chunk, half, reduce_op, progs=2, block=64):
    rows, n = out.shape
    pull_reduce_kernel[(progs,)](
        ranks.data_table, ranks.flag_table, ranks.epoch[r], ranks.arrive[r], ranks.err[r], out,
        rows, n, r, per_chunk * TILE["BLOCK_M"], half, 1.0 / ranks.world, LIMIT, BLOCK=block,
        SCALE=reduce_op == "avg", **flags.world_constants(ranks.world))


@pytest.mark.parametrize("world,slice_blocks,per_chunk,n,k,dtype,b_trans,bias,reduce_op", [
    (3, 2, 1, 48, 40, torch.float16, False, True, "sum"),  # a partial column block, K tail
    (2, 4, 2, 40, 32, torch.float32, True, False, "avg"),  # B given as B^T, 2 chunks of 2
])
def test_pull_reduce_beside_ready_gemm(world, slice_blocks, per_chunk, n, k, dtype, b_trans,
                                       bias, reduce_op):
    """Each rank ends with its rows of the sum (avg: mean) of all partials; the GEMM writes its
    chunks slice by slice and READY per chunk; three calls in a row alternate the halves of the
    buffers, and a call leaves the other half (where a slow peer may still read the last call's
    partial) as the last call wrote it."""
    gen = torch.Generator().manual_seed(world * 100 + n)
    rows = slice_blocks * TILE["BLOCK_M"]
    m = world * rows
    chunks = slice_blocks // per_chunk
    half = m * n
    ranks = Ranks(world, m, n, dtype, data_numel=2 * half)
    for call in range(3):
        epoch = call + 1
        parity = epoch % 2
        before = [d[(1 - parity) * half:(2 - parity) * half].clone() for d in ranks.data]
        a = [torch.randn(m, k, generator=gen).to(dtype) for _ in range(world)]
        b = [(torch.randn(k, n, generator=gen) / k ** 0.5).to(dtype) for _ in range(world)]
        biases = [torch.randn(n, generator=gen).to(dtype) if bias else None for _ in range(world)]
        for r in range(world):
            ready_gemm(ranks, r, a[r], b[r], biases[r], slice_blocks, per_chunk, half, b_trans)
            ready = ranks.flags[r][flags.READY: flags.READY + flags.MAX_CHUNKS]
            assert ready[:chunks].eq(epoch).all() and ready[chunks:].eq(0).all()
            assert int(ranks.arrive[r][1:].abs().sum()) == 0, "a chunk counter was not reset"
        partials = [d[parity * half:(parity + 1) * half].view(m, n).clone() for d in ranks.data]
        for r in range(world):
            ref = a[r].double() @ b[r].double() + (biases[r].double() if bias else 0)
            assert rel_err(partials[r], ref) < 2e-3
            other = ranks.data[r][(1 - parity) * half:(2 - parity) * half]
            assert torch.equal(other.isnan(), before[r].isnan())
            assert torch.equal(other.nan_to_num(), before[r].nan_to_num()), \
                "the GEMM wrote into the other parity's half"
        outs = [torch.full((rows, n), float("nan"), dtype=dtype) for _ in range(world)]
        for r in range(world):
            pull(ranks, r, outs[r], per_chunk, half, reduce_op)
        ranks.check_call_finished(epoch)
        total = sum(p.float() for p in partials) * (1 / world if reduce_op == "avg" else 1)
        for r in range(world):
            expected = total[r * rows:(r + 1) * rows].to(dtype)
            if dtype == torch.float32:
                torch.testing.assert_close(outs[r], expected, atol=1e-5, rtol=1e-5)
            else:
                assert rel_err(outs[r], expected) < 1e-2


def test_chunk_never_ready_is_reported_not_a_hang():
    """A peer whose GEMM never raised READY: the first bounded wait gives up and names READY;
    the call still ends (epoch advanced)."""
    world, rows, n = 2, 16, 32
    ranks = Ranks(world, world * rows, n, torch.float32, data_numel=4 * rows * n)
    ranks.flags[0][flags.READY] = 1  # my own chunk 0 is ready, rank 1's never is
    out = torch.empty(rows, n)
    pull(ranks, 0, out, per_chunk=1, half=2 * rows * n, reduce_op="sum", progs=1)
    assert int(ranks.err[0]) == flags.ERR_READY
    assert ranks.epoch[0].tolist() == [1, 2]


def test_chunks_and_declines():
    from ditron_inductor.runtime.reduce_scatter import chunk_blocks, pull_declines

    assert chunk_blocks(8, 8) == 1  # M=8192 on 8 ranks: 8 chunks of one row-block a slice
    assert chunk_blocks(16, 8) == 2  # M=8192 on 4 ranks
    assert chunk_blocks(12, 8) == 2  # 6 equal chunks, not 8 unequal ones
    assert chunk_blocks(7, 4) == 7  # a prime number of blocks: one chunk
    assert chunk_blocks(256, 1000) == 4  # at most MAX_CHUNKS
    assert pull_declines(8192, 1024, 8192, 8, 2, 128) is None
    assert "row blocks" in pull_declines(8 * 100, 1024, 8192, 8, 2, 128)
    assert "ranks" in pull_declines(32 * 128, 64, 64, 32, 2, 128)
    assert "2**31" in pull_declines(65536, 1024, 16384, 8, 2, 128)
    assert "K = 0" in pull_declines(8192, 0, 8192, 8, 2, 128)
