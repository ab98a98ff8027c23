"""The flag protocol of the fused kernels, on stock Triton: peer pointers, flags, waits.

Flags are int32 words holding an *epoch*: the calls of one op context are numbered 1, 2, 3, ...
and a producer writes the call's epoch into a flag; a consumer waits until the flag is >= the
epoch it expects. Flags only grow, so nothing is reset between calls. Flags are raised with
release and polled with acquire at system scope (the writer may be another GPU or the copy
engine). The epoch is a host value (the all-gather and the copy-engine reduce-scatter, whose
streams also wait with the driver) or lives on the device (the all-reduce and the reduce-scatter
pull: epoch_ptr[0] = epoch of the last finished call, epoch_ptr[1] = that + 1, the current
call's; every program reads e = epoch_ptr[1] at its start and the last program through advances
it, `finish_call`), so that a captured CUDA graph replays with no host value baked in.

The waits: `wait_flag` (one flag), `wait_all` and `wait_peers` (several flags polled as one
vector), `wait_rows` and `wait_chunks_through` (the chunks that a range of rows touches), and
lamport's `take_when_full` (all_reduce_lamport.py: it polls the data itself for the empty mark).
Waits are bounded when limit > 0 (debug, the plan's wait timeout): a wait that gives up writes
its code into an error word that the host reads, instead of hanging (`polling` and
`record_give_up` state that rule for every wait). The bound is time on a GPU, nanoseconds of its
global timer (`wait_start`, `waited`), and polls under the interpreter, which has no inline
assembly (runtime/context.wait_limit converts the plan's seconds to either). The world size is
a compile-time constant (WORLD, and WORLD_P2 its next power of two): the loops over the ranks
are unrolled, and a wait for all ranks polls their W flags with one vector of loads.

Peer buffers are reached through a table of peer base addresses (one int64 per rank).
"""

import os

import torch
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
# error codes (err word): which wait gave up (2 and 3 are unused)
ERR_READY, ERR_PUSHED, ERR_LOCAL, ERR_STARTED, ERR_SENT = 1, 4, 5, 6, 7
# the same numbers for the kernels (Triton reads only constexpr globals)
K_READY, K_STARTED, K_PUSHED = tl.constexpr(READY), tl.constexpr(STARTED), tl.constexpr(PUSHED)
K_LOCAL, K_MAX_PROGS = tl.constexpr(LOCAL), tl.constexpr(MAX_PROGS)
K_ERR_READY, K_ERR_PUSHED = tl.constexpr(ERR_READY), tl.constexpr(ERR_PUSHED)
K_ERR_LOCAL, K_ERR_STARTED = tl.constexpr(ERR_LOCAL), tl.constexpr(ERR_STARTED)
K_ERR_SENT = tl.constexpr(ERR_SENT)


# Bounded waits count nanoseconds of the GPU's global timer: a bound in polls is no bound in time
# (a poll of a peer's flag takes about a microsecond, of a local word less; the 4-rank MoE
# dispatch test gave up at a nominal 20 s of polls on 4x H100 where 300 passed). Polls where
# there is no PTX: the interpreter, ROCm.
WAIT_IN_NS = (os.environ.get("TRITON_INTERPRET", "0") != "1"
              and getattr(torch.version, "hip", None) is None)
K_WAIT_IN_NS = tl.constexpr(WAIT_IN_NS)


def world_constants(world: int) -> dict:
    """The kernels' compile-time world size: WORLD, and WORLD_P2 its next power of two."""
    return dict(WORLD=world, WORLD_P2=triton.next_power_of_2(world))


@triton.jit
def load_acquire(ptr):
    # An atomic that adds 0 is an acquire load at system scope on every Triton version.
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def peer_ptr(table_ptr, peer, dtype: tl.constexpr, ALIGNED: tl.constexpr = False):
    """The base address of `peer`'s buffer as a typed pointer (the table holds int64 addresses).
    ALIGNED: say that it is 16-byte aligned (symmetric buffers are), so that the compiler may
    emit 16-byte loads and stores through it."""
    ptr = tl.load(table_ptr + peer).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def global_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def wait_start(limit):
    """Where a bounded wait's clock starts: the global timer (ns); 0 where waits count polls
    or are unbounded (limit 0: the clock is never read)."""
    start = tl.full([], 0, tl.int64)
    if K_WAIT_IN_NS:
        if limit > 0:
            start = global_ns()
    return start


@triton.jit
def waited(n, start, limit):
    """How long a wait has waited after one more poll, in the units of `limit`: ns since
    `start`, or polls; unbounded waits (limit 0) leave the clock alone."""
    if K_WAIT_IN_NS:
        if limit > 0:
            n = global_ns() - start
    else:
        n = n + 1
    return n


@triton.jit
def polling(pending, n, limit, skip):
    """Whether a wait polls again: something it waits for is pending and, when waits are bounded
    (limit > 0), it has waited less than `limit` (`waited`) and no earlier wait gave up (skip)."""
    return pending & ((limit == 0) | (n < limit)) & (skip == 0)


@triton.jit
def record_give_up(pending, skip, err_ptr, code):
    """After the poll loop: a wait that stopped with something pending records its code."""
    if pending & (skip == 0):
        tl.atomic_max(err_ptr, code)


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
def wait_flag(ptr, epoch, limit, err_ptr, code):
    """Spin until *ptr >= epoch. With limit > 0, stop after `limit` (`waited`) and record `code`.

    Unlike the vector waits it does not skip after another wait gave up (gave_up_before): each
    of its waiters names its own flag in `code` (the chunk, the rank), and the check would add
    a load of the error word to every wait of the all-gather's GEMM tiles and pull."""
    v = load_acquire(ptr)
    since = wait_start(limit)
    n = since * 0
    while polling(v < epoch, n, limit, 0):
        v = load_acquire(ptr)
        n = waited(n, since, limit)
    record_give_up(v < epoch, 0, err_ptr, code)


@triton.jit
def wait_all(ptrs, mask, epoch, limit, err_ptr, code):
    """Wait until every flag *ptrs[i] (where mask) >= epoch, polling them together: one vector of
    acquire loads per poll (one NVLink round trip for remote flags, not one per flag)."""
    v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), epoch)
    since = wait_start(limit)
    n = since * 0
    skip = gave_up_before(limit, err_ptr)
    while polling(tl.min(v, 0) < epoch, n, limit, skip):
        v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), epoch)
        n = waited(n, since, limit)
    record_give_up(tl.min(v, 0) < epoch, skip, err_ptr, code)


@triton.jit
def wait_peers(flag_table, idx, epoch, limit, err_ptr, code, WORLD: tl.constexpr,
               WORLD_P2: tl.constexpr):
    """Wait until flag word idx of every rank (mine included) >= epoch."""
    q = tl.arange(0, WORLD_P2)
    mine = q < WORLD
    ptrs = tl.load(flag_table + q, mask=mine, other=0).to(tl.pointer_type(tl.int32)) + idx
    wait_all(ptrs, mine, epoch, limit, err_ptr, code)


@triton.jit
def wait_rows(flag_ptr, seen, row0, row_end, rows_per_chunk, epoch, limit, err_ptr):
    """Beside chunks that land in any order (the all-gather's, chunk c's flag at flag_ptr + c):
    wait for every chunk that rows [row0, row_end) touch and that the bitmask `seen` does not
    hold. Returns the updated mask (chunks < 64)."""
    c0 = row0 // rows_per_chunk
    c1 = (row_end - 1) // rows_per_chunk
    for c in range(c0, c1 + 1):
        bit = tl.full([], 1, tl.int64) << c
        if (seen & bit) == 0:
            wait_flag(flag_ptr + c, epoch, limit, err_ptr, c + 1)
            seen = seen | bit
    return seen


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


@triton.jit(do_not_specialize=["offset", "value", "skip"])
def notify_peers_kernel(table_ptr, offset, value, skip, world):
    """For each rank p != skip of the group: flags_p[offset] = value (release, system scope).
    The table holds each rank's flag base address; skip = -1 notifies every rank."""
    for p in range(world):
        if p != skip:
            base = peer_ptr(table_ptr, p, tl.int32)
            tl.atomic_xchg(base + offset, value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["first", "count", "epoch", "limit"])
def wait_flags_kernel(flag_ptr, first, count, epoch, limit, err_ptr):
    """Wait until flag_ptr[first + i] >= epoch for i in [0, count) (a stream-side wait)."""
    for i in range(count):
        wait_flag(flag_ptr + first + i, epoch, limit, err_ptr, first + i + 1)


@triton.jit(do_not_specialize=["offset", "value"])
def write_flag_kernel(flag_ptr, offset, value):
    tl.atomic_xchg(flag_ptr + offset, value, sem="release", scope="sys")
