"""Where no GPU is present the Triton kernels run in Triton's interpreter, and the switch must be
set before anything imports triton: triton.language's own jit functions (`tl.cdiv`, ...) are made
interpreted or compiled once, at its import. Set only in each interpreter test module, it came too
late whenever an earlier module had imported triton through Inductor, and those tests failed
depending on the order they ran in. An explicit TRITON_INTERPRET is kept as it is."""

import os

# Scalar C++ kernels where Inductor compiles for the CPU: the tests check graphs and numbers, not
# Inductor's vectorized CPU code, and g++ takes about a third less time on them (compiles are
# most of the suite's time). Spawned ranks and benchmark subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

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
                 "test_bench_e2e_moe.py", "test_transformers_ep.py", "test_transformers_tp.py",
                 "test_all_reduce_interpreter.py", "test_moe_gloo.py", "test_fp8.py",
                 "test_causal_mask.py", "test_decode_e2e.py")


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture(autouse=True)
def _ditron_records_reach_caplog(request):
    """caplog's handler sits on the root logger, which the "ditron" logger does not propagate to
    (log_names: one line per message under a framework's root handler); a test that asks for
    caplog gets the handler on the "ditron" logger as well."""
    if "caplog" not in request.fixturenames:
        yield
        return
    import logging

    from ditron_inductor.log_names import LOGGER_NAME

    handler = request.getfixturevalue("caplog").handler
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _no_wait_report_outlives_its_test():
    """A test whose kernel's wait gives up writes the process-wide report
    (runtime/faults.py), which ends a real process; the next test starts without it."""
    yield
    faults = __import__("sys").modules.get("ditron_inductor.runtime.faults")
    if faults is not None and faults._report is not None:
        faults._report.zero_()
