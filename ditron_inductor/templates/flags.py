"""The flag protocol of the fused kernels, on stock Triton: peer pointers, flags, waits.

Flags are int32 words holding an *epoch* (an op context's calls are 1, 2, 3, ...): a producer
writes the call's epoch with release at system scope (the writer may be another GPU or the copy
engine), a consumer polls with acquire until the flag is >= the epoch it expects. Flags only
grow, so nothing is reset between calls. The all-reduce keeps its epoch on the device, so that a
captured CUDA graph bakes in no host value: epoch_ptr[1] is the current call's, read by every
program at its start and advanced by the last one (`finish_call`; epoch_ptr[0]: the last done).

Waits are bounded when limit > 0 (the default: runtime/context.wait_limit): the first wait of a
call site (runtime/faults.site_words; of the context, where the call names none) that gives up
claims its error word (ERR_CODE) and writes a report (code, epoch seen and expected, the late
peer, the words' id) into a host-mapped record whose address the error word holds
(ERR_REPORT), which the host reads without synchronising (runtime/faults.py); later waits of the
site see the claimed word and do not wait. The bound is ns of the global timer,
polls under the interpreter. WORLD (WORLD_P2 its next power of two) is a
compile-time constant: loops over the ranks unroll, and a wait for all ranks polls one vector.
"""

import os

import torch
import triton
import triton.language as tl

# flag words (per rank): READY + j: chunk j of the GEMM is written (the push beside it, CHUNKED);
# STARTED + p * WORLD + q: program p of rank q has started (rank q's partial is complete, or
# sent); PUSHED + p * WORLD + q: program p of rank q pushed its sums to me; LOCAL + p: my
# program p has written its rows of h (a barrier over my programs, before the norm)
READY, MAX_CHUNKS = 0, 64
MAX_PROGS, MAX_WORLD = 128, 16
STARTED = READY + MAX_CHUNKS
PUSHED = STARTED + MAX_PROGS * MAX_WORLD
LOCAL = PUSHED + MAX_PROGS * MAX_WORLD
FLAG_WORDS = LOCAL + MAX_PROGS
# error codes (err word): which wait gave up (2 and 3 are unused)
ERR_READY, ERR_PUSHED, ERR_LOCAL, ERR_STARTED, ERR_SENT = 1, 4, 5, 6, 7
# error words (int32; a context's or a call site's): the code of the first wait that gave up,
# the words' id, and (int64, words 2-3) the address of the host-mapped report; the report's words
ERR_CODE, ERR_ID, ERR_WORDS = 0, 1, 4
REPORT_CODE, REPORT_SEEN, REPORT_EXPECTED, REPORT_PEER, REPORT_ID, REPORT_WORDS = range(6)
# the same numbers for the kernels (Triton reads only constexpr globals)
K_READY, K_STARTED, K_PUSHED = tl.constexpr(READY), tl.constexpr(STARTED), tl.constexpr(PUSHED)
K_LOCAL, K_MAX_PROGS = tl.constexpr(LOCAL), tl.constexpr(MAX_PROGS)
K_ERR_READY, K_ERR_PUSHED = tl.constexpr(ERR_READY), tl.constexpr(ERR_PUSHED)
K_ERR_LOCAL, K_ERR_STARTED = tl.constexpr(ERR_LOCAL), tl.constexpr(ERR_STARTED)
K_ERR_SENT = tl.constexpr(ERR_SENT)


# a bound in polls is no bound in time (a peer's flag polls far slower than a local word, both
# varying with the machine): nanoseconds, except where there is no PTX (the interpreter, ROCm)
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
def peer_ptr(table_ptr, peer, dtype: tl.constexpr):
    """`peer`'s buffer base (the table's int64) as a typed pointer, declared 16-byte aligned
    (symmetric buffers are), so that the compiler may emit 16-byte loads and stores."""
    return tl.multiple_of(tl.load(table_ptr + peer).to(tl.pointer_type(dtype)), 16)


@triton.jit
def proxy_fence(dep):
    """Orders the generic-proxy stores seen so far before later async-proxy (TMA) reads; `dep`
    ties the asm to the value that was waited on, so that it is not moved above the wait."""
    tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [dep],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def global_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def wait_start(limit):
    """Where a bounded wait's clock starts: the global timer's ns, or 0 (polls, or unbounded)."""
    start = tl.full([], 0, tl.int64)
    if K_WAIT_IN_NS:
        if limit > 0:
            start = global_ns()
    return start


@triton.jit
def waited(n, start, limit):
    """How long a wait has waited after one more poll, in `limit`'s units (ns, or polls)."""
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
def give_up(err_ptr, code, seen, expected, peer):
    """The first wait of the context to give up claims its error word and writes the report (the
    code last: the host reads the report once the code is there); a later one leaves it."""
    if tl.atomic_cas(err_ptr, 0, code, sem="relaxed", scope="gpu") == 0:
        report = tl.load(err_ptr.to(tl.pointer_type(tl.int64)) + 1).to(tl.pointer_type(tl.int32))
        tl.store(report + 1, seen)
        tl.store(report + 2, expected)
        tl.store(report + 3, peer)
        tl.store(report + 4, tl.load(err_ptr + 1))
        tl.store(report, code)


@triton.jit
def record_give_up(pending, skip, err_ptr, code, seen, expected, peer):
    """After the poll loop: a wait that stopped with something pending reports (give_up)."""
    if pending & (skip == 0):
        give_up(err_ptr, code, seen, expected, peer)


@triton.jit
def gave_up_before(limit, err_ptr):
    """1 if waits are bounded (limit > 0) and a wait of this context already gave up: later
    waits then do not wait nor record their own code, so a lost peer costs one timeout (not one
    per chunk and program) and the error names the first flag that never came."""
    gave_up = 0
    if limit > 0:  # a plain load, which overlaps the wait's first poll (an atomic would not)
        gave_up = tl.where(tl.load(err_ptr, volatile=True) != 0, 1, 0)
    return gave_up


@triton.jit
def wait_flag(ptr, epoch, limit, err_ptr, code):
    """Spin until *ptr >= epoch; with limit > 0, stop after `limit` and record `code`. It does not
    skip after another wait gave up (gave_up_before): its waiters name their own flag in `code`,
    and the check would add a load of the error word to every wait of the all-gather's tiles."""
    v = load_acquire(ptr)
    since = wait_start(limit)
    n = since * 0
    while polling(v < epoch, n, limit, 0):
        v = load_acquire(ptr)
        n = waited(n, since, limit)
    record_give_up(v < epoch, 0, err_ptr, code, v, epoch, -1)


@triton.jit
def wait_all(ptrs, mask, epoch, limit, err_ptr, code):
    """Wait until every flag *ptrs[i] (where mask) >= epoch (one value, or one per flag),
    polling them together: one vector of acquire loads per poll (one NVLink round trip for
    remote flags, not one per flag)."""
    want = tl.where(mask, epoch, 0)
    v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), want)
    since = wait_start(limit)
    n = since * 0
    skip = gave_up_before(limit, err_ptr)
    while polling(tl.min(v - want, 0) < 0, n, limit, skip):
        v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), want)
        n = waited(n, since, limit)
    if (tl.min(v - want, 0) < 0) & (skip == 0):  # the report names the lane (peer) that is late
        lane = tl.argmin(v - want, 0)
        at = tl.arange(0, v.numel) == lane
        give_up(err_ptr, code, tl.sum(tl.where(at, v, 0), 0), tl.sum(tl.where(at, want, 0), 0),
                lane)


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
    """Beside a GEMM raising READY per chunk of rows_per_chunk rows: wait for every rank's READY
    of chunks `ready` (those before were seen) to that of element `last`; returns the new one."""
    need = (last // N) // rows_per_chunk
    q = tl.arange(0, WORLD_P2)
    for c in range(ready, need + 1):  # none when chunk `need` was seen; every rank's, mine too
        peers = tl.load(flag_table + q, mask=q < WORLD, other=0).to(tl.pointer_type(tl.int32))
        wait_all(peers + K_READY + c, q < WORLD, epoch, limit, err_ptr, K_ERR_READY)
    return tl.maximum(ready, need + 1)


@triton.jit
def finish_call(arrive_ptr, epoch_ptr, epoch):
    """The last program through resets the arrival counter and advances the epoch."""
    arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(arrive_ptr, 0, sem="relaxed", scope="gpu")
        tl.store(epoch_ptr, epoch)
        tl.store(epoch_ptr + 1, epoch + 1)


@triton.jit(do_not_specialize=["first", "count", "epoch", "limit"])
def wait_flags_kernel(flag_ptr, first, count, epoch, limit, err_ptr):
    """Wait until flag_ptr[first + i] >= epoch for i in [0, count) (a stream-side wait)."""
    for i in range(count):
        wait_flag(flag_ptr + first + i, epoch, limit, err_ptr, first + i + 1)


@triton.jit
def wait_words(flag_ptr, first, mask, want, wants_ptr, limit, err_ptr, WORDS: tl.constexpr,
               TAKE: tl.constexpr):
    """Until flag_ptr[first + i] >= want for each bit i < WORDS of mask, the words polled
    together; TAKE: >= wants_ptr[i] instead, then that much taken back off the word (a count
    set back for the next call). The first late word is reported as wait_flags_kernel reports
    it (code first + i + 1)."""
    i = tl.arange(0, WORDS)
    on = ((mask >> i) & 1) != 0
    ptrs = flag_ptr + first + i
    if TAKE:
        wants = tl.load(wants_ptr + i, mask=on, other=0)
    else:
        wants = tl.zeros([WORDS], tl.int32) + want
    v = tl.atomic_add(ptrs, 0, mask=on, sem="acquire", scope="sys")
    since = wait_start(limit)
    n = since * 0
    skip = gave_up_before(limit, err_ptr)
    while polling(tl.max(tl.where(on & (v < wants), 1, 0), 0) > 0, n, limit, skip):
        v = tl.atomic_add(ptrs, 0, mask=on, sem="acquire", scope="sys")
        n = waited(n, since, limit)
    late = on & (v < wants)
    lane = tl.argmax(tl.where(late, 1, 0), 0)
    record_give_up(tl.max(tl.where(late, 1, 0), 0) > 0, skip, err_ptr, first + lane + 1,
                   tl.sum(tl.where(i == lane, v, 0), 0), tl.sum(tl.where(i == lane, wants, 0), 0),
                   -1)
    if TAKE:
        tl.atomic_add(ptrs, -wants, mask=on, sem="relaxed", scope="sys")


@triton.jit(do_not_specialize=["first", "mask", "want", "limit", "signal_mask", "signal_value"])
def wait_words_kernel(flag_ptr, first, mask, want, wants_ptr, limit, err_ptr, signal_ptr,
                      signal_mask, signal_value, WORDS: tl.constexpr, TAKE: tl.constexpr,
                      SIGNAL: tl.constexpr):
    """wait_words in one launch (several stream-side waits). SIGNAL: first signal_words, one
    launch for a call's signals and its wait."""
    if SIGNAL:
        signal_words(signal_ptr, signal_mask, signal_value, WORDS)
    wait_words(flag_ptr, first, mask, want, wants_ptr, limit, err_ptr, WORDS, TAKE)


@triton.jit
def signal_words(signal_ptr, signal_mask, signal_value, WORDS: tl.constexpr):
    """The word at signal_ptr[i] (an address, a peer's flag word) = signal_value for each bit i
    < WORDS of signal_mask, released at system scope (after this program's earlier work, and
    what it acquired: the stream's earlier kernels, as a stream write would be)."""
    i = tl.arange(0, WORDS)
    sig = ((signal_mask >> i) & 1) != 0
    dst = tl.load(signal_ptr + i, mask=sig, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(dst, signal_value, mask=sig, sem="release", scope="sys")
