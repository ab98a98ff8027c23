"""GEMM + all-reduce (+ residual + RMSNorm): the first reduction kernels (one-shot, two-shot) on
symmetric memory, and what every all-reduce kernel shares (the flag layout, the waits). The
default kernel is the push kernel of all_reduce_push.py, faster at every size measured; these
stay for comparison.

Every rank's partial product P_q = a_q @ b_q (+ bias) [M, N] lies in rank q's symmetric data
buffer (written there by cuBLAS), reached through the peer-pointer table `data_table`. The result
on every rank is h = sum_q P_q (+ residual) and, with NORM, y = RMSNorm(h) * weight.

- `one_shot_kernel` (decode): one launch per rank after its GEMM. Program 0 raises my READY[0];
  every program waits for every peer's READY[0], then each row (row = pid, pid + P, ...) is summed
  over the W partials in fp32, the residual added and the row normalised in the same program.
- `two_shot_kernel` (prefill): the rows are cut into `num_chunks` chunks; chunk j is owned by rank
  j % W. The GEMM runs chunk by chunk on the main stream, chunk 0 first on every rank (the order in
  which the owners reduce), and READY[j] is raised after each chunk. This kernel runs on a side
  stream on a few SMs at the same time: for each chunk in order, the owner waits for READY[j] of
  every rank, reduces the rows, writes the sums to the "reduced" half of its symmetric buffer,
  adds its residual, writes h (and y) and raises REDUCED[j]; the other ranks wait for the owner's
  REDUCED[j], copy the sums from there, add their own residual and normalise (the norm costs no
  traffic). Every rank adds its own residual, as the reference does.
  With GEMM_DONE (decode and mid sizes) the GEMM runs whole before the kernel, on the same
  stream (cutting it into row chunks would re-read the weights once per chunk), and one READY
  flag stands for every chunk; every rank reduces its own chunks first, then gathers the others:
  ~2(W-1)/W of the partial's bytes move per rank against the one-shot's (W-1).

The world size is a compile-time constant (WORLD, and WORLD_P2 its next power of two): the loop
over the ranks is unrolled, and a wait for all ranks polls their W flags with one vector of loads.
VEC: the peer buffers are declared 16-byte aligned, so rows move as 16-byte vectors (N is
specialised on divisibility by 16); without it every element is its own 2-byte access. Which is
faster per size is measured (benchmarks/bench_all_reduce.py plans *_scalar).

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
# the push kernel (all_reduce_push.py): STARTED + p * WORLD + q = program p of rank q has started
# (rank q's partial is complete); PUSHED + p * WORLD + q = program p of rank q pushed its sums to
# me; LOCAL + p = my program p has copied its rows out (a barrier over my programs)
MAX_PROGS, MAX_WORLD = 128, 16
STARTED = REDUCED + MAX_CHUNKS
PUSHED = STARTED + MAX_PROGS * MAX_WORLD
LOCAL = PUSHED + MAX_PROGS * MAX_WORLD
FLAG_WORDS = LOCAL + MAX_PROGS
# error codes (err word): which wait gave up
ERR_READY, ERR_REDUCED, ERR_DONE, ERR_PUSHED, ERR_LOCAL, ERR_STARTED, ERR_SENT = 1, 2, 3, 4, 5, 6, 7
# the same numbers for the kernels (Triton reads only constexpr globals)
K_DONE, K_READY, K_REDUCED = tl.constexpr(DONE), tl.constexpr(READY), tl.constexpr(REDUCED)
K_ERR_READY, K_ERR_REDUCED = tl.constexpr(ERR_READY), tl.constexpr(ERR_REDUCED)
K_ERR_DONE = tl.constexpr(ERR_DONE)
K_ERR_PUSHED, K_ERR_LOCAL = tl.constexpr(ERR_PUSHED), tl.constexpr(ERR_LOCAL)
K_ERR_STARTED, K_ERR_SENT = tl.constexpr(ERR_STARTED), tl.constexpr(ERR_SENT)
K_STARTED, K_PUSHED = tl.constexpr(STARTED), tl.constexpr(PUSHED)
K_LOCAL, K_MAX_PROGS = tl.constexpr(LOCAL), tl.constexpr(MAX_PROGS)

def world_constants(world: int) -> dict:
    """The kernels' compile-time world size: WORLD, and WORLD_P2 its next power of two."""
    return dict(WORLD=world, WORLD_P2=triton.next_power_of_2(world))


# N is specialised (whether it divides by 16): rows then start 16-byte aligned and the loads
# and stores of a row compile to 16-byte vectors; the other integers change from call to call
_DYNAMIC = ["M", "eps", "rank", "rows_per_chunk", "num_chunks", "limit"]


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def wait_all(ptrs, mask, epoch, limit, err_ptr, code):
    """Wait until every flag *ptrs[i] (where mask) >= epoch, polling them together: one vector of
    acquire loads per poll (one NVLink round trip for remote flags, not one per flag)."""
    v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), epoch)
    n = 0
    while (tl.min(v, 0) < epoch) & ((limit == 0) | (n < limit)):
        v = tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys"), epoch)
        n += 1
    if tl.min(v, 0) < epoch:
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
def h_row(data_table, src_rank, sym_out_off, h_ptr, res_ptr, row, N,
          GATHER: tl.constexpr, STORE_SYM: tl.constexpr, HAS_RES: tl.constexpr,
          BLOCK_N: tl.constexpr, WORLD: tl.constexpr, VEC: tl.constexpr):
    """Write row `row` of h and return its sum of squares (fp32). The all-reduced sum s comes
    from rank src_rank's reduced half (GATHER), or from the W partials (and with STORE_SYM it is
    published in the reduced half of rank src_rank = mine); h = s + my residual. The loop over
    the ranks is unrolled (WORLD is a constant), so the W loads of a block are in flight
    together. Every rank adds its own residual, as the reference does (in tensor parallelism the
    ranks' residuals are equal, but nothing here relies on it)."""
    dtype = h_ptr.dtype.element_ty
    base = row * N  # int32: the runtime keeps 2 * M * N below 2**31
    ss = tl.full([BLOCK_N], 0.0, tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        if GATHER:
            h = tl.load(peer_ptr(data_table, src_rank, dtype, VEC) + sym_out_off + base
                        + cols, mask=mask, other=0.0)
        else:
            acc = tl.full([BLOCK_N], 0.0, tl.float32)
            for q in tl.static_range(WORLD):
                acc += tl.load(peer_ptr(data_table, q, dtype, VEC) + base + cols, mask=mask,
                               other=0.0).to(tl.float32)
            h = acc.to(dtype)  # the all-reduce's own rounding, as in the reference
            if STORE_SYM:
                tl.store(peer_ptr(data_table, src_rank, dtype, VEC) + sym_out_off + base
                         + cols, h, mask=mask)
        if HAS_RES:
            res = tl.load(res_ptr + base + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(h_ptr + base + cols, h, mask=mask)
        hf = h.to(tl.float32)
        ss += hf * hf
    return tl.reduce(ss, 0, _add)


@triton.jit
def norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32: tl.constexpr,
             BLOCK_N: tl.constexpr, SKIP_L1: tl.constexpr):
    """y = RMSNorm(h) * weight for one row of h whose sum of squares is sum_sq. SKIP_L1: load h
    with .cg (where other programs wrote h: it skips this SM's L1). A flag, not the modifier
    string: Triton 3.6 cannot compile a str constexpr in a called function (seen on the GPU
    machine)."""
    dtype = y_ptr.dtype.element_ty
    base = row * N  # int32: the runtime keeps 2 * M * N below 2**31
    rstd = tl.rsqrt(sum_sq / N + eps)
    tl.debug_barrier()  # h of this row may have been stored by this program's threads
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = cols < N
        if SKIP_L1:
            h = tl.load(h_ptr + base + cols, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            h = tl.load(h_ptr + base + cols, mask=mask, other=0.0)
        h = h.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if W_FP32:
            y = (h * rstd * w).to(dtype)
        else:
            y = ((h * rstd).to(dtype).to(tl.float32) * w).to(dtype)
        tl.store(y_ptr + base + cols, y, mask=mask)


@triton.jit
def finish_call(flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, epoch, limit,
                WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """The last program of this rank: DONE, wait for every peer's DONE, advance the epoch."""
    nprog = tl.num_programs(0)
    arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:
        tl.atomic_xchg(arrive_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flags_ptr + K_DONE, epoch, sem="release", scope="sys")
        wait_peers(flag_table, K_DONE, epoch, limit, err_ptr, K_ERR_DONE, WORLD, WORLD_P2)
        tl.store(epoch_ptr, epoch)
        tl.store(epoch_ptr + 1, epoch + 1)


@triton.jit
def reduce_chunk(data_table, flag_table, flags_ptr, chunk_arrive_ptr, err_ptr, h_ptr, y_ptr,
                 res_ptr, w_ptr, ready_idx, j, lo, hi, reduced_off, N, eps, rank, epoch, limit,
                 HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                 BLOCK_N: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                 VEC: tl.constexpr):
    """The owner's part of chunk j (rows [lo, hi)): wait for every rank's partial rows (flag
    ready_idx), reduce them (+ residual, norm), publish h in my reduced half; the last program
    through raises REDUCED[j]."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if lo + pid < hi:
        wait_peers(flag_table, ready_idx, epoch, limit, err_ptr, K_ERR_READY, WORLD, WORLD_P2)
    for row in range(lo + pid, hi, nprog):
        sum_sq = h_row(data_table, rank, reduced_off, h_ptr, res_ptr, row, N, GATHER=False,
                       STORE_SYM=True, HAS_RES=HAS_RES, BLOCK_N=BLOCK_N, WORLD=WORLD, VEC=VEC)
        if NORM:
            norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32, BLOCK_N, False)
    arrived = tl.atomic_add(chunk_arrive_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:
        tl.atomic_xchg(chunk_arrive_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flags_ptr + K_REDUCED + j, epoch, sem="release", scope="sys")


@triton.jit
def gather_chunk(data_table, flag_table, err_ptr, h_ptr, y_ptr, res_ptr, w_ptr, j, lo, hi,
                 reduced_off, N, eps, epoch, limit, HAS_RES: tl.constexpr, NORM: tl.constexpr,
                 W_FP32: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr,
                 VEC: tl.constexpr):
    """A non-owner's part of chunk j: wait for the owner's REDUCED[j], copy the sums, add my
    residual, normalise."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    owner = j % WORLD
    if lo + pid < hi:
        wait_flag(peer_ptr(flag_table, owner, tl.int32) + K_REDUCED + j, epoch, limit, err_ptr,
                  K_ERR_REDUCED)
    for row in range(lo + pid, hi, nprog):
        sum_sq = h_row(data_table, owner, reduced_off, h_ptr, res_ptr, row, N, GATHER=True,
                       STORE_SYM=False, HAS_RES=HAS_RES, BLOCK_N=BLOCK_N, WORLD=WORLD, VEC=VEC)
        if NORM:
            norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32, BLOCK_N, False)


@triton.jit(do_not_specialize=_DYNAMIC)
def one_shot_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                    h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, limit,
                    HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                    BLOCK_N: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                    VEC: tl.constexpr = True):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(epoch_ptr + 1)
    if pid == 0:  # my partial is complete: the GEMM before this kernel on the stream wrote it
        tl.atomic_xchg(flags_ptr + K_READY, epoch, sem="release", scope="sys")
    wait_peers(flag_table, K_READY, epoch, limit, err_ptr, K_ERR_READY, WORLD, WORLD_P2)
    for row in range(pid, M, nprog):
        sum_sq = h_row(data_table, rank, 0, h_ptr, res_ptr, row, N, GATHER=False,
                       STORE_SYM=False, HAS_RES=HAS_RES, BLOCK_N=BLOCK_N, WORLD=WORLD, VEC=VEC)
        if NORM:
            norm_row(h_ptr, y_ptr, w_ptr, row, N, sum_sq, eps, W_FP32, BLOCK_N, False)
    finish_call(flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, epoch, limit, WORLD,
                WORLD_P2)


@triton.jit(do_not_specialize=_DYNAMIC)
def two_shot_kernel(data_table, flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr,
                    h_ptr, y_ptr, res_ptr, w_ptr, M, N, eps, rank, rows_per_chunk,
                    num_chunks, limit,
                    HAS_RES: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
                    BLOCK_N: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                    VEC: tl.constexpr = True, GEMM_DONE: tl.constexpr = False,
                    REDUCE: tl.constexpr = True, GATHER: tl.constexpr = True):
    """arrive_ptr[0]: the kernel's arrival counter; arrive_ptr[1 + j]: chunk j's (owner only).
    The reduced half of each symmetric buffer starts at element M * N.
    GEMM_DONE: the whole GEMM ran before this kernel on the same stream (no overlap: the decode
    sizes, where cutting the GEMM would re-read the weights): program 0 raises READY[0] and
    every chunk waits on it. Else the runtime raises READY[j] after GEMM chunk j.
    REDUCE / GATHER: both on GPUs; the interpreter, which runs one rank at a time, runs every
    rank's REDUCE half before any GATHER half (producers before consumers); the GATHER half
    finishes the call."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(epoch_ptr + 1)
    if GEMM_DONE:
        if REDUCE and pid == 0:
            tl.atomic_xchg(flags_ptr + K_READY, epoch, sem="release", scope="sys")
    reduced_off = M * N
    for j in range(num_chunks):
        lo = j * rows_per_chunk
        hi = tl.minimum(lo + rows_per_chunk, M)
        if j % WORLD == rank:
            if REDUCE:
                ready_idx = K_READY if GEMM_DONE else K_READY + j
                reduce_chunk(data_table, flag_table, flags_ptr, arrive_ptr + 1 + j, err_ptr,
                             h_ptr, y_ptr, res_ptr, w_ptr, ready_idx, j, lo, hi, reduced_off, N,
                             eps, rank, epoch, limit, HAS_RES, NORM, W_FP32, BLOCK_N, WORLD,
                             WORLD_P2, VEC)
        elif GATHER and not GEMM_DONE:  # pipelined: gather each chunk as soon as it is reduced
            gather_chunk(data_table, flag_table, err_ptr, h_ptr, y_ptr, res_ptr, w_ptr, j, lo, hi,
                         reduced_off, N, eps, epoch, limit, HAS_RES, NORM, W_FP32, BLOCK_N, WORLD,
                         VEC)
    if GATHER:
        if GEMM_DONE:  # every rank reduces its own chunks first, all at once, then gathers
            for j in range(num_chunks):
                if j % WORLD != rank:
                    lo = j * rows_per_chunk
                    hi = tl.minimum(lo + rows_per_chunk, M)
                    gather_chunk(data_table, flag_table, err_ptr, h_ptr, y_ptr, res_ptr, w_ptr,
                                 j, lo, hi, reduced_off, N, eps, epoch, limit, HAS_RES, NORM,
                                 W_FP32, BLOCK_N, WORLD, VEC)
        finish_call(flag_table, flags_ptr, epoch_ptr, arrive_ptr, err_ptr, epoch, limit, WORLD,
                    WORLD_P2)
