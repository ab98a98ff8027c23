"""ditron-inductor: a torch.compile backend that fuses tensor-parallel communication into matmuls.

Use it as `torch.compile(model, backend="ditron")`; no import of this package is needed. A
framework that compiles with `backend="inductor"` takes ditron as Inductor passes instead:
`post_grad_pass`, `pre_grad_pass`, `inductor_config`, `install`, `installed`
(`ditron_inductor.inductor_pass`). A decode step replayed from one CUDA graph: `compile_decode`
(transformers' generate()) and `compile_step` (a loop of one's own), `ditron_inductor.step_graph`.
"""

__version__ = "0.1.0"

_PASS_API = ("post_grad_pass", "pre_grad_pass", "inductor_config", "install", "installed")
_STEP_API = ("compile_decode", "compile_step")


def __getattr__(name: str):
    # imported on first use: `import ditron_inductor` stays free of torch's import
    if name in _PASS_API:
        from . import inductor_pass

        return getattr(inductor_pass, name)
    if name in _STEP_API:
        from . import step_graph

        return getattr(step_graph, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
