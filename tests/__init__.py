"""The test suite (CPU; GPU tests under tests/gpu). The modules import each other as `tests.*`:
pytest puts the repository root on sys.path (pyproject's `pythonpath`), and the subprocesses
that run a module of it (`python -m tests.exit_program`) start in REPO_ROOT."""

import pathlib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
