"""The Task's cross-rank schedule (scheduler/task.py) as the kernels compute it.

- Ring order: rank r takes the ranks' chunks in the order r, r + 1, ... (mod W), so that at
  every step the ranks work on distinct chunks (`Task.ring_order`). The all-gather's pull walks
  the ranks so, and its GEMM walks its row-blocks so, from the first of its own chunk.
- Block ownership: the all-reduce cuts the flattened partial into blocks of BLOCK elements and
  block g is reduced by rank g % W (`Task.block_owner`): block row i, blocks W*i .. W*i + W - 1,
  holds one block of every rank.

The interpreter tests run these helpers and compare them with the Task's methods.
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
