"""What TORCH_LOGS=ditron shows at INFO: a line per candidate with the model layer it comes from,
a summary line per graph (also for a graph with nothing to fuse), from rank 0 only unless asked."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch
import torch.nn as nn

from ditron_inductor.log_names import LOGGER_NAME
from tests.fx_helpers import all_gather, all_reduce, fake_group


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(8, 16, bias=False)
        self.down_proj = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = self.up_proj(all_gather(x, 0, "0"))
        return all_reduce(self.down_proj(h), "sum", "0")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x):
        return self.mlp(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer()])

    def forward(self, x):
        return self.layers[0](x)


@contextlib.contextmanager
def captured(level=logging.INFO):
    """The ditron logger's lines, with each graph's compile id replaced by `N`."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(
        re.sub(r"^graph \S+ (forward|backward)", r"graph N \1", record.getMessage()))
    logger = logging.getLogger(LOGGER_NAME)
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def compile_and_run(fn, *args, options=None):
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend="ditron", options=options)(*args)


def test_each_candidate_names_its_layer_and_each_graph_gets_a_summary():
    with fake_group(2), captured() as lines:
        compile_and_run(Model(), torch.randn(4, 8))
    assert lines == [
        "graph N forward: layers.0.mlp.up_proj: all_gather_matmul M=8 K=8 N=16 float32 world=2 "
        "group=0 -> ditron.all_gather_matmul [reference plan (decomposed collective + matmul)]",
        "graph N forward: layers.0.mlp.down_proj: matmul_all_reduce M=8 K=16 N=8 float32 world=2 "
        "group=0 sum -> ditron.matmul_all_reduce [reference plan (decomposed collective + matmul)]",
        "graph N forward: 2 candidate(s): 2 fused (all_gather_matmul 1, matmul_all_reduce 1), "
        "0 left; 2 collective(s): 2 fused, 0 left",
    ]


def test_a_candidate_left_alone_is_counted_as_left():
    with fake_group(2), captured() as lines:
        compile_and_run(Model(), torch.randn(4, 8),
                        options={"ditron.patterns": "matmul_all_reduce"})
    assert lines[-1] == ("graph N forward: 2 candidate(s): 1 fused (matmul_all_reduce 1), "
                         "1 left (all_gather_matmul 1); 2 collective(s): 1 fused, 1 left "
                         "(1 in candidates not fused)")
    assert lines[0].startswith("graph N forward: layers.0.mlp.up_proj: all_gather_matmul ")
    assert lines[0].endswith(" not fused: pattern all_gather_matmul is disabled "
                             "(ditron.patterns / DITRON_PATTERNS)")


def test_a_graph_with_no_candidate_says_the_backend_ran():
    with captured() as lines:
        compile_and_run(lambda x: torch.relu(x @ x), torch.randn(4, 4))
    assert lines == ["graph N forward: no collective + matmul candidates"]


def test_info_from_rank_zero_only_unless_all_ranks_are_asked_for():
    def lines_of_rank_1(level=logging.INFO, options=None):
        with fake_group(2, rank=1), captured(level) as lines:
            compile_and_run(Model(), torch.randn(4, 8), options=options)
        return [line for line in lines if "candidate(s)" in line]

    assert lines_of_rank_1() == []
    assert len(lines_of_rank_1(options={"ditron.log_all_ranks": True})) == 1
    assert len(lines_of_rank_1(level=logging.DEBUG)) == 1  # TORCH_LOGS=+ditron


@pytest.mark.parametrize("path", ["L['self'].model.layers[0].mlp.down_proj",
                                  "L['args'][0].model.layers[0].mlp.down_proj",
                                  "L['self']._modules['model'].layers[0].mlp.down_proj"])
def test_a_layer_is_named_by_its_module_path_whatever_the_frame_calls_the_model(path):
    from types import SimpleNamespace

    from ditron_inductor.lowering.graph_pass import source_layer

    node = SimpleNamespace(meta={"nn_module_stack": {"down": (path, torch.nn.Linear)}})
    assert source_layer(node) == "model.layers.0.mlp.down_proj"


HOST_FRAMEWORK = r'''
import logging, sys
import torch
# a framework's root handler (torchtitan configures one), installed before ditron is imported
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="root: %(message)s")

def compile_and_run(**kw):
    torch._dynamo.reset()
    torch.compile(lambda x: torch.relu(x @ x), **kw)(torch.randn(4, 4))

compile_and_run(backend="ditron")  # under TORCH_LOGS=ditron, read at torch's import
logging.getLogger("ditron").warning("a warning from ditron")
torch._logging.set_logs(modules={"ditron": logging.INFO})  # as a program may, later
import ditron_inductor
with ditron_inductor.installed():
    compile_and_run(backend="inductor")
'''


NO_TORCH_LOGS = r'''
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="root: %(message)s")
import torch
import ditron_inductor.log_names
logging.getLogger("ditron").info("an info line from ditron")
logging.getLogger("ditron").warning("a warning from ditron")
'''


@pytest.mark.parametrize("torch_logs", ["ditron", ""])
def test_one_line_per_message_whoever_configures_the_root_logger(torch_logs):
    import os
    import subprocess
    import sys

    from tests import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    if torch_logs:
        env["TORCH_LOGS"] = torch_logs
    proc = subprocess.run([sys.executable, "-c", HOST_FRAMEWORK if torch_logs else NO_TORCH_LOGS],
                          capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    # torch's handler (with no TORCH_LOGS, Python's last resort for a warning) prints to stderr,
    # the root handler to stdout: each message once; the root's INFO level does not turn
    # ditron's INFO lines on
    assert proc.stderr.count("a warning from ditron") == 1, proc.stderr
    assert "root:" not in proc.stdout, proc.stdout
    if torch_logs:
        assert proc.stderr.count("no collective + matmul candidates") == 2, proc.stderr
    else:
        assert "an info line from ditron" not in proc.stderr, proc.stderr
