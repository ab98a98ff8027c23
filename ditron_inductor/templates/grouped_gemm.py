"""Expert parallelism's grouped GEMM (`grouped_gemm_kernel`): reads its rows through the
dispatch's index and writes them through the combine's.

Expert e multiplies GEMM rows [offsets[e-1], offsets[e]) (int32 cumulative counts, as
torch._grouped_mm takes them) by B[e] [K, N] (any strides). Every program numbers the m-tiles
expert after expert from the offsets (`expert_of_tile`: no host sync, no tile table) over a
persistent grid of ceil(M / BLOCK_M) + E m-tiles (a partial tile per expert, the rows past the
last offset) times the n-tiles; GROUP_M m-tiles of an expert go over the n-tiles together,
sharing rows and weight in L2.

  prologue  GATHER (the dispatch at world size 1): GEMM row i is A[a_index[i]], else A[i].
            WRITE_ROWS: the n-tile-0 programs copy their rows into rows_out.
  WAIT      a tile first waits until its arrival counter, raised by the peers' put_rows_kernel,
            reaches expect[tile].
  epilogue  SCALE: row i times scale[i] (the routing weight), fp32. SCATTER (the combine): row
            i to row c_index[i] of C; ACCUMULATE: an atomic add there (C fp32: a token's top-k
            rows land on one row).

A_DESC reads A through a TMA descriptor (rows in order: a tile's BLOCK_M rows from its first,
those past the expert's multiplied and not stored), PROXY_FENCE ordering the peers' stores
before it after a WAIT; B_DESC: runtime/moe.py weight_descriptor. Ceil-divisions and zero
fills are written out for the interpreter.
"""

import triton
import triton.language as tl

from .flags import (load_acquire, polling, proxy_fence, record_give_up, wait_all, wait_start,
                    waited)

# B_DESC: the weight's 2-d view under TMA, [E * K, N] or [E * N, K]; 0: pointers
B_ROWS_K, B_ROWS_N = tl.constexpr(1), tl.constexpr(2)
# the err word's code for a tile whose rows never arrived: past every flag word's code (the
# word + 1), which a wait on READY + q reports
ERR_ROWS = 1 << 16
K_ERR_ROWS = tl.constexpr(ERR_ROWS)


@triton.jit
def expert_of_tile(offsets_ptr, m_tile, M, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """(expert, its first row, its row count, the tile's index within it) of the m_tile-th
    m-tile; past the last expert's tiles, expert E over the rows past offsets[E - 1] (products
    undefined, as torch._grouped_mm's; the rows output holds them)."""
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
def wait_tiles(count_ptr, expect_ptr, tiles, limit, err_ptr, BLOCK: tl.constexpr,
               PROXY_FENCE: tl.constexpr):
    """Until count[t] >= expect[t] for every tile t < tiles, BLOCK tiles polled together
    (flags.wait_all; the dispatch whose GEMMs run in a library call once every row landed); a
    tile that gave up is reported with the GEMM's own code. PROXY_FENCE: the peers' ordinary
    stores, then the library's TMA reads."""
    for first in range(0, tiles, BLOCK):
        t = first + tl.arange(0, BLOCK)
        on = t < tiles
        wait_all(count_ptr + t, on, tl.load(expect_ptr + t, mask=on, other=0), limit, err_ptr,
                 K_ERR_ROWS)
    if PROXY_FENCE:
        proxy_fence(tiles)


@triton.jit(do_not_specialize=["tiles", "limit"])
def wait_tiles_kernel(count_ptr, expect_ptr, tiles, limit, err_ptr, BLOCK: tl.constexpr,
                      PROXY_FENCE: tl.constexpr):
    """wait_tiles in one program (where no put kernel of this rank runs it: it sends no rows)."""
    wait_tiles(count_ptr, expect_ptr, tiles, limit, err_ptr, BLOCK, PROXY_FENCE)


@triton.jit
def copy_rows(a_ptr, src, rows_out_ptr, rows, row_ok, K, stride_am, stride_ak,
              BLOCK_K: tl.constexpr):
    """rows_out[rows] = A[src], in a loop of its own: stored from the pipelined K loop (more
    than one stage), the A tiles corrupt the product; the second read comes from L2."""
    for kk in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        cols = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        m = row_ok[:, None] & (cols[None, :] < K)
        v = tl.load(a_ptr + src[:, None] * stride_am + cols[None, :] * stride_ak, mask=m)
        tl.store(rows_out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], v, mask=m)


@triton.jit(do_not_specialize=["M", "limit"])
def grouped_gemm_kernel(
    a_ptr, a_desc, a_index_ptr, b_ptr, offsets_ptr, c_ptr, c_index_ptr, scale_ptr, rows_out_ptr,
    count_ptr, expect_ptr, err_ptr,
    M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    limit,
    GATHER: tl.constexpr, WRITE_ROWS: tl.constexpr, SCATTER: tl.constexpr,
    SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, WAIT: tl.constexpr,
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
        # the swizzle: GROUP_M of the expert's m-tiles at a time over every n-tile
        first = tile // num_pid_n - t
        nth = tile - first * num_pid_n
        in_group = GROUP_M * num_pid_n
        group_first = nth // in_group * GROUP_M
        group_size = tl.minimum((count + BLOCK_M - 1) // BLOCK_M - group_first, GROUP_M)
        group_size = tl.maximum(group_size, 1)  # past the last expert: no tile, any size
        t = group_first + (nth % in_group) % group_size
        pid_n = (nth % in_group) // group_size
        m_tile = first + t  # among the call's m-tiles: its arrival counter
        ready = expert < E
        if WAIT:  # until the peers' puts counted every row of this tile
            if ready:
                want = tl.load(expect_ptr + m_tile)
                v = load_acquire(count_ptr + m_tile)
                since = wait_start(limit)
                n = since * 0
                while polling(v < want, n, limit, 0):
                    v = load_acquire(count_ptr + m_tile)
                    n = waited(n, since, limit)
                record_give_up(v < want, 0, err_ptr, K_ERR_ROWS, v, want, -1)
                ready = v >= want  # a bounded wait that gave up: the tile is left unwritten
                if PROXY_FENCE:  # the peers' ordinary stores, then A_DESC's async-proxy reads
                    proxy_fence(v)
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
                if A_DESC:
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
        elif WRITE_ROWS & (expert == E) & (pid_n == 0):  # past the last expert: the rows alone
            rows = start + t * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            if GATHER:
                src = tl.load(a_index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            else:
                src = rows.to(tl.int64)
            copy_rows(a_ptr, src, rows_out_ptr, rows, row_ok, K, stride_am, stride_ak, BLOCK_K)
