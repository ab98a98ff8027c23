"""The layering holds: each runtime and scheduler module imports alone in a fresh interpreter,
modules share public names only, the runtime never imports the ops nor the scheduler's decisions,
and lowering takes Tasks from the scheduler."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from tests import REPO_ROOT

PACKAGE = REPO_ROOT / "ditron_inductor"
MODULES = sorted(f"ditron_inductor.{p.parent.name}.{p.stem}"
                 for layer in ("runtime", "scheduler") for p in (PACKAGE / layer).glob("*.py")
                 if p.stem != "__init__")


def _imports(path: pathlib.Path) -> set[str]:
    """The package modules a file imports (relative imports resolved), at any depth."""
    here = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(here[:len(here) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("ditron_inductor")}


# One fresh interpreter imports each module with none of the package's modules loaded before it
# (torch, which every module needs, is imported once): a module that works only after another
# was imported fails here.
_IMPORT_EACH = """
import importlib, json, sys, traceback
import torch
errors = {}
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n.split(".")[0] == "ditron_inductor"]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception:
        errors[module] = traceback.format_exc()[-2000:]
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def import_errors() -> dict:
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *MODULES], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_alone(module, import_errors):
    assert module not in import_errors, import_errors.get(module)


DECISIONS = ("candidates", "choose", "decide", "evidence", "link_model", "policy")


def test_the_runtime_needs_neither_ops_nor_the_scheduler_s_decisions():
    for path in (PACKAGE / "runtime").glob("*.py"):
        imported = _imports(path)
        assert "ditron_inductor.ops" not in imported, path.name
        assert not imported & {f"ditron_inductor.scheduler.{m}" for m in DECISIONS}, path.name


def test_lowering_builds_tasks_through_the_scheduler():
    for path in (PACKAGE / "lowering").glob("*.py"):
        text = path.read_text()
        assert "ops.all_gather_matmul_task" not in text and "ops.matmul_collective_task" not in text


def test_modules_share_public_names_only():
    for layer in ("runtime", "scheduler", "lowering"):
        for path in (PACKAGE / layer).glob("*.py"):
            private = [m for m in _imports(path) if m.rsplit(".", 1)[-1].startswith("_")
                       and not m.endswith("__init__")]
            assert private == [], (path.name, private)


def test_config_is_the_lowest_layer():
    # the options (imported by every layer) import no layer above them
    above = ("ditron_inductor.scheduler", "ditron_inductor.lowering", "ditron_inductor.runtime",
             "ditron_inductor.ops", "ditron_inductor.templates")
    imported = _imports(PACKAGE / "config.py")
    assert "ditron_inductor.patterns" in imported
    assert not [m for m in imported if m.startswith(above)], imported
