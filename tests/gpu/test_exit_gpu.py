"""A program that ran the fused ops on 2 GPUs runs to its exit, however it shuts down."""

from __future__ import annotations

import pytest
import torch

from tests.test_e2e_gloo import run_exit_program

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
@pytest.mark.parametrize("shutdown", ["destroy", "none", "runtime"])
@pytest.mark.parametrize("workload", ["train", "infer"])
def test_program_with_fused_ops_exits(workload, shutdown):
    # infer: the fused all-reduce captured in CUDA graphs (a prefill run of e2e_llama.py with
    # such graphs once did not exit within 25 s of its last line)
    out = run_exit_program("--shutdown", shutdown, "--device", "cuda", "--workload", workload,
                           "--timeout", "120", timeout_s=200)
    assert "rank 0: 0 ditron ops" not in out, out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
def test_program_with_fused_ops_and_async_tp_exits():
    # ditron's all-reduce and Inductor's async TP (PyTorch's symmetric memory for the same
    # group) in CUDA graphs of one process, as e2e_llama.py's prefill run holds them
    out = run_exit_program("--shutdown", "destroy", "--device", "cuda", "--workload", "infer",
                           "--async-tp", "--timeout", "120", timeout_s=200)
    assert "rank 0: 0 ditron ops" not in out, out
