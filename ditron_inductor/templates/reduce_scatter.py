"""GEMM + reduce-scatter with the reduction beside the GEMM: each rank pulls its rows of every
rank's partial as the GEMM finishes them, and sums them.

Every rank's partial P_q = a_q @ b (+ bias) [M, N] is written into its symmetric buffer by the
persistent GEMM of templates/gemm_ready.py with SLICES = W: rank r's slice is rows [r * R,
(r + 1) * R) (R = M / W), and chunk c holds row-blocks c * G .. c * G + G - 1 of every slice
(`chunk_rows` = G * BLOCK_M rows of each); the GEMM raises READY[c] = epoch in my flags when
chunk c is stored. The result on rank r is out = sum_q P_q[slice r] (x scale for avg), summed in
fp32 and rounded once.

pull_reduce_kernel runs on a few SMs beside the GEMM (side stream). Program pid takes blocks
pid, pid + P, ... of my slice (BLOCK elements each); before a block it waits for READY of every
chunk up to the one holding the block's last row that it has not yet seen, on every rank (the
persistent GEMM finishes chunks only about in order); then it loads the block from the W
partials (W - 1 of them over NVLink, all in flight together), sums and stores it into `out`
(local memory). The last program through advances the epoch.

No barrier ends a call. The partials alternate between the two halves of each buffer by epoch
parity (`parity_elems` apart): the next call's GEMM writes the other half, and the call after it
writes this half again only once this kernel has seen READY of the next call from every peer,
which a peer's GEMM raises only after its own reduction of this call has finished reading
(its main stream joins its side stream at the end of every call).
"""

import triton
import triton.language as tl

from .flags import finish_call, peer_ptr, wait_chunks_through


@triton.jit(do_not_specialize=["rows", "rank", "chunk_rows", "parity_elems", "scale", "limit"])
def pull_reduce_kernel(data_table, flag_table, epoch_ptr, arrive_ptr, err_ptr, out_ptr, rows, N,
                       rank, chunk_rows, parity_elems, scale, limit, BLOCK: tl.constexpr,
                       WORLD: tl.constexpr, WORLD_P2: tl.constexpr, SCALE: tl.constexpr):
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + 1)
    dtype = out_ptr.dtype.element_ty
    numel = rows * N  # my slice; int32 offsets: the runtime keeps its buffers below 2**31
    first = (epoch % 2) * parity_elems + rank * numel  # my slice in this call's partials
    offs = tl.arange(0, BLOCK)
    ready = 0  # chunks [0, ready) are complete on every rank
    for blk in range(pid, tl.cdiv(numel, BLOCK), tl.num_programs(0)):
        start = blk * BLOCK
        idx = start + offs
        mask = idx < numel
        ready = wait_chunks_through(flag_table, ready, tl.minimum(start + BLOCK, numel) - 1, N,
                                    chunk_rows, epoch, limit, err_ptr, WORLD, WORLD_P2)
        acc = tl.zeros([BLOCK], tl.float32)
        for q in tl.static_range(WORLD):
            part = tl.load(peer_ptr(data_table, q, dtype, True) + first + idx, mask=mask,
                           other=0.0)
            acc += part.to(tl.float32)
        if SCALE:
            acc = acc * scale
        tl.store(out_ptr + idx, acc.to(dtype), mask=mask)
    finish_call(arrive_ptr, epoch_ptr, epoch)
