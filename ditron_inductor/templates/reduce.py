"""Reduction of GEMM+reduce-scatter: out = scale * sum over the W slots of the receive buffer.

Slot s of the receive buffer holds rank s's partial product of this rank's output chunk (pushed
there by rank s's copy engine; slot `rank` written by this rank's own GEMM). The sum runs in fp32;
scale is 1 for "sum" and 1/W for "avg".
"""

import triton
import triton.language as tl


@triton.jit
def reduce_slots_kernel(src_ptr, out_ptr, n, slot_stride, world, scale, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.full([BLOCK], 0.0, tl.float32)
    ptrs = src_ptr + offs
    for _ in range(world):
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += slot_stride
    tl.store(out_ptr + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)
