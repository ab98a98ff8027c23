"""GEMM + all-reduce (+ residual + RMSNorm): what every all-reduce kernel shares (the kernels:
all_reduce_push.py, all_reduce_lamport.py): the flag layout, the error codes, the waits, the
compile-time world size, the norm of one row, the end of a call and lamport's empty mark.

Every rank's partial product P_q = a_q @ b_q (+ bias) [M, N] lies in rank q's symmetric data
buffer (written there by cuBLAS), reached through the peer-pointer table `data_table`. The result
on every rank is h = sum_q P_q (+ residual) and, with NORM, y = RMSNorm(h) * weight. Roundings
follow the reference op: the all-reduced sum is rounded to the dtype, then the residual is added
and rounded again (h), and y follows `ops.rms_norm_reference` (weight_in_fp32 or not).

The world size is a compile-time constant (WORLD, and WORLD_P2 its next power of two): the loops
over the ranks are unrolled, and a wait for all ranks polls their W flags with one vector of
loads.

Flags: int32 words in each rank's own symmetric flag buffer (layout: the constants below), raised
with release and polled with acquire at system scope; they hold epochs and only grow, so they are
never reset. Epochs live on the device, so a captured CUDA graph replays with no host value baked
in: epoch_ptr[0] = epoch of the last finished call, epoch_ptr[1] = that + 1 (the current call's);
every program reads e = epoch_ptr[1] at its start and the last program through advances it.
Waits are bounded when limit > 0 (debug): a wait that gives up writes its code into err_ptr.

(Session 2's one-shot and two-shot kernels lived here; slower than the push kernels at every
size measured, benchmarks/results/ar_h200x8_run6.md and run8.md, they were removed in session 4.)
"""

import triton
import triton.language as tl

# flag word layout (per rank)
# READY + j: chunk j of the GEMM is written (push beside the GEMM's row chunks, CHUNKED)
READY, MAX_CHUNKS = 0, 64
# STARTED + p * WORLD + q = program p of rank q has started (rank q's partial is complete, or
# sent); PUSHED + p * WORLD + q = program p of rank q pushed its sums to me; LOCAL + p = my
# program p has written its rows of h (a barrier over my programs, before the norm)
MAX_PROGS, MAX_WORLD = 128, 16
STARTED = READY + MAX_CHUNKS
PUSHED = STARTED + MAX_PROGS * MAX_WORLD
LOCAL = PUSHED + MAX_PROGS * MAX_WORLD
FLAG_WORDS = LOCAL + MAX_PROGS
# error codes (err word): which wait gave up (2 and 3 were the removed kernels' REDUCED and DONE)
ERR_READY, ERR_PUSHED, ERR_LOCAL, ERR_STARTED, ERR_SENT = 1, 4, 5, 6, 7
# the same numbers for the kernels (Triton reads only constexpr globals)
K_READY, K_STARTED, K_PUSHED = tl.constexpr(READY), tl.constexpr(STARTED), tl.constexpr(PUSHED)
K_LOCAL, K_MAX_PROGS = tl.constexpr(LOCAL), tl.constexpr(MAX_PROGS)
K_ERR_READY, K_ERR_PUSHED = tl.constexpr(ERR_READY), tl.constexpr(ERR_PUSHED)
K_ERR_LOCAL, K_ERR_STARTED = tl.constexpr(ERR_LOCAL), tl.constexpr(ERR_STARTED)
K_ERR_SENT = tl.constexpr(ERR_SENT)


# lamport's empty mark (all_reduce_lamport.py): -0.0, the int16 view of bfloat16 / float16 -0.0
EMPTY_BITS = -32768
K_EMPTY_BITS = tl.constexpr(EMPTY_BITS)  # the same for the kernels (constexpr globals only)


@triton.jit
def is_empty(x):
    return x.to(tl.int16, bitcast=True) == K_EMPTY_BITS


@triton.jit
def sendable(x):
    """x with -0.0 (the empty mark) sent as +0.0."""
    return tl.where(is_empty(x), tl.zeros_like(x), x)


def world_constants(world: int) -> dict:
    """The kernels' compile-time world size: WORLD, and WORLD_P2 its next power of two."""
    return dict(WORLD=world, WORLD_P2=triton.next_power_of_2(world))


@triton.jit
def gave_up_before(limit, err_ptr):
    """1 if waits are bounded (limit > 0, debug) and a wait of this call already gave up: later
    waits then do not wait nor record their own code, so a lost peer costs one timeout (not one
    per chunk and program) and the error names the first flag that never came."""
    gave_up = 0
    if limit > 0:
        gave_up = tl.where(tl.atomic_add(err_ptr, 0, sem="relaxed", scope="gpu") != 0, 1, 0)
    return gave_up


@triton.jit
def wait_all(ptrs, mask, epoch, limit, err_ptr, code):
    """Wait until every flag *ptrs[i] (where mask) >= epoch, polling them together: one vector of
    acquire loads per poll (one NVLink round trip for remote flags, not one per flag)."""
    v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), epoch)
    n = 0
    skip = gave_up_before(limit, err_ptr)
    while (tl.min(v, 0) < epoch) & ((limit == 0) | (n < limit)) & (skip == 0):
        v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), epoch)
        n += 1
    if (tl.min(v, 0) < epoch) & (skip == 0):
        tl.atomic_max(err_ptr, code)


@triton.jit
def wait_peers(flag_table, idx, epoch, limit, err_ptr, code, WORLD: tl.constexpr,
               WORLD_P2: tl.constexpr):
    """Wait until flag word idx of every rank (mine included) >= epoch."""
    q = tl.arange(0, WORLD_P2)
    mine = q < WORLD
    ptrs = tl.load(flag_table + q, mask=mine, other=0).to(tl.pointer_type(tl.int32)) + idx
    wait_all(ptrs, mine, epoch, limit, err_ptr, code)


@triton.jit
def wait_chunks_through(flag_table, ready, last, N, rows_per_chunk, epoch, limit, err_ptr,
                        WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """Beside a GEMM that raises READY per chunk of rows_per_chunk rows: wait for READY on every
    rank of each chunk up to the one holding element `last` (row last // N) not yet seen (chunks
    [0, ready) were; the persistent GEMM finishes chunks only about in order). Returns the new
    `ready`."""
    need = (last // N) // rows_per_chunk
    for c in range(ready, need + 1):  # none when chunk `need` was seen
        wait_peers(flag_table, K_READY + c, epoch, limit, err_ptr, K_ERR_READY, WORLD, WORLD_P2)
    return tl.maximum(ready, need + 1)


@triton.jit
def finish_call(arrive_ptr, epoch_ptr, epoch):
    """The last program through resets the arrival counter and advances the epoch."""
    arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(arrive_ptr, 0, sem="relaxed", scope="gpu")
        tl.store(epoch_ptr, epoch)
        tl.store(epoch_ptr + 1, epoch + 1)


@triton.jit
def norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """y = RMSNorm(h) * weight for one row of h whose sum of squares is sum_sq. h was written by
    other programs: its loads skip this SM's L1 (.cg)."""
    dtype = y_ptr.dtype.element_ty
    base = row * N  # int32: the runtime keeps its buffers below 2**31 elements
    rstd = tl.rsqrt(sum_sq / N + eps)
    tl.debug_barrier()  # h of this row may have been stored by this program's threads
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        h = tl.load(h_ptr + base + cols, mask=mask, other=0.0, cache_modifier=".cg")
        h = h.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if W_FP32:
            y = (h * rstd * w).to(dtype)
        else:
            y = ((h * rstd).to(dtype).to(tl.float32) * w).to(dtype)
        tl.store(y_ptr + base + cols, y, mask=mask)
