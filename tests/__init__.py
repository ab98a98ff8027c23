"""The test suite (CPU; GPU tests under tests/gpu). The modules import each other as `tests.*`:
pytest puts the repository root on sys.path (pyproject's `pythonpath`), and the subprocesses
that run a module of it (`python -m tests.exit_program`) start in REPO_ROOT."""

import pathlib
import socket

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free now on this host (a rendezvous for ranks the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
