"""SM-driven transfers: a few programs pull every peer's chunk through the peer-pointer table.

`ag_pull_kernel` runs on a copy stream next to the all-gather GEMM (which then leaves `nprog` SMs
free for it, so both are always resident together). Chunk i of the ring (rank, rank+1, ...) is
copied by all programs together, each a strided share of BLOCK-element pieces: a program waits for
READY[p] (the owner filled its symmetric buffer), copies its share, then adds 1 (release) to the
chunk's arrival counter. The GEMM waits until a chunk's counter reaches `expect` (= nprog x the
number of calls made with this counter), so the counters, like flags, are never reset.

Elements are moved as 4-byte words (the shard's byte size must divide by 4).
"""

import triton
import triton.language as tl

from .flags import peer_ptr, wait_flag
from .schedule import ring_member


@triton.jit(do_not_specialize=["rank", "src_off", "chunk_words", "epoch", "limit"])
def ag_pull_kernel(data_table, src_off, dst_ptr, ready_ptr, count_ptr, err_ptr,
                   rank, world, chunk_words, epoch, limit, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for i in range(world):
        p = ring_member(rank, i, world)
        if i > 0:
            wait_flag(ready_ptr + p, epoch, limit, err_ptr, p + 1)
        src = peer_ptr(data_table, p, tl.int32) + src_off
        dst = dst_ptr + p.to(tl.int64) * chunk_words
        for start in range(pid * BLOCK, chunk_words, nprog * BLOCK):
            idx = start + offs
            mask = idx < chunk_words
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
        tl.atomic_add(count_ptr + p, 1, sem="release", scope="gpu")


@triton.jit
def copy_twice_kernel(src_ptr, dst_a_ptr, dst_b_ptr, words, BLOCK: tl.constexpr):
    """src -> dst_a and dst_b, `words` 4-byte words, read once (the all-gather's local copies:
    my shard into my symmetric buffer and into my rows of the gathered A). A grid-stride loop,
    so one grid (a few programs per SM) serves every shard size."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, words, nprog * BLOCK):
        idx = start + offs
        mask = idx < words
        x = tl.load(src_ptr + idx, mask=mask)
        tl.store(dst_a_ptr + idx, x, mask=mask)
        tl.store(dst_b_ptr + idx, x, mask=mask)
