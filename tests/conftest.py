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


def pytest_collection_modifyitems(config, items):
    import pytest

    if not _numpy_too_new_for_the_interpreter():
        return
    import numpy

    skip = pytest.mark.skip(reason=f"the Triton interpreter needs numpy < 2.3 (found "
                                   f"{numpy.__version__}; `pip install 'numpy<2.3'`)")
    for item in items:
        if item.module.__name__.endswith("_interpreter"):
            item.add_marker(skip)
