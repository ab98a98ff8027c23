"""The test suite (CPU; GPU tests under tests/gpu). The modules import each other as `tests.*`:
pytest puts the repository root on sys.path (pyproject's `pythonpath`), and the subprocesses
that run a module of it (`python -m tests.exit_program`) start in REPO_ROOT."""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import warnings

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free now on this host (a rendezvous for ranks the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_benchmark_on_cpu_ranks(script: str, *args: str, ranks: int = 2) -> None:
    """benchmarks/<script> under torchrun on `ranks` CPU ranks (gloo), asserting it ran through.
    Each rank writes to its own log files, and a failure shows the end of each: the rank that
    died first is often not the one with the longest traceback (a CI run showed only rank 0's
    "connection reset by peer" after rank 1 aborted, SIGABRT, in bench_fp8_tp.py's smoke run;
    30 runs here under load did not repeat it). A rank killed by a signal gets one more launch,
    its report kept as a warning; any other failure, or a second crash, fails the test."""
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as log_dir:
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                 "--master-port", str(free_port()), "--redirects", "3", "--log-dir", log_dir,
                 str(REPO_ROOT / "benchmarks" / script), "--device", "cpu", *args],
                capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # Python's stacks at a crash
            if proc.returncode == 0:
                return
            report = failure_report(pathlib.Path(log_dir), ranks, proc.stderr)
        first_failure = proc.stderr.split("Root Cause")[-1]  # torchrun's summary names it
        crashed = "Signal " in first_failure and "SIGTERM" not in first_failure
        assert crashed and attempt == 1, report
        warnings.warn(f"{script}: a rank crashed; launched once more. Its logs:\n{report}")


def failure_report(log_dir: pathlib.Path, ranks: int, launcher_err: str, lines: int = 20) -> str:
    """The last `lines` lines of each rank's stdout and stderr (torchrun's --log-dir layout:
    <run>/attempt_<i>/<rank>/std{out,err}.log), then the launcher's."""
    def tail(text: str) -> str:
        return "\n".join(text.splitlines()[-lines:]) or "(empty)"

    parts = []
    for rank in range(ranks):
        for stream in ("stdout", "stderr"):
            for path in sorted(log_dir.glob(f"*/attempt_*/{rank}/{stream}.log")):
                parts.append(f"rank {rank} {stream} ({path.parent.parent.name}):\n"
                             f"{tail(path.read_text(errors='replace'))}")
    return "\n\n".join(parts + [f"the launcher:\n{tail(launcher_err)}"])
