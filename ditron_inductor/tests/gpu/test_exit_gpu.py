"""A program that ran the fused ops on 2 GPUs runs to its exit, however it shuts down."""

from __future__ import annotations

import pytest
import torch

from ditron_inductor.tests.test_e2e_gloo import run_exit_program

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
@pytest.mark.parametrize("shutdown", ["destroy", "none", "runtime"])
def test_program_with_fused_ops_exits(shutdown):
    out = run_exit_program("--shutdown", shutdown, "--device", "cuda", "--timeout", "300",
                           timeout_s=400)
    assert "rank 0: 0 ditron ops" not in out, out
