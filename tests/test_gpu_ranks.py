"""The GPU tests' ranks run compiled kernels even when pytest collected the interpreter tests
into the same process (their modules set TRITON_INTERPRET=1 at import)."""

import os

from tests.gpu.ranks import spawn_ranks


def _record_interpret(rank: int, out_dir: str) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as fh:
        fh.write(os.environ.get("TRITON_INTERPRET", "unset"))


def test_spawned_ranks_do_not_inherit_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn_ranks(_record_interpret, (str(tmp_path),), 2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["unset", "unset"]
    assert os.environ["TRITON_INTERPRET"] == "1"  # the test process keeps its own mode
