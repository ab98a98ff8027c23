"""runtime/kernel_launch.py on a GPU: a kernel launched for the caller's stream runs in its
order, at its first launch (Triton's path) as at later ones (the compiled launcher)."""

import pytest
import torch
import triton
import triton.language as tl

from ditron_inductor.runtime import kernel_launch
from ditron_inductor.templates.flags import global_ns

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPIN_NS = 50_000_000  # long enough that work queued behind it, if unordered, runs first


@triton.jit(do_not_specialize=["ns", "value"])
def late_write_kernel(x_ptr, ns, value):
    """Spin `ns` nanoseconds of the global timer, then store `value` at x_ptr."""
    start = global_ns()
    now = start
    while now - start < ns:
        now = global_ns()
    tl.store(x_ptr, value)


@pytest.mark.parametrize("stream_kind", ["default", "side"])
def test_work_queued_after_a_launch_sees_its_writes(stream_kind, monkeypatch):
    """The value a spinning kernel stores is what a copy queued after it on the same stream
    reads, for the default stream (handle 0: its first launch once ran on a new pool stream,
    and the copy read the old value) and for another stream."""
    monkeypatch.setattr(kernel_launch, "_runners", {})  # each case's first launch is Triton's
    stream = torch.cuda.default_stream() if stream_kind == "default" else torch.cuda.Stream()
    with torch.cuda.stream(stream):
        handle = kernel_launch.current_stream()
        assert (handle == 0) == (stream_kind == "default")
        x = torch.zeros(1, dtype=torch.int32, device="cuda")
        seen = []
        for value in (7, 8, 9):  # the first launch of the class, then the compiled launcher
            kernel_launch.launch(late_write_kernel, (1,), x, SPIN_NS, value, stream=handle)
            seen.append(x.clone())
        torch.cuda.synchronize()
    assert [int(v.item()) for v in seen] == [7, 8, 9]
