"""The decode attention template on a GPU (templates/decode_attention.py): bfloat16 and float16 at
Llama-3-8B's TP 2 decode shapes (4 key/value heads of 4 packed query heads, head size 128, a
static cache of 1152 keys, B 1 and 16) against SDPA in float32, with a decode step's mask and
with none; replayed in a CUDA graph; and through `backend="ditron"` on a repeat_kv attention
(the packing rewrite puts the op in the graph). Every case asserts that the template served it.

Run on the GPU machine: pytest -m gpu tests/gpu/test_decode_attention_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditron_inductor import ops  # noqa: F401 - defines torch.ops.ditron.decode_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KV, ROWS, KEYS, DIM = 4, 4, 1152, 128


def _inputs(batch, dtype, valid):
    gen = torch.Generator(device="cuda").manual_seed(batch)
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for shape in
               ((batch, KV, ROWS, DIM), (batch, KV, KEYS, DIM), (batch, KV, KEYS, DIM)))
    mask = (torch.arange(KEYS, device="cuda") < valid)[None, None, None, :].expand(
        batch, 1, ROWS, KEYS)
    return q, k, v, mask


def _reference(q, k, v, mask):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          scale=DIM ** -0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("masked", [True, False])
def test_template_matches_sdpa(dtype, batch, masked):
    from ditron_inductor.runtime import decode_attention as template

    q, k, v, mask = _inputs(batch, dtype, valid=1030)
    mask = mask if masked else None
    assert template.decode_attention_applies(q, k, v, mask) is None
    served = template.stats["decode_attention"]
    out = torch.ops.ditron.decode_attention(q, k, v, mask, DIM ** -0.5)
    assert template.stats["decode_attention"] == served + 1
    torch.testing.assert_close(out.float(), _reference(q, k, v, mask), rtol=2e-2, atol=2e-2)


def test_replayed_in_a_cuda_graph():
    q, k, v, mask = _inputs(16, torch.bfloat16, valid=700)
    run = lambda: torch.ops.ditron.decode_attention(q, k, v, mask, DIM ** -0.5)  # noqa: E731
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(2):  # new data in the captured inputs
        q.normal_(), k.normal_(), v.normal_()
        graph.replay()
        torch.testing.assert_close(out.float(), _reference(q, k, v, mask), rtol=2e-2, atol=2e-2)


def test_through_the_backend():
    from ditron_inductor.runtime import decode_attention as template

    def attend(q, k, v, mask):  # transformers' repeat_kv, then SDPA with the step's mask
        b, kv, length, d = k.shape
        k = k[:, :, None].expand(b, kv, ROWS, length, d).reshape(b, kv * ROWS, length, d)
        v = v[:, :, None].expand(b, kv, ROWS, length, d).reshape(b, kv * ROWS, length, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    batch = 2
    q, k, v, mask = _inputs(batch, torch.bfloat16, valid=900)
    q = q.reshape(batch, KV * ROWS, 1, DIM)  # one query per head
    mask = mask[:, :, :1]
    torch._dynamo.reset()
    served = template.stats["decode_attention"]
    with torch.no_grad():
        out = torch.compile(attend, backend="ditron")(q, k, v, mask)
    assert template.stats["decode_attention"] > served
    with torch.no_grad():
        want = attend(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
