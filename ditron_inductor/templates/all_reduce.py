"""GEMM + all-reduce (+ residual + RMSNorm): the reduction kernels on symmetric memory.

Every rank's partial product P_q = a_q @ b_q (+ bias) [M, N] lies in rank q's symmetric data
buffer (written there by cuBLAS), reached through the peer-pointer table `data_table`. The result
on every rank is h = sum_q P_q (+ residual) and, with NORM, y = RMSNorm(h) * weight.

- `one_shot_kernel` (decode, M <= 256): one launch per rank after its GEMM. Program 0 raises my
  READY[0]; every program waits for every peer's READY[0], then each row (row = pid, pid + P, ...)
  is summed over the W partials in fp32 and normalised in the same program.
- `two_shot_kernel` (prefill): the rows are cut into `num_chunks` chunks; chunk j is owned by rank
  j % W. The GEMM runs chunk by chunk on the main stream, chunk 0 first on every rank (the order in
  which the owners reduce), and READY[j] is raised after each chunk. This kernel runs on a side
  stream on a few SMs at the same time: for each chunk in order, the owner waits for READY[j] of
  every rank, reduces the rows (+ residual), writes h to its own outputs and to the "reduced" half
  of its symmetric buffer and raises REDUCED[j]; the other ranks wait for the owner's REDUCED[j],
  copy h from there and compute y themselves (the norm costs no traffic; same code, same bits).

Sums run over the ranks in the fixed order 0..W-1 on every rank, so every rank gets the same bits.
Roundings follow the reference op: the all-reduced sum is rounded to the dtype, then the residual
is added and rounded again (h), and y follows `ops.rms_norm_reference` (weight_in_fp32 or not).

Flags (int32 words in each rank's own symmetric flag buffer; peers poll them through
`flag_table`, acquire at system scope): DONE, READY[j], REDUCED[j] (layout: the constants below).

Epochs live on the device, so a captured CUDA graph replays with no host value baked in:
  epoch_ptr[0] = epoch of the last finished call, epoch_ptr[1] = that + 1 (the current call's).
Every program reads e = epoch_ptr[1] at its start. The chunk READY flags of the two-shot are raised
by 4-byte copies from epoch_ptr + 1 (a graph memcpy node reads the word at replay time). The last
program to finish (arrival counter arrive_ptr[0], reset by that program) raises my DONE = e (I have
finished reading the peers' buffers), waits for every peer's DONE >= e (so the next call's GEMM may
overwrite my buffers: no peer still reads them), then advances epoch_ptr to (e, e + 1). The next
call is stream-ordered after this kernel, so it sees the new epoch. Flags only grow: never reset.

Waits are bounded when limit > 0 (debug): a wait that gives up writes its code into err_ptr.
"""

import triton
import triton.language as tl

from .comm import peer_ptr, wait_flag

# flag word layout (per rank)
DONE = 0
READY = 1  # READY + j, j < MAX_CHUNKS
MAX_CHUNKS = 64
REDUCED = READY + MAX_CHUNKS  # REDUCED + j
FLAG_WORDS = REDUCED + MAX_CHUNKS
# error codes (err word): which wait gave up
ERR_READY, ERR_REDUCED, ERR_DONE = 1, 2, 3

_DYNAMIC = ["M", "N", "eps", "rank", "rows_per_chunk", "num_chunks", "limit"]


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def wait_peers(flag_table, idx, epoch, world, limit, err_ptr, code):
    """Wait until flag word idx of every rank (mine included) >= epoch."""
    for q in range(world):
        wait_flag(peer_ptr(flag_table, q, tl.int32) + idx, epoch, limit, err_ptr, code)


@triton.jit
def h_row(data_table, src_rank, sym_out_off, h_ptr, res_ptr, row, N, world,
          GATHER: tl.constexpr, STORE_SYM: tl.constexpr, HAS_RES: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """Write row `row` of h and return its sum of squares (fp32).
    GATHER: copy it from rank src_rank's reduced half; else reduce the W partials (and with
    STORE_SYM also publish it in the reduced half of rank src_rank = mine)."""
    dtype = h_ptr.dtype.element_ty
    base = row * N  # int32: the runtime keeps 2 * M * N below 2**31
    ss = tl.full([BLOCK_N], 0.0, tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        if GATHER:
            h = tl.load(peer_ptr(data_table, src_rank, dtype) + sym_out_off + base + cols,
                        mask=mask, other=0.0)
        else:
            acc = tl.full([BLOCK_N], 0.0, tl.float32)
            for q in range(world):
                acc += tl.load(peer_ptr(data_table, q, dtype) + base + cols, mask=mask,
                               other=0.0).to(tl.float32)
            h = acc.to(dtype)  # the all-reduce's own rounding, as in the reference
            if HAS_RES:
                res = tl.load(res_ptr + base + cols, mask=mask, other=0.0)
                h = (h.to(tl.float32) + res.to(tl.float32)).to(dtype)
            if STORE_SYM:
                tl.store(peer_ptr(data_table, src_rank, dtype) + sym_out_off + base + cols, h,
                         mask=mask)
        tl.store(h_ptr + base + cols, h, mask=mask)
        hf = h.to(tl.float32)
        ss += hf * hf
    return tl.reduce(ss, 0, _add)


@triton.jit
def norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """y = RMSNorm(h) * weight for one row whose h this program has just written."""
    dtype = y_ptr.dtype.element_ty
    base = row * N  # int32: the runtime keeps 2 * M * N below 2**31
    rstd = tl.rsqrt(sum_sq / N + eps)
    tl.debug_barrier()  # h of this row was stored by this program's threads: read it back
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        h = tl.load(h_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if W_FP32:
            y = (h * rstd * w).to(dtype)
        else:
            y = ((h * rstd).to(dtype).to(tl.float32) * w).to(dtype)
        tl.store(y_ptr + base + cols, y, mask=mask)


@triton.jit
def finish_call(flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, epoch, world, limit):
    """The last program of this rank: DONE, wait for every peer's DONE, advance the epoch."""
    nprog = tl.num_programs(0)
    arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:
        tl.atomic_xchg(arrive_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flags_ptr + DONE, epoch, sem="release", scope="sys")
        wait_peers(flag_table, DONE, epoch, world, limit, err_ptr, ERR_DONE)
        tl.store(epoch_ptr, epoch)
        tl.store(epoch_ptr + 1, epoch + 1)


@triton.jit
def reduce_chunk(data_table, flag_table, flags_ptr, chunk_arrive_ptr, err_ptr, h_ptr, y_ptr,
                 res_ptr, w_ptr, j, lo, hi, reduced_off, N, eps, rank, world, epoch, limit,
                 HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The owner's part of chunk j (rows [lo, hi)): wait for every rank's partial rows, reduce
    them (+ residual, norm), publish h in my reduced half; the last program through raises
    REDUCED[j]."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if lo + pid < hi:
        wait_peers(flag_table, READY + j, epoch, world, limit, err_ptr, ERR_READY)
    for row in range(lo + pid, hi, nprog):
        sum_sq = h_row(data_table, rank, reduced_off, h_ptr, res_ptr, row, N, world,
                       GATHER=False, STORE_SYM=True, HAS_RES=HAS_RES, BLOCK_N=BLOCK_N)
        if NORM:
            norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32=W_FP32, BLOCK_N=BLOCK_N)
    arrived = tl.atomic_add(chunk_arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:
        tl.atomic_xchg(chunk_arrive_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flags_ptr + REDUCED + j, epoch, sem="release", scope="sys")


@triton.jit(do_not_specialize=_DYNAMIC)
def one_shot_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                    h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, world, limit,
                    HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(epoch_ptr + 1)
    if pid == 0:  # my partial is complete: the GEMM before this kernel on the stream wrote it
        tl.atomic_xchg(flags_ptr + READY, epoch, sem="release", scope="sys")
    wait_peers(flag_table, READY, epoch, world, limit, err_ptr, ERR_READY)
    for row in range(pid, M, nprog):
        sum_sq = h_row(data_table, rank, 0, h_ptr, res_ptr, row, N, world, GATHER=False,
                       STORE_SYM=False, HAS_RES=HAS_RES, BLOCK_N=BLOCK_N)
        if NORM:
            norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32=W_FP32, BLOCK_N=BLOCK_N)
    finish_call(flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, epoch, world, limit)


@triton.jit(do_not_specialize=_DYNAMIC)
def two_shot_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                    h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, world, rows_per_chunk,
                    num_chunks, limit,
                    HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                    BLOCK_N: tl.constexpr, REDUCE: tl.constexpr = True,
                    GATHER: tl.constexpr = True):
    """arrive_ptr[0]: the kernel's arrival counter; arrive_ptr[1 + j]: chunk j's (owner only).
    The reduced half of each symmetric buffer starts at element M * N.
    REDUCE / GATHER: both on GPUs; the interpreter, which runs one rank at a time, runs every
    rank's REDUCE half before any GATHER half (producers before consumers); the GATHER half
    finishes the call."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(epoch_ptr + 1)
    reduced_off = M * N
    for j in range(num_chunks):
        owner = j % world
        lo = j * rows_per_chunk
        hi = tl.minimum(lo + rows_per_chunk, M)
        if owner == rank:
            if REDUCE:
                reduce_chunk(data_table, flag_table, flags_ptr, arrive_ptr + 1 + j, err_ptr,
                             h_ptr, y_ptr, res_ptr, w_ptr, j, lo, hi, reduced_off, N, eps,
                             rank, world, epoch, limit, HAS_RES, NORM, W_FP32, BLOCK_N)
        elif GATHER:
            if lo + pid < hi:
                wait_flag(peer_ptr(flag_table, owner, tl.int32) + REDUCED + j, epoch, limit,
                          err_ptr, ERR_REDUCED)
            for row in range(lo + pid, hi, nprog):
                sum_sq = h_row(data_table, owner, reduced_off, h_ptr, res_ptr, row, N, world,
                               GATHER=True, STORE_SYM=False, HAS_RES=HAS_RES, BLOCK_N=BLOCK_N)
                if NORM:
                    norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32=W_FP32,
                             BLOCK_N=BLOCK_N)
    if GATHER:
        finish_call(flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, epoch, world, limit)
