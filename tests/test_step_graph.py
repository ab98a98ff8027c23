"""StepGraph on CPU: what it does without a GPU (calls the step as it is), its argument checks,
the signature that tells its graphs apart, and the plan choice it asks of ditron's compiles.
Its replays on a GPU: tests/gpu/test_step_graph_gpu.py."""

from __future__ import annotations

import enum

import pytest
import torch

from ditron_inductor import config
from ditron_inductor.scheduler import decide
from ditron_inductor.step_graph import StepGraph, _dense, _replayed_from_graphs, _signature


def test_without_cuda_tensors_the_step_runs_as_it_is():
    calls = []

    def step(x, *, scale):
        calls.append(scale)
        return x * scale

    graphed = StepGraph(step)
    x = torch.randn(3, 4)
    for scale in (2.0, 3.0):
        assert torch.equal(graphed(x, scale=scale), x * scale)
    assert calls == [2.0, 3.0] and graphed.graphs == {}


def test_a_capture_needs_a_warm_up_call_first():
    with pytest.raises(ValueError, match="warmup=0: at least one eager call"):
        StepGraph(lambda x: x, warmup=0)


class Mode(enum.Enum):
    A = 1


def test_the_signature_compares_layouts_values_and_objects_by_identity():
    t = torch.zeros(2, 3)
    assert _signature(t) == _signature(torch.ones(2, 3))  # the values are the inputs' own
    assert _signature(t) != _signature(t.t().contiguous().t())  # strides
    assert _signature(t) != _signature(t.to(torch.float16))
    assert _signature(t) != _signature(torch.zeros(3, 2))
    assert _signature(t) != _signature(torch.zeros(2, 3, requires_grad=True))
    assert _signature(1) != _signature(2) and _signature(True) != _signature(1)
    assert _signature("logits") == _signature("logits") and _signature(None) == _signature(None)
    assert _signature(Mode.A) == _signature(Mode.A)
    cache, other = object(), object()  # e.g. a KV cache: its tensors are read at their addresses
    assert _signature(cache) == _signature(cache) != _signature(other)


def test_ditron_compiles_inside_a_capture_pick_the_cuda_graph_plans(monkeypatch):
    from torch._inductor import config as inductor_config

    monkeypatch.delenv("DITRON_CUDA_GRAPHS", raising=False)
    for cudagraphs in (False, True):  # auto: Inductor's "reduce-overhead" decides
        with inductor_config.patch({"triton.cudagraphs": cudagraphs}):
            assert decide.replayed_in_cuda_graph(config.defaults()) is cudagraphs
            with _replayed_from_graphs():
                assert decide.replayed_in_cuda_graph(config.defaults()) is True
            assert config.defaults().cuda_graphs is None
    monkeypatch.setenv("DITRON_CUDA_GRAPHS", "0")  # ditron.cuda_graphs=0 wins
    with inductor_config.patch({"triton.cudagraphs": True}):
        assert decide.replayed_in_cuda_graph(config.defaults()) is False


def test_its_graphs_are_released_before_the_process_group():
    """NCCL's finalize waits for every CUDA graph holding one of its collectives: the exit path's
    release_cuda_graphs (run by destroy_process_group and at exit) empties every StepGraph."""
    from ditron_inductor import clean_exit

    graphed = StepGraph(lambda x: x)
    graphed.graphs["signature"] = "a captured graph"
    graphed._eager["other"] = (1, set())
    clean_exit.release_cuda_graphs()
    assert graphed.graphs == {} and graphed._eager == {}


def test_a_captured_argument_must_be_dense():
    """The graph's copy of an argument has its shape and strides: every element its own word and
    no gaps (any order of the dims)."""
    x = torch.zeros(4, 6)
    assert _dense(x) and _dense(x.t()) and _dense(x[1:3]) and _dense(torch.zeros(1, 5)[:, :3].t())
    assert not _dense(torch.zeros(4, 1).expand(4, 6))  # elements that share memory
    assert not _dense(x[:, ::2])  # gaps
    assert not _dense(x[:, :3])  # rows with gaps between them
