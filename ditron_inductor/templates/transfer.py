"""The all-gather's local copies as one kernel: my shard into my symmetric buffer (what the peers
pull) and into my rows of the gathered A, read once, as 4-byte words (runtime/all_gather.py:
before the Triton GEMM; two memcpys where the shard is not whole aligned words)."""

import triton
import triton.language as tl


@triton.jit
def copy_twice_kernel(src_ptr, dst_a_ptr, dst_b_ptr, words, BLOCK: tl.constexpr):
    """src -> dst_a and dst_b, `words` words; a grid-stride loop: one grid serves every size."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, words, nprog * BLOCK):
        idx = start + offs
        mask = idx < words
        x = tl.load(src_ptr + idx, mask=mask)
        tl.store(dst_a_ptr + idx, x, mask=mask)
        tl.store(dst_b_ptr + idx, x, mask=mask)
