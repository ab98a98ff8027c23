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


def test_after_a_wait_gave_up_the_exit_releases_nothing_and_ends_non_zero(monkeypatch):
    from ditron_inductor.runtime import faults

    ended, released = [], []
    monkeypatch.setattr(faults, "end", lambda: ended.append(faults.EXIT_CODE))
    monkeypatch.setattr(clean_exit, "_runtime_shutdown", lambda: released.append(1))
    faults.report()[0] = 1  # a kernel's give_up writes the code word last
    clean_exit.release_at_exit()
    assert ended == [faults.EXIT_CODE] and released == []
    faults.report().zero_()
    ended.clear()
    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
    monkeypatch.setattr(clean_exit, "_destroy_process_groups", lambda: None)
    clean_exit.release_at_exit()  # no fault: the releases run
    assert ended == [] and released == [1]
