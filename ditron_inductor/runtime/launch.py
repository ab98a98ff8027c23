"""What the fused implementations share: declining an input, flag waits on a stream, errors of
bounded waits, and the GEMM launchers (the persistent Triton tile programs, cuBLAS). A fused
implementation returns None (the op runs its reference path) for an input it does not serve,
before any protocol step and for rank-invariant reasons (shapes, dtypes, the plan), so that every
rank declines alike; `decline` logs why at debug level.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from typing import Optional

import torch

from ..log_names import LOGGER_NAME
from ..scheduler.decode_gemm import gemv_applies
from ..scheduler.plan import FusedPlan, GemmTile
from ..scheduler.precision import FUSED_DTYPES
from ..templates import flags
from ..templates.gemm_ready import gemm_ready_kernel
from . import driver, faults
from .context import OpContext, wait_limit, wait_seconds
from .gemv import decode_mm
from .kernel_launch import cdiv, current_stream, launch, next_power_of_2

log = logging.getLogger(LOGGER_NAME)

DTYPES = FUSED_DTYPES  # the scheduler decides on them (scheduler/precision.py)

# each runtime decline's reason, counted (what the benchmarks report beside the fused calls)
declined: collections.Counter = collections.Counter()


def bias_serves(bias, dtype: torch.dtype, n: int) -> bool:
    """Whether the fused GEMMs take `bias`: none, or one value per column in the product's
    dtype (what cuBLAS's addmm into the product's buffer takes)."""
    return bias is None or (bias.dim() == 1 and bias.dtype == dtype and bias.shape[0] == n)


def decline(msg: str):
    declined[msg] += 1
    log.debug("fused path declined: %s", msg)
    return None


def wait_geq(ctx: OpContext, plan: FusedPlan, stream: int, idx: int, value: int) -> None:
    """The stream (a CUstream handle) waits until my symmetric flag word idx >= value: where
    waits are bounded, a one-program kernel that gives up and reports the flag (a stream wait
    of the driver takes no bound), else the driver's stream wait."""
    if value <= 0:
        return
    limit = wait_limit(plan, ctx)
    if limit:
        launch(flags.wait_flags_kernel, (1,), ctx.flags.words, idx, 1, value, limit,
               faults.site_words(ctx, plan.site), stream=stream)
    else:
        driver.wait_geq(stream, ctx.flag_addr(idx), value)


def wait_words(ctx: OpContext, plan: FusedPlan, stream, first: int, mask: int, want: int,
               wants=None, signal: Optional[tuple] = None) -> None:
    """The stream waits until my flag word first + i >= want (wants[i], then taken back off the
    word) for each bit i of mask, in one launch (flags.wait_words_kernel) rather than one wait
    per word; bounded as wait_geq's waits are, unbounded where the bound is 0. signal
    (addresses, mask, value): before the wait, in the same launch, the word at addresses[i]
    (an int64 tensor of flag-word addresses) = value for each bit i of mask, in place of
    ctx.signal's stream write per word."""
    addrs, signal_mask, value = signal if signal is not None else (None, 0, 0)
    if mask or signal_mask:
        launch(flags.wait_words_kernel, (1,), ctx.flags.words, first, mask, want,
               ctx.flags.words if wants is None else wants, wait_limit(plan, ctx),
               faults.site_words(ctx, plan.site),
               ctx.flags.words if addrs is None else addrs, signal_mask, value,
               WORDS=next_power_of_2(ctx.world), TAKE=wants is not None,
               SIGNAL=bool(signal_mask), stream=stream)


def context_flag(ctx: OpContext, code: int, peer: int = -1) -> str:
    """The name of my flag word code - 1 (READY + q or DONE + q, runtime/context.py)."""
    idx = code - 1
    if 0 <= idx < ctx.world:
        return f"READY of rank {idx} (its data for this call in place)"
    if ctx.world <= idx < 2 * ctx.world:
        return f"DONE of rank {idx - ctx.world} (done with my buffer of the last call)"
    return f"flag word {idx}"


def check_errors(ctx: OpContext, plan: FusedPlan, what: str, flag_name=None) -> None:
    """After a call's protocol is queued: what names its waits (faults.note), and the error of a
    wait of this process that gave up, read from host memory without synchronising: it surfaces
    at the next fused call (and from the watcher thread: runtime/faults.py)."""
    seconds = wait_seconds(plan, ctx)
    if seconds:
        faults.note(ctx, what, seconds, flag_name or functools.partial(context_flag, ctx),
                    plan.site)
        faults.raise_if_failed()


WAIT_NAMES = {flags.ERR_READY: "READY (a chunk of a peer's GEMM)",
               flags.ERR_PUSHED: "PUSHED (a peer's pushed sums)",
               flags.ERR_LOCAL: "LOCAL (this GPU's programs, before the norm)",
               flags.ERR_STARTED: "STARTED (a peer's partial)",
               flags.ERR_SENT: "lamport data (a peer's partial or sums)"}


def kernel_flag(code: int, peer: int = -1) -> str:
    """The name of a wait of the all-reduce kernels (templates/flags.py's codes); peer: the lane
    a vector wait found late (a rank; a program of mine for LOCAL)."""
    name = WAIT_NAMES.get(code, f"flag code {code}")
    if peer < 0:
        return name
    return f"{name} of {'my program' if code == flags.ERR_LOCAL else 'rank'} {peer}"


def gemm_failed(ctx: OpContext, main: int, exc: Exception):
    """The GEMM could not be launched (alike on every rank: same config, same compiler). The
    transfers already queued complete and the main stream joins them, so the protocol's
    invariants hold; the op takes its reference path."""
    driver.stream_wait(main, ctx.ev_end)
    log.warning("ditron: fused GEMM failed (%s: %s); running the reference path",
                type(exc).__name__, str(exc)[:300])
    return None


@functools.lru_cache(None)
def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ok(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Optional[bool]:
    """None if TMA cannot take these operands, else whether B is given transposed ([N, K] rows)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return None
    k, n = b.shape
    if (k % 8 or n % 8 or a.stride(1) != 1 or out.stride(1) != 1 or a.stride(0) % 8
            or out.stride(0) % 8 or any(t.data_ptr() % 16 for t in (a, b, out))):
        return None
    if b.stride(1) == 1 and b.stride(0) % 8 == 0:
        return False
    if b.stride(0) == 1 and b.stride(1) % 8 == 0:
        return True
    return None


def _descriptors(a, b, b_trans, block_m: int, block_n: int, block_k: int):
    """TMA descriptors of A's [block_m, block_k] tiles and B's (of B^T [N, K] where b_trans)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b_desc = (TensorDescriptor.from_tensor(b.t(), [block_n, block_k]) if b_trans
              else TensorDescriptor.from_tensor(b, [block_k, block_n]))
    return TensorDescriptor.from_tensor(a, [block_m, block_k]), b_desc


def triton_gemm(a, b, bias, out, tile: GemmTile, *, flags=None, err=None, rows_per_chunk=1,
                first_row=0, epoch=0, num_progs=None, limit=0, waits_beside=False):
    """out = a @ b (+ bias) with the persistent tile program, through TMA where the operands
    allow it, else through pointers; with flags, tiles wait on them (limit > 0: each wait gives
    up after that long, context.wait_limit); waits_beside: bounded stream waits (kernels) run
    beside it."""
    from ..templates.ag_gemm import ag_gemm_kernel, ag_gemm_tma_kernel

    m, k = a.shape
    n = b.shape[1]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    sms = num_progs or num_sms(a.device)
    if limit and waits_beside:
        sms = max(1, sms - 2)  # bounded stream waits run as kernels beside it: leave them SMs
    progs = max(1, min(sms, cdiv(m, bm) * cdiv(n, bn)))
    # bias, flags, err: `out` stands in for those not given (the kernel does not read them)
    unread = (out if bias is None else bias, out if flags is None else flags,
              out if err is None else err)
    meta = dict(HAS_BIAS=bias is not None, WAIT=flags is not None, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk, GROUP_M=tile.group_m, NUM_PROGS=progs, num_warps=tile.warps,
                num_stages=tile.stages)
    b_trans = tma_ok(a, b, out)
    if b_trans is None:
        launch(ag_gemm_kernel, (progs,), a, b, out, *unread, m, n, k, a.stride(0), a.stride(1),
               b.stride(0), b.stride(1), out.stride(0), out.stride(1), rows_per_chunk,
               first_row, epoch, limit, **meta)
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor

        c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
        launch(ag_gemm_tma_kernel, (progs,), *_descriptors(a, b, b_trans, bm, bn, bk), c_desc,
               *unread, m, n, k, rows_per_chunk, first_row, epoch, limit, B_TRANS=b_trans, **meta)
    return out


def matmul_into(a, b, bias, out, tile: Optional[GemmTile] = None, scaled=None,
                first_row: int = 0, decode: bool = False):
    """out = a @ b (+ bias): cuBLAS, or the Triton tile program where a tile is given; `scaled`
    (float8: a scaled.Scaled; a sum of products: a MatmulSum; a being A's rows from first_row
    on) computes it instead; decode (gemm="gemv"): the decode GEMM template where it applies."""
    if scaled is not None:
        return scaled.matmul_into(a, b, bias, out, first_row)
    if tile is not None:
        return triton_gemm(a, b, bias, out, tile)
    if decode and bias is None and gemv_applies(a, b) is None:
        return decode_mm(a, b, out=out)
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


@dataclasses.dataclass(frozen=True)
class MatmulSum:
    """The GEMM of a sum of matmul products over the same rows (the input gradient of layers that
    share their input): after the first term's product into `out`, each further term's rows,
    sliced alike, are accumulated into it by cuBLAS (beta = 1). Concatenating the operands along
    K instead would cost a kernel of Inductor's per left operand, more than a GEMM per term."""

    others: tuple  # (a, b) of each further term
    out_dtype: torch.dtype

    @classmethod
    def of(cls, a: list, b: list) -> tuple[Optional["MatmulSum"], Optional[str]]:
        """(None, None) for one term, (MatmulSum, None) for more, or (None, why) where the fused
        plans cannot take the terms."""
        if len(a) != len(b):
            return None, "terms: as many left operands as right ones"
        first, n = a[0], b[0].shape[-1]
        for a_i, b_i in zip(a, b):
            if (a_i.dtype not in DTYPES or a_i.dtype != first.dtype or b_i.dtype != first.dtype
                    or a_i.dim() != 2 or b_i.dim() != 2 or a_i.shape[0] != first.shape[0]
                    or a_i.shape[1] != b_i.shape[0] or b_i.shape[1] != n):
                return None, "dtype, rank or shape of the operands (of a term)"
        if len(a) == 1:
            return None, None
        return cls(tuple(zip(a[1:], b[1:])), first.dtype), None

    def matmul_into(self, a_rows, b, bias, out, first_row: int = 0) -> None:
        matmul_into(a_rows, b, bias, out)
        rows = slice(first_row, first_row + a_rows.shape[0])
        for a_i, b_i in self.others:
            out.addmm_(a_i[rows], b_i)


def tile_launch(tile: GemmTile) -> dict:
    """The persistent GEMM's (templates/gemm_ready.py) compile-time tile arguments."""
    return dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                num_warps=tile.warps, num_stages=tile.stages)


def ready_gemm(ctx, dev, a, b, bias, partial, b_trans, group_m, progs, tile):
    """The persistent GEMM (templates/gemm_ready.py) on `progs` programs of the main stream; it
    raises READY[j] itself when chunk j (group_m row-blocks) is stored. b_trans: tma_ok's
    answer; tile: tile_launch's."""
    m, n = partial.shape
    progs = max(1, min(progs, cdiv(m, tile["BLOCK_M"]) * cdiv(n, tile["BLOCK_N"])))
    launch(gemm_ready_kernel, (progs,),
           *_descriptors(a, b, b_trans, tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]),
           partial, partial if bias is None else bias, ctx.flags.words, dev.arrive[1:],
           dev.epoch, m, n, a.shape[1], HAS_BIAS=bias is not None, B_TRANS=b_trans,
           GROUP_M=group_m, NUM_PROGS=progs, **tile)


def gemm_beside(ctx, dev, queue_gemm, side_kernel):
    """queue_gemm() on the main stream, side_kernel(side) beside it on the side stream (a
    CUstream handle), then the main stream joins the side stream (ctx.ev_end)."""
    main, side = current_stream(), dev.side.cuda_stream
    driver.record(ctx.ev_start, main)  # the inputs (residual, weight) and the last call are done
    driver.stream_wait(side, ctx.ev_start)
    queue_gemm()
    # queued after the GEMM: a host call that synchronises the device while the chunks are
    # queued (cuBLAS, or the caching allocator reaching cudaMalloc) would otherwise wait for
    # this spinning kernel, which waits for chunks not yet queued, and never return
    side_kernel(side)
    driver.record(ctx.ev_end, side)
    driver.stream_wait(main, ctx.ev_end)
