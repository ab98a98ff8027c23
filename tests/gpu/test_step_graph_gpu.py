"""StepGraph on a GPU: a compiled step replayed from its CUDA graphs gives eager's numbers on new
inputs, one graph per signature, writes to its inputs reach the caller's tensors, and the
step itself runs only to warm up and capture."""

import pytest
import torch

from ditron_inductor.step_graph import StepGraph

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _counted(fn):
    calls = [0]

    def step(*args, **kwargs):
        calls[0] += 1
        return fn(*args, **kwargs)
    return step, calls


def test_replays_give_eager_numbers_on_new_inputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(),
                                torch.nn.Linear(512, 256)).cuda()
    # M = 1 takes ditron's decode GEMM template: a Triton kernel of ours inside the capture
    step, calls = _counted(torch.compile(model, backend="ditron", fullgraph=True))
    graphed = StepGraph(step, warmup=2)
    with torch.no_grad():
        for rows in (1, 4):
            for i in range(4):
                x = torch.randn(rows, 256, device="cuda")
                out = graphed(x)
                torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4,
                                           msg=f"rows {rows}, call {i}")
    assert len(graphed.graphs) == 2
    assert calls[0] == 2 * 3  # per signature: 2 eager calls and the capture, then replays


@torch.no_grad()
def test_an_input_the_step_writes_is_written_back_to_the_callers_tensor():
    def accumulate(x, total):
        total.add_(x.sum(dim=0))
        return total * 2

    graphed = StepGraph(torch.compile(accumulate, fullgraph=True))
    for i in range(4):
        x, total = torch.randn(8, 16, device="cuda"), torch.randn(16, device="cuda")
        want_total = total + x.sum(dim=0)
        out = graphed(x, total)
        torch.testing.assert_close(total, want_total, msg=f"call {i}: the caller's total")
        torch.testing.assert_close(out, want_total * 2, msg=f"call {i}: the output")


@torch.no_grad()
def test_the_outputs_are_the_captured_tensors():
    graphed = StepGraph(torch.compile(lambda x: x + 1, fullgraph=True))
    eager = graphed(torch.zeros(4, device="cuda"))  # the warm-up call: an output of its own
    second = graphed(torch.ones(4, device="cuda"))  # captured, then replayed
    third = graphed(torch.full((4,), 5.0, device="cuda"))
    assert third is second  # the next replay overwrites them, as documented
    assert torch.equal(third, torch.full((4,), 6.0, device="cuda"))
    assert torch.equal(eager, torch.ones(4, device="cuda"))


def test_a_capture_with_autograd_on_is_refused():
    graphed = StepGraph(torch.compile(lambda x: x * 2, fullgraph=True))
    x = torch.ones(4, device="cuda")
    graphed(x)  # the warm-up call runs as it is
    with pytest.raises(RuntimeError, match="no autograd: call it under torch.no_grad"):
        graphed(x)
