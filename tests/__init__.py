"""The test suite (CPU; GPU tests under tests/gpu). The modules import each other as `tests.*`:
pytest puts the repository root on sys.path (pyproject's `pythonpath`), and the subprocesses
that run a module of it (`python -m tests.exit_program`) start in REPO_ROOT."""

import pathlib
import socket
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free now on this host (a rendezvous for ranks the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_benchmark_on_cpu_ranks(script: str, *args: str, ranks: int = 2) -> None:
    """benchmarks/<script> under torchrun on `ranks` CPU ranks (gloo), asserting it ran through."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(ranks), "--master-port", str(free_port()),
                           str(REPO_ROOT / "benchmarks" / script), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
