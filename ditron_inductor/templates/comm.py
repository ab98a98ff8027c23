"""Communication primitives on stock Triton.

Flags are int32 words holding an *epoch*: the host numbers the calls of one op context 1, 2, 3, ...
and a producer writes the call's epoch into a flag; a consumer waits until the flag is >= the
epoch it expects. Flags only grow, so nothing is reset between calls.

`wait_flag` spins with an acquire load at system scope (the writer may be another GPU or the copy
engine) and, when `limit` > 0 (debug mode, DITRON_WAIT_TIMEOUT_S), gives up after `limit` polls and
writes `code` into an error word that the host reads, instead of hanging.
`notify_peers_kernel` writes a value with release semantics into a flag of each peer, reached
through a table of peer base addresses (one int64 per rank).
"""

import triton
import triton.language as tl


@triton.jit
def load_acquire(ptr):
    # An atomic that adds 0 is an acquire load at system scope on every Triton version.
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def wait_flag(ptr, epoch, limit, err_ptr, code):
    """Spin until *ptr >= epoch. With limit > 0, stop after `limit` polls and record `code`."""
    v = load_acquire(ptr)
    n = 0
    while (v < epoch) & ((limit == 0) | (n < limit)):
        v = load_acquire(ptr)
        n += 1
    if v < epoch:
        tl.atomic_max(err_ptr, code)


@triton.jit
def peer_ptr(table_ptr, peer, dtype: tl.constexpr, ALIGNED: tl.constexpr = False):
    """The base address of `peer`'s buffer as a typed pointer (the table holds int64 addresses).
    ALIGNED: say that it is 16-byte aligned (symmetric buffers are), so that the compiler may
    emit 16-byte loads and stores through it."""
    ptr = tl.load(table_ptr + peer).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


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
