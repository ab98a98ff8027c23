"""Where no GPU is present the Triton kernels run in Triton's interpreter, and the switch must be
set before anything imports triton: triton.language's own jit functions (`tl.cdiv`, ...) are made
interpreted or compiled once, at its import. Set only in each interpreter test module, it came too
late whenever an earlier module had imported triton through Inductor, and those tests failed
depending on the order they ran in. An explicit TRITON_INTERPRET is kept as it is."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
