"""The Triton kernels compile for Hopper on a machine without a GPU (sm90_compile.py, in a
separate process): errors that the interpreter does not raise, such as a non-constexpr global
read inside a kernel, fail here instead of on the GPU machine."""

import os
import shutil
import subprocess
import sys

import pytest

from tests import REPO_ROOT

triton = pytest.importorskip("triton")


def _ptxas_available() -> bool:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(bundled) or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas_available(), reason="no ptxas for the sm_90 back end")
def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.sm90_compile"],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == 96, proc.stdout
