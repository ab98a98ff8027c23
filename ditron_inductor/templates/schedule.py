"""The Task's cross-rank schedule (scheduler/task.py: ring_order, block_owner) as the kernels
compute it; the interpreter tests compare the two.
"""

import triton
import triton.language as tl


@triton.jit
def ring_member(first, i, size):
    """The i-th member of the ring of `size` members that starts at `first`: rank r takes the
    chunks r, r + 1, ... (mod W), so that at every step the ranks work on distinct chunks."""
    return (first + i) % size


@triton.jit
def owned_block(block_row, owner, WORLD: tl.constexpr):
    """The block of block row `block_row` that rank `owner` reduces (owner may be a vector): block
    g is rank g % W's, so block row i (blocks W*i .. W*i + W - 1) holds one of every rank."""
    return block_row * WORLD + owner
