"""Expert parallelism: the experts' grouped GEMM, reading its rows through the dispatch's index
and writing them back through the combine's (on several ranks: into the peers' buffers; the
routes and the push between ranks are templates/moe_routes.py).

The grouped GEMM (`grouped_gemm_kernel`). Expert e owns GEMM rows [offsets[e-1], offsets[e])
(offsets: int32 cumulative row counts, as torch._grouped_mm takes them; offsets[-1] = 0) and
multiplies them by B[e] [K, N] (any strides: a transposed nn.Linear weight is a view). The tiles
are (expert, m-tile, n-tile): expert e has ceil(rows_e / BLOCK_M) m-tiles (none for an expert
without rows; its last one partial), numbered expert after expert (`expert_of_tile`, computed in
every program from the offsets with one vector load and a cumsum, so no host sync and no
per-call tile table). The grid is persistent over an upper bound of the m-tiles, ceil(M /
BLOCK_M) + E (each expert adds at most one partial tile; the rows past the last offset, if
any, one more), times the n-tiles; tiles past the call's own count do nothing. Within an
expert the tiles go GROUP_M m-tiles at a time over the n-tiles (the usual grouped order), so
programs that run together share rows and the expert's weight in L2.

  prologue  GATHER: GEMM row i is row a_index[i] of A (the dispatch at world size 1: the
            all-to-all is the identity over ranks, so the dispatch is a gather of x's rows by
            expert); else row i of A. WRITE_ROWS: the n-tile-0 programs copy their rows into
            rows_out (the op's first output, the rows the experts read) after their K loop.
  WAIT      (world size > 1) tile (e, t) first waits until its arrival counter, which the
            peers' dispatch (moe_routes.put_rows_kernel) raises, reaches expect[tile]: its rows have
            all landed in this rank's receive buffer (A).
  epilogue  SCALE: row i times scale[i] (the routing weight), in fp32. SCATTER: row i goes to
            row c_index[i] of C (the combine: y's rows back to the sender's order); ACCUMULATE:
            added there with an atomic add (C fp32: several GEMM rows (a token's top-k experts)
            land on one row); else stored. PUSH (the combine on several ranks): row i goes to
            row c_index[i] of rank dst_rank[i]'s receive buffer (`push_rows`), then one is
            added per row to the destination's arrival counter for this sender; the rows past the
            last offset are pushed as zeros (torch._grouped_mm leaves them undefined), so that
            every row the receivers count on comes.

The dispatch's push (templates/moe_routes.py `put_rows_kernel`, world size > 1) puts each row
of x at its expert-major row of its receiver's buffer and adds one to that tile's arrival
counter there. Counters only grow: a call expects each tile's counter at its previous value
plus the rows of the tile this call (expect[], the receiver's), so nothing is reset between
calls.

A is read through pointers (GATHER: the gathered rows are not one block of a tensor) or (A_DESC,
rows in order) a Hopper TMA descriptor over A [rows, K] (a tile's block of BLOCK_M rows from its
first; the rows past the expert's, the next expert's or the zeros past the end, are multiplied
and not stored; after a WAIT, PROXY_FENCE orders the peers' stores before the TMA reads). B
through pointers or (B_DESC) a Hopper TMA descriptor over the weights' 2-d view, [E * K, N] (K
a multiple of BLOCK_K: a K block never reaches into the next expert) or [E * N, K]
(nn.Linear's layout; the columns past N that reach into the next expert are not stored).
(Ceil-divisions and zero fills are written out, as in ag_gemm.py, for the interpreter.)
"""

import triton
import triton.language as tl

from .flags import load_acquire, polling, record_give_up, wait_start, waited

# B_DESC: the weight through a TMA descriptor over its 2-d view, [E * K, N] or (a transposed
# nn.Linear weight) [E * N, K]; 0: through pointers
B_ROWS_K, B_ROWS_N = tl.constexpr(1), tl.constexpr(2)
# error code (err word) of a tile whose rows never arrived (and the same for the kernels)
ERR_ROWS = 8
K_ERR_ROWS = tl.constexpr(ERR_ROWS)


@triton.jit
def expert_of_tile(offsets_ptr, m_tile, M, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """(expert, its first row, its row count, the tile's index within the expert) of the
    m_tile-th m-tile, counting each expert's ceil(rows / BLOCK_M) tiles in turn. Past the last
    expert's tiles: expert E, whose "rows" are the GEMM rows past offsets[E - 1] (none in an MoE
    layer; torch._grouped_mm leaves their products undefined, the rows output still holds them)."""
    e = tl.arange(0, E_P2)
    valid = e < E
    ends = tl.load(offsets_ptr + e, mask=valid, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=valid & (e > 0), other=0)
    rows = tl.where(valid, ends - starts, 0)
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)  # tiles of experts 0..e
    expert = tl.sum(tl.where(valid & (tiles_end <= m_tile), 1, 0), 0)
    first_tile = tl.sum(tl.where(e < expert, tiles, 0), 0)
    last_end = tl.max(tl.where(valid, ends, 0), 0)
    start = tl.where(expert < E, tl.sum(tl.where(e == expert, starts, 0), 0), last_end)
    count = tl.where(expert < E, tl.sum(tl.where(e == expert, rows, 0), 0), M - last_end)
    return expert, start, count, m_tile - first_tile


@triton.jit
def copy_rows(a_ptr, src, rows_out_ptr, rows, row_ok, K, stride_am, stride_ak,
              BLOCK_K: tl.constexpr):
    """rows_out[rows] = A[src] (WRITE_ROWS), in a loop of its own: stored from inside the GEMM's
    pipelined K loop, the A tiles corrupted the product on H100 (Triton 3.6, 128x128 tiles, 3
    stages: relative error 0.1-0.3; right with 1 stage), so the rows are read a second time
    (from L2, just read by the loop)."""
    for kk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        cols = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        m = row_ok[:, None] & (cols[None, :] < K)
        v = tl.load(a_ptr + src[:, None] * stride_am + cols[None, :] * stride_ak, mask=m)
        tl.store(rows_out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], v, mask=m)


@triton.jit
def push_rows(acc, rows, row_ok, offs_n, N, dst_rank_ptr, dst_row_ptr, recv_table, count_table,
              dtype: tl.constexpr):
    """GEMM rows `rows` of the product (acc, at columns offs_n) to row dst_row[i] of rank
    dst_rank[i]'s receive buffer ([capacity, N] rows; recv_table: each rank's base address),
    then one added per row to its rank's arrival counter (count_table: each rank's counter
    address; release, system scope). One atomic per row, as the dispatch's push counts: with
    one scalar add per destination rank of the tile's row count (and one count for all
    senders), rank 0's count stayed at 600 of 1200 on 2x H100 and 2x H200 (Triton 3.6); with
    both changed, the GPU test passes (which of the two mattered was not isolated)."""
    rank = tl.load(dst_rank_ptr + rows, mask=row_ok, other=0)
    dst_row = tl.load(dst_row_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    base = tl.load(recv_table + rank, mask=row_ok, other=0).to(tl.pointer_type(dtype))
    tl.store(base[:, None] + dst_row[:, None] * N + offs_n[None, :], acc.to(dtype),
             mask=row_ok[:, None] & (offs_n[None, :] < N))
    tl.debug_barrier()  # every thread's rows, then the counts that release them
    counter = tl.load(count_table + rank, mask=row_ok, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_add(counter, tl.where(row_ok, 1, 0), mask=row_ok, sem="release", scope="sys")


@triton.jit(do_not_specialize=["M", "limit"])
def grouped_gemm_kernel(
    a_ptr, a_desc, a_index_ptr, b_ptr, offsets_ptr, c_ptr, c_index_ptr, scale_ptr, rows_out_ptr,
    count_ptr, expect_ptr, err_ptr, dst_rank_ptr, recv_table, count_table,
    M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    limit,
    GATHER: tl.constexpr, WRITE_ROWS: tl.constexpr, SCATTER: tl.constexpr,
    SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, WAIT: tl.constexpr, PUSH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E_P2: tl.constexpr, NUM_PROGS: tl.constexpr, GROUP_M: tl.constexpr = 8,
    B_DESC: tl.constexpr = 0, A_DESC: tl.constexpr = False, PROXY_FENCE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    max_m_tiles = (M + BLOCK_M - 1) // BLOCK_M + E  # + the rows past the last expert's
    for tile in range(pid, max_m_tiles * num_pid_n, NUM_PROGS):
        expert, start, count, t = expert_of_tile(offsets_ptr, tile // num_pid_n, M, E, BLOCK_M,
                                                 E_P2)
        # the expert's tiles are [first * num_pid_n, (first + its m-tiles) * num_pid_n): within
        # them, GROUP_M m-tiles at a time over every n-tile (the expert's weight read once per
        # GROUP_M m-tiles from L2, not once per m-tile)
        first = tile // num_pid_n - t
        nth = tile - first * num_pid_n
        in_group = GROUP_M * num_pid_n
        group_first = nth // in_group * GROUP_M
        group_size = tl.minimum((count + BLOCK_M - 1) // BLOCK_M - group_first, GROUP_M)
        group_size = tl.maximum(group_size, 1)  # past the last expert: no tile, any size
        t = group_first + (nth % in_group) % group_size
        pid_n = (nth % in_group) // group_size
        m_tile = first + t  # its index among all the call's m-tiles (its arrival counter)
        ready = expert < E
        if WAIT:  # every row of this tile has landed (the peers' pushes counted them)
            if ready:
                want = tl.load(expect_ptr + m_tile)
                v = load_acquire(count_ptr + m_tile)
                since = wait_start(limit)
                n = since * 0
                while polling(v < want, n, limit, 0):
                    v = load_acquire(count_ptr + m_tile)
                    n = waited(n, since, limit)
                record_give_up(v < want, 0, err_ptr, K_ERR_ROWS)
                ready = v >= want  # a bounded wait that gave up: the tile is left unwritten
                if PROXY_FENCE:  # the peers' ordinary stores, then A_DESC's async-proxy reads
                    tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;",
                                              "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1)
        if ready:
            local = t * BLOCK_M + tl.arange(0, BLOCK_M)  # rows within the expert
            row_ok = local < count
            rows = start + local  # GEMM rows
            if GATHER:
                src = tl.load(a_index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            else:
                src = rows.to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            if not A_DESC:
                a_ptrs = a_ptr + src[:, None] * stride_am + offs_k[None, :] * stride_ak
            if B_DESC == 0:
                b_ptrs = (b_ptr + expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk
                          + offs_n[None, :] * stride_bn)
            acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
            for kk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
                k_left = K - kk * BLOCK_K
                if A_DESC:  # rows past the tile's (the next expert's, or zeros) are not stored
                    a = a_desc.load([start + t * BLOCK_M, kk * BLOCK_K])
                else:
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left),
                                other=0.0)
                if B_DESC == B_ROWS_K:  # B [E * K, N]: rows expert * K + k (K % BLOCK_K == 0)
                    b = b_ptr.load([expert * K + kk * BLOCK_K, pid_n * BLOCK_N])
                elif B_DESC == B_ROWS_N:  # B^T [E * N, K]: rows expert * N + n
                    b = b_ptr.load([expert * N + pid_n * BLOCK_N, kk * BLOCK_K]).T
                else:
                    b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N),
                                other=0.0)
                acc = tl.dot(a, b, acc)
                if not A_DESC:
                    a_ptrs += BLOCK_K * stride_ak
                if B_DESC == 0:
                    b_ptrs += BLOCK_K * stride_bk
            if WRITE_ROWS:
                if pid_n == 0:
                    copy_rows(a_ptr, src, rows_out_ptr, rows, row_ok, K, stride_am, stride_ak,
                              BLOCK_K)
            if SCALE:
                s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
                acc = acc * s[:, None].to(tl.float32)
            if PUSH:
                push_rows(acc, rows, row_ok, offs_n, N, dst_rank_ptr, c_index_ptr, recv_table,
                          count_table, a_ptr.dtype.element_ty)
            else:
                if SCATTER:
                    dst = tl.load(c_index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
                else:
                    dst = rows.to(tl.int64)
                c_ptrs = c_ptr + dst[:, None] * stride_cm + offs_n[None, :] * stride_cn
                c_mask = row_ok[:, None] & (offs_n[None, :] < N)
                if ACCUMULATE:
                    tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")
                else:
                    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
        elif (WRITE_ROWS | PUSH) & (expert == E):  # past the last expert: no product
            rows = start + t * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            if WRITE_ROWS:  # the rows output
                if pid_n == 0:
                    if GATHER:
                        src = tl.load(a_index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
                    else:
                        src = rows.to(tl.int64)
                    copy_rows(a_ptr, src, rows_out_ptr, rows, row_ok, K, stride_am, stride_ak,
                              BLOCK_K)
            if PUSH:
                if pid_n < num_pid_n:  # the swizzle maps tiles past the call's onto n-tiles past N
                    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                    push_rows(tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32), rows, row_ok, offs_n,
                              N, dst_rank_ptr, c_index_ptr, recv_table, count_table,
                              a_ptr.dtype.element_ty)
