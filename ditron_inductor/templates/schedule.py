"""The Task's cross-rank schedule (scheduler/task.py) as the kernels compute it; the interpreter
tests compare the two.

- Ring order (`Task.ring_order`): rank r takes the chunks in the order r, r + 1, ... (mod W), so
  that at every step the ranks work on distinct chunks.
- Block ownership (`Task.block_owner`): the all-reduce's block g of BLOCK elements is reduced by
  rank g % W, so block row i (blocks W*i .. W*i + W - 1) holds one block of every rank.
"""

import triton
import triton.language as tl


@triton.jit
def ring_member(first, i, size):
    """The i-th member of the ring of `size` members that starts at `first`."""
    return (first + i) % size


@triton.jit
def owned_block(block_row, owner, WORLD: tl.constexpr):
    """The block of block row `block_row` that rank `owner` reduces (owner may be a vector)."""
    return block_row * WORLD + owner
