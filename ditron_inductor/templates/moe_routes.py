"""Expert parallelism's routes between ranks (the protocol: runtime/moe_routes.py): a receiver
publishes where its received rows go (`publish_routes_kernel`); a sender reads its rows'
destinations from the receivers' tables (`route_of_rows`) and puts the rows there
(`put_rows_kernel`).

Each rank's route table, int32 words in symmetric memory (`table_table`: every rank's address):
    [start[0..W) | send_end[0..W) | dst_row[0..capacity) | dst_tile[0..capacity)]
start[p]: where sender p's rows start among this rank's received rows (rank-major, as
all_to_all_single lands them); send_end[q]: the end of this rank's rows to rank q (cumulative
input split sizes), read by this rank alone; dst_row[j], dst_tile[j] (the dispatch only): the
expert-major row and GEMM tile (numbered as grouped_gemm.expert_of_tile) of received row j.
"""

import triton
import triton.language as tl

from .flags import signal_words, wait_words
from .grouped_gemm import wait_tiles

# what put_rows_kernel's last program waits for after its rows (WAIT): nothing, the tiles'
# arrival counters (the dispatch before a library GEMM), or the combine's ARRIVED words
NO_WAIT, WAIT_TILES, WAIT_WORDS = 0, 1, 2


@triton.jit
def tile_of_rows(j, offsets_ptr, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """The GEMM m-tile of expert-major rows j: its expert's first tile plus its tile within."""
    e = tl.arange(0, E_P2)
    valid = e < E
    ends = tl.load(offsets_ptr + e, mask=valid, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=valid & (e > 0), other=0)
    tiles = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    first = tl.cumsum(tiles, 0) - tiles
    expert = tl.sum(tl.where(valid[None, :] & (ends[None, :] <= j[:, None]), 1, 0), 1)
    mine = e[None, :] == expert[:, None]
    inside = expert < E  # else past the last offset: after every expert's tiles
    first_j = tl.where(inside, tl.sum(tl.where(mine, first[None, :], 0), 1), tl.sum(tiles, 0))
    start_j = tl.where(inside, tl.sum(tl.where(mine, starts[None, :], 0), 1),
                       tl.max(tl.where(valid, ends, 0), 0))
    return first_j + (j - start_j) // BLOCK_M


@triton.jit(do_not_specialize=["received", "capacity", "E", "signal_mask", "epoch", "wait_mask",
                               "limit"])
def publish_routes_kernel(table_ptr, row_index_ptr, offsets_ptr, expect_ptr, received, capacity,
                          E, done_ptr, signal_ptr, signal_mask, epoch, flag_ptr, wait_mask, limit,
                          err_ptr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                          E_P2: tl.constexpr, WORLD: tl.constexpr, HAS_INDEX: tl.constexpr,
                          SIGNAL: tl.constexpr = False, WORDS: tl.constexpr = 1):
    """The dispatch's receiver, expert-major rows j: j is received row row_index[j] (j without
    an index), so dst_row[row_index[j]] = j, dst_tile[row_index[j]] = j's tile, and
    expect[tile] grows by one per row (the counters only grow). SIGNAL: then the last program
    to finish (done_ptr counts them, and is set back) signals READY = epoch on the peers
    (flags.signal_words over signal_ptr's addresses) and waits until my flag words
    flag_ptr[q] >= epoch for each bit q of wait_mask (flags.wait_words): the routes, the
    signal and the wait in one launch."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < received
    tile = tile_of_rows(j, offsets_ptr, E, BLOCK_M, E_P2)
    if HAS_INDEX:
        at = tl.load(row_index_ptr + j, mask=ok, other=0).to(tl.int64)
    else:
        at = j.to(tl.int64)
    tl.store(table_ptr + 2 * WORLD + at, j, mask=ok)
    tl.store(table_ptr + 2 * WORLD + capacity + at, tile, mask=ok)
    tl.atomic_add(expect_ptr + tile, tl.where(ok, 1, 0), mask=ok, sem="relaxed", scope="gpu")
    if SIGNAL:
        tl.debug_barrier()  # every thread's routes, then the count that releases them
        if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="sys") == tl.num_programs(0) - 1:
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
            signal_words(signal_ptr, signal_mask, epoch, WORDS)
            wait_words(flag_ptr, 0, wait_mask, epoch, flag_ptr, limit, err_ptr, WORDS, False)


@triton.jit
def route_of_rows(r, in_range, table_table, rank, capacity, WORLD: tl.constexpr,
                  WORLD_P2: tl.constexpr, EXPERT_MAJOR: tl.constexpr):
    """(dst_rank, dst_row, dst_tile) of this sender's rows r (send order): the receiver q (by my
    send_end), the position p among q's received rows (q's start[rank] + r's index among my rows
    to q) and the row and tile q published for p (EXPERT_MAJOR, the dispatch), else p, tile 0.
    dst_rank -1: not sent (out of range, or p unclaimed). Only the receivers' tables are read."""
    w = tl.arange(0, WORLD_P2)
    my_table = tl.load(table_table + rank).to(tl.pointer_type(tl.int32))
    ends = tl.load(my_table + WORLD + w, mask=w < WORLD, other=0)
    q = tl.sum(tl.where((w[None, :] < WORLD) & (ends[None, :] <= r[:, None]), 1, 0), 1)
    ok = in_range & (q < WORLD)
    first = tl.sum(tl.where(w[None, :] == q[:, None] - 1, ends[None, :], 0), 1)
    table = tl.load(table_table + q, mask=ok, other=0).to(tl.pointer_type(tl.int32))
    at = tl.load(table + rank, mask=ok, other=0) + (r - first)
    if EXPERT_MAJOR:
        dst_row = tl.load(table + 2 * WORLD + at, mask=ok, other=-1)
        dst_tile = tl.load(table + 2 * WORLD + capacity + at, mask=ok, other=0)
        ok = ok & (dst_row >= 0)
    else:
        dst_row = at
        dst_tile = tl.zeros_like(at)
    return tl.where(ok, q, -1), dst_row, dst_tile


@triton.jit(do_not_specialize=["rows", "K", "rank", "capacity", "wait_first", "wait_count",
                               "limit"])
def put_rows_kernel(x_ptr, send_index_ptr, table_table, data_table, count_table, rows, K, rank,
                    capacity, wait_ptr, wait_first, wants_ptr, wait_count, limit, err_ptr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, EXPERT_MAJOR: tl.constexpr,
                    HAS_INDEX: tl.constexpr, WAIT: tl.constexpr = 0,
                    WAIT_BLOCK: tl.constexpr = 1, PROXY_FENCE: tl.constexpr = False):
    """Rows of x (K wide; row r is send row send_index[r], else r) each to its route in its
    receiver's buffer (data_table: each rank's base), then one per row onto the receiver's
    counter of its tile (count_table: each rank's counter base), released after every thread's
    rows. Then the last program waits, in place of a wait launch after this one (a spinning
    program holds one slot; the others need none of it): WAIT_TILES, my tile counters at
    wait_ptr until each reaches wants[t], t < wait_count (grouped_gemm.wait_tiles); WAIT_WORDS,
    my flag words wait_ptr[wait_first + i] until each reaches wants[i] for each bit i of
    wait_count, then taken back off (flags.wait_words)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_INDEX:
        sent_as = tl.load(send_index_ptr + r, mask=r < rows, other=0)
    else:
        sent_as = r
    rank_of, dst_row, tile = route_of_rows(sent_as, r < rows, table_table, rank, capacity,
                                           WORLD, WORLD_P2, EXPERT_MAJOR)
    ok = rank_of >= 0
    base = tl.load(data_table + rank_of, mask=ok, other=0).to(
        tl.pointer_type(x_ptr.dtype.element_ty))
    dst_row = dst_row.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    for kk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        cols = kk * BLOCK_K + offs_k
        m = ok[:, None] & (cols[None, :] < K)
        v = tl.load(x_ptr + r[:, None].to(tl.int64) * K + cols[None, :], mask=m)
        tl.store(base[:, None] + dst_row[:, None] * K + cols[None, :], v, mask=m)
    tl.debug_barrier()  # every thread's rows, then the counts that release them
    # a loop over receivers, so that each counter base is a scalar load
    for q in range(WORLD):
        counters = tl.load(count_table + q).to(tl.pointer_type(tl.int32))
        mine = ok & (rank_of == q)
        tl.atomic_add(counters + tile, tl.where(mine, 1, 0), mask=mine, sem="release",
                      scope="sys")
    if WAIT != 0:
        if tl.program_id(0) == tl.num_programs(0) - 1:
            if WAIT == 1:
                wait_tiles(wait_ptr, wants_ptr, wait_count, limit, err_ptr, WAIT_BLOCK,
                           PROXY_FENCE)
            else:
                wait_words(wait_ptr, wait_first, wait_count, 0, wants_ptr, limit, err_ptr,
                           WORLD_P2, True)
