"""StepGraph on a GPU: a compiled step replayed from its CUDA graphs gives eager's numbers on new
inputs, one graph per signature, writes to its inputs reach the caller's tensors, and the
step itself runs only to warm up and capture. The calls for users: a tiny Llama's generate()
after compile_decode replays its decode steps and makes Inductor's tokens; compile_step's bare
decode steps give eager's logits (fp32 within 1e-4, bf16 within 2e-2 of the largest logit)."""

import inspect

import pytest
import torch

import ditron_inductor
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


def _llama(dtype=torch.float32):
    from tests import llama_tp

    model = llama_tp.build_llama(llama_tp.llama_config(), device="cuda").to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: every call makes all its tokens
    return model, llama_tp.tokens(2, 8, model.config.vocab_size, seed=0, device="cuda")


STATIC = {"max_new_tokens": 8, "cache_implementation": "static", "use_cache": True}


def test_compile_decode_replays_generates_steps_and_makes_inductors_tokens():
    from transformers import CompileConfig

    model, ids = _llama()
    step = ditron_inductor.compile_decode(model).get_compiled_call(None)
    assert isinstance(step, StepGraph)
    step.step, calls = _counted(step.step)
    got = model.generate(ids, do_sample=False, **STATIC)
    # 7 decode steps: one warm-up call, the capture, 5 replays
    assert calls[0] == 2 and len(step.graphs) == 1
    again = model.generate(ids, do_sample=False, **STATIC)  # a new cache: captured anew
    assert calls[0] == 4 and len(step.graphs) == 1 and torch.equal(again, got)
    torch.manual_seed(0)
    sampled = model.generate(ids, do_sample=True, **STATIC)
    assert calls[0] == 6 and sampled.shape == got.shape
    reference, _ = _llama()
    config = CompileConfig(backend="inductor", fullgraph=True, dynamic=False)
    want = reference.generate(ids, do_sample=False, compile_config=config, **STATIC)
    assert got.tolist() == want.tolist()  # fp32: Inductor's tokens, token for token


# bf16: the decode GEMM template and cuBLAS sum in different orders; 2e-2 of the largest logit
# is about five bf16 roundings at that magnitude
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@torch.no_grad()
def test_compile_step_bare_decode_steps_give_eager_logits(dtype, tolerance):
    from transformers import StaticCache

    model, ids = _llama(dtype)
    # the KV cache's keyword: `cache` from transformers 5.2x, `past_key_values` before
    cache_keyword = ("cache" if "cache" in inspect.signature(type(model).forward).parameters
                     else "past_key_values")
    step = ditron_inductor.compile_step(model.__call__)
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    token = [model(input_ids=ids, **{cache_keyword: c}, use_cache=True) for c in caches][0]
    token = token.logits[:, -1:].argmax(-1)
    for i in range(5):  # a warm-up call, the capture, replays
        got = step(input_ids=token, **{cache_keyword: caches[0]}, use_cache=True).logits
        want = model(input_ids=token, **{cache_keyword: caches[1]}, use_cache=True).logits
        error = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert error <= tolerance, f"step {i}: {error:.2e} of the largest logit"
        token = want[:, -1:].argmax(-1)
    assert len(step.graphs) == 1
