"""The default group's destroy_process_group() releases the CUDA graphs first (NCCL's finalize
waits for graphs that captured its collectives); other groups' destroys do not."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_inductor import clean_exit


def test_destroying_the_world_releases_the_cuda_graphs_first(monkeypatch):
    clean_exit.install()  # what the first compile does
    events = []
    monkeypatch.setattr(clean_exit, "release_cuda_graphs",
                        lambda: events.append(("release", dist.is_initialized())))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        dist.destroy_process_group(sub)
        assert events == []  # a subgroup's destroy leaves the graphs
    finally:
        dist.destroy_process_group()
    assert events == [("release", True)]  # before the group went
    assert not dist.is_initialized()


def test_release_without_cuda_leaves_the_compiled_graphs(monkeypatch):
    resets = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    clean_exit.release_cuda_graphs()
    assert resets == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    clean_exit.release_cuda_graphs()
    assert resets == [1]
