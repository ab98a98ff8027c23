"""The calls for users, on CPU (no CUDA graph here: the compiled step alone): a tiny Llama's
`generate()` after `ditron_inductor.compile_decode(model)`, greedy and sampling over a static
cache, runs its decode steps through the compiled step and makes Inductor's tokens; a bare step
of `compile_step` gives eager's logits; a model without a static-cache generate() is refused.
Their CUDA graphs: tests/gpu/test_step_graph_gpu.py."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

import ditron_inductor
from ditron_inductor import step_graph
from tests import llama_tp

transformers = pytest.importorskip("transformers")

PROMPT, NEW_TOKENS = 8, 6
STATIC = {"max_new_tokens": NEW_TOKENS, "cache_implementation": "static", "use_cache": True}
# the keyword of the KV cache: `cache` from transformers 5.2x, `past_key_values` before
CACHE = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
         else "past_key_values")


def _model(**sizes):
    model = llama_tp.build_llama(llama_tp.llama_config(**sizes)).eval()
    model.generation_config.eos_token_id = None  # random weights: every call makes all its tokens
    return model


def _ids(model):
    return llama_tp.tokens(2, PROMPT, model.config.vocab_size, seed=0)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def decoding():
    """A model after compile_decode, its step counted: (model, calls into the step)."""
    model = ditron_inductor.compile_decode(_model())
    step, calls = model.get_compiled_call(None), []

    def counted(*args, **kwargs):
        calls.append(kwargs[CACHE])
        return step(*args, **kwargs)
    # what generate() asks of the hook, for any compile_config, is compile_decode's step
    assert model.get_compiled_call(model.generation_config.compile_config) is step
    model.get_compiled_call = lambda compile_config=None: counted
    return model, calls


def test_greedy_generate_makes_inductors_tokens_through_the_compiled_step(decoding):
    model, calls = decoding
    ids = _ids(model)
    graphs = _graphs()
    got = model.generate(ids, do_sample=False, **STATIC)[:, PROMPT:]
    # every decode step (the first token comes from the eager prefill) ran the compiled step,
    # which compiled one graph
    assert len(calls) == NEW_TOKENS - 1 and _graphs() - graphs == 1
    assert len({id(cache) for cache in calls}) == 1  # one static cache of generate()'s own
    reference = _model()
    config = transformers.CompileConfig(backend="inductor", fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    graphs = _graphs()
    want = reference.generate(ids, do_sample=False, compile_config=config, **STATIC)[:, PROMPT:]
    assert _graphs() - graphs == 1  # Inductor's tokens came from its compiled step
    assert got.tolist() == want.tolist()
    del calls[:]
    again = model.generate(ids, do_sample=False, **STATIC)[:, PROMPT:]  # a new cache: no compile
    assert torch.equal(again, got) and len(calls) == NEW_TOKENS - 1 and _graphs() - graphs == 1


def test_sampling_with_a_seed_runs_the_compiled_step(decoding):
    model, calls = decoding
    ids = _ids(model)
    del calls[:]
    torch.manual_seed(1)
    sampled = model.generate(ids, do_sample=True, **STATIC)[:, PROMPT:]
    assert len(calls) == NEW_TOKENS - 1
    torch.manual_seed(1)
    eager = model.generate(ids, do_sample=True, disable_compile=True, **STATIC)[:, PROMPT:]
    assert len(calls) == NEW_TOKENS - 1  # disable_compile: eager, the step not called
    assert sampled.tolist() == eager.tolist()
    greedy = model.generate(ids, do_sample=False, disable_compile=True, **STATIC)[:, PROMPT:]
    assert sampled.tolist() != greedy.tolist()  # it sampled


def test_a_bare_step_of_compile_step_gives_eager_logits(caplog):
    from transformers import StaticCache

    caplog.set_level(logging.INFO, logger="ditron")
    step_graph._no_cuda.cache_clear()
    model = _model(layers=1)
    step = ditron_inductor.compile_step(model.__call__)
    assert ditron_inductor.compile_step(model.__call__) is not step
    said = [r.getMessage() for r in caplog.records if "no CUDA" in r.getMessage()]
    assert said == ["StepGraph: no CUDA here: compiled steps run without a CUDA graph"]
    caches = [StaticCache(config=model.config, max_cache_len=PROMPT + 4) for _ in range(2)]
    with torch.no_grad():
        token = [model(input_ids=_ids(model), **{CACHE: c}, use_cache=True) for c in caches][0]
        token = token.logits[:, -1:].argmax(-1)
        for i in range(3):
            got = step(input_ids=token, **{CACHE: caches[0]}, use_cache=True).logits
            want = model(input_ids=token, **{CACHE: caches[1]}, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {i}")
            token = want[:, -1:].argmax(-1)


def test_a_model_without_a_static_cache_generate_is_refused():
    from transformers import LlamaForCausalLM, LlamaModel

    config = llama_tp.llama_config(layers=1)
    with pytest.raises(TypeError, match="LlamaModel is no transformers model with generate"):
        ditron_inductor.compile_decode(LlamaModel(config))
    with pytest.raises(TypeError, match="Linear is no transformers model with generate"):
        ditron_inductor.compile_decode(torch.nn.Linear(2, 2))

    class Eager(LlamaForCausalLM):
        _can_compile_fullgraph = False

    model = Eager(config)
    with pytest.raises(ValueError, match="does not compile Eager's decode step whole"):
        ditron_inductor.compile_decode(model)
    assert "get_compiled_call" not in vars(model)  # nothing installed


def test_a_new_kv_cache_drops_the_graphs_of_the_last():
    """(the graphs on CUDA: tests/gpu/test_step_graph_gpu.py)"""
    step = step_graph._DecodeStep(lambda x, cache: x + 1)
    first, second = object(), object()
    step(torch.zeros(1), cache=first)
    step.graphs["of the first cache"] = "a captured graph"
    step(torch.zeros(1), cache=first)
    assert step.graphs == {"of the first cache": "a captured graph"}
    assert torch.equal(step(torch.zeros(1), cache=second), torch.ones(1))
    assert step.graphs == {} and step.cache is second
