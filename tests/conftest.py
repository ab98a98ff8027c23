"""Where no GPU is present the Triton kernels run in Triton's interpreter, and the switch must be
set before anything imports triton: triton.language's own jit functions (`tl.cdiv`, ...) are made
interpreted or compiled once, at its import. Set only in each interpreter test module, it came too
late whenever an earlier module had imported triton through Inductor, and those tests failed
depending on the order they ran in. An explicit TRITON_INTERPRET is kept as it is."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _numpy_too_new_for_the_interpreter():
    """The Triton interpreter converts 1-element arrays to Python ints, which numpy >= 2.3
    refuses ("only 0-dimensional arrays can be converted to Python scalars")."""
    import numpy

    major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
    return (major, minor) >= (2, 3)


# The slowest files first: scripts/test.sh's two workers take whole files in collection order,
# so the short files left for the end let both workers finish together.
SLOWEST_FIRST = ("test_llama_e2e.py", "test_kernels_compile.py", "test_e2e_gloo.py",
                 "test_bench_e2e_moe.py", "test_transformers_ep.py", "test_all_reduce_interpreter.py",
                 "test_moe_gloo.py", "test_fp8.py", "test_causal_mask.py", "test_decode_e2e.py")


def pytest_collection_modifyitems(config, items):
    import pytest

    order = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: files stay whole
    if not _numpy_too_new_for_the_interpreter():
        return
    import numpy

    skip = pytest.mark.skip(reason=f"the Triton interpreter needs numpy < 2.3 (found "
                                   f"{numpy.__version__}; `pip install 'numpy<2.3'`)")
    for item in items:
        if item.module.__name__.endswith("_interpreter"):
            item.add_marker(skip)
