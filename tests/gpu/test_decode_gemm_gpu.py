"""The decode GEMM on a GPU (templates/gemv.py): one row at Llama-3-8B's TP 2 widths (each launch
config's range), and the grouped launch of q/k/v and gate/up (ditron.decode_mm_group), against
torch.mm in float32, eager and replayed in a CUDA graph; and the grouping through
`backend="ditron"` with `ditron.decode_gemm_groups` on. Every case asserts that the template
served it.

Run on the GPU machine: pytest -m gpu tests/gpu/test_decode_gemm_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from ditron_inductor import ops  # noqa: F401 - defines torch.ops.ditron.*

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN = 4096


def _weights(*widths):
    gen = torch.Generator(device="cuda").manual_seed(sum(widths))
    return [torch.randn(n, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) / 64
            for n in widths]


def _close(out, a, w):
    torch.testing.assert_close(out.float(), a.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("width", [512, 2048, 4096])  # k/v, q, o at TP 2
def test_one_row(width):
    from ditron_inductor.runtime import gemv

    a = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    (w,) = _weights(width)
    served = gemv.stats["decode_mm"]
    _close(torch.ops.ditron.decode_mm(a, w.t()), a, w)
    assert gemv.stats["decode_mm"] == served + 1


@pytest.mark.parametrize("widths", [(2048, 512, 512), (7168, 7168)])  # q/k/v, gate/up
def test_grouped_eager_and_in_a_cuda_graph(widths):
    from ditron_inductor.runtime import gemv

    a = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ws = _weights(*widths)
    served = gemv.stats["decode_mm_group"]
    for out, w in zip(torch.ops.ditron.decode_mm_group(a, [w.t() for w in ws]), ws):
        _close(out, a, w)
    assert gemv.stats["decode_mm_group"] == served + 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = torch.ops.ditron.decode_mm_group(a, [w.t() for w in ws])
    a.normal_()
    graph.replay()
    for out, w in zip(outs, ws):
        _close(out, a, w)


def test_grouped_through_the_backend():
    from ditron_inductor.runtime import gemv

    wq, wk, wv = _weights(2048, 512, 512)

    def qkv(x):
        return x @ wq.t(), x @ wk.t(), x @ wv.t()

    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    served = gemv.stats["decode_mm_group"]
    got = torch.compile(qkv, backend="ditron", options={"ditron.decode_gemm_groups": True})(x)
    assert gemv.stats["decode_mm_group"] == served + 1
    for out, w in zip(got, (wq, wk, wv)):
        _close(out, x, w)
