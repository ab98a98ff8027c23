"""The calibration (ditron_inductor/calibrate.py) and the evidence order it feeds
(scheduler/evidence.py): on 2 CPU ranks over gloo, one launch, the command end to end on the
reference plans (the file, reading it back, the ranks' agreement, the fallback where a rank's
cache differs or a rank never comes, the uncalibrated warning on rank 0 only); in one process
the cache key, the file's merge, --show, the order the tables are read in and the margin where
none fits the card. Every cache lies under a temporary XDG_CACHE_HOME."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time

import pytest
import torch

from ditron_inductor import calibrate, config
from ditron_inductor.lowering.graph_pass import DitronPass
from ditron_inductor.scheduler import calibration, choose, evidence, policy
from ditron_inductor.scheduler.decide import decide
from ditron_inductor.scheduler.task import ALL_GATHER_MATMUL, MATMUL_ALL_REDUCE_RMSNORM, Task
from tests.distributed import launched_once
from tests.fx_helpers import fake_group

CACHE = tempfile.mkdtemp(prefix="ditron-calibrate-")
L40S = dict(gpu="NVIDIA L40S", sms=142, memory_gib=45, peers="2 GPUs, peer access none",
            driver="550.54", torch=torch.__version__, triton="3.6.0", ditron="0.1.0")


def _ag(m, k, n, world=2) -> Task:
    return Task(op=ALL_GATHER_MATMUL, group_name="0", world_size=world, m=m, k=k, ns=(n,),
                dtype=torch.bfloat16, device_type="cuda", dim_size=m)


def _warnings(records: list) -> logging.Handler:
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("ditron").addHandler(handler)
    return handler


def _on_two_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from benchmarks.llama_sites import sites

    out = {}
    calibrate.main(["--device", "cpu", "--sites", "tiny", "--tokens", "64", "--budget", "0.1"])
    task = sites("tiny", 2, "train", 64)[0].task  # q/k/v's gather, as a CUDA graph has it
    out["file"] = json.loads(calibration.calibration_path().read_text())  # rank 0 wrote it
    out["digest"], out["agreed"] = calibration.local().digest, calibration.agreed()
    out["why"] = choose.choose_device_plan(task)[1]

    # rank 1's cache differs (another directory, no calibration): both ranks keep NCCL
    home = os.environ["XDG_CACHE_HOME"]
    os.environ["XDG_CACHE_HOME"] = home + ("-other" if rank else "")
    evidence.clear_caches()
    start = time.monotonic()
    out["differ"] = calibration.agreed(), choose.choose_device_plan(task), time.monotonic() - start
    out["forced"] = decide(task, config.Options(force_plan="fused")).fuse
    os.environ["XDG_CACHE_HOME"] = home

    # rank 1 does not come to this round in time: rank 0 gives up after the bound, and rank 1,
    # later, takes the verdict rank 0 left
    calibration.AGREE_TIMEOUT_S = 2.0
    evidence.clear_caches()
    if rank == 0:
        start = time.monotonic()
        out["absent"] = calibration.agreed(), time.monotonic() - start
    dist.barrier()
    if rank == 1:
        out["late"] = calibration.agreed()

    # a card of neither the calibration nor the shipped tables: rank 0 says so, once
    calibration.machine = lambda: L40S
    evidence.clear_caches()
    records: list = []
    handler = _warnings(records)
    out["uncalibrated"] = [choose.choose_device_plan(_ag(8192, 8192, 7168, 8))[1]
                           for _ in range(2)]
    logging.getLogger("ditron").removeHandler(handler)
    out["warnings"] = [r for r in records if "uncalibrated" in r]
    return out


ranks = launched_once("tests.test_calibrate:_on_two_ranks", 2, timeout_s=240,
                      env={"XDG_CACHE_HOME": CACHE})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory for this test; the evidence read anew before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    evidence.clear_caches()
    yield tmp_path
    monkeypatch.undo()
    evidence.clear_caches()


# ------------------------------------------------------------------------------ two ranks
def test_the_command_writes_one_file_every_rank_reads_back():
    zero, one = ranks()
    data = zero["file"]
    assert one["file"] == data and zero["digest"] == one["digest"] != "none"
    assert data["machine"] == calibration.machine() and data["sources"][0]["world"] == 2
    assert set(data["link"]["2"]) == {"nccl_ag_gbps", "nccl_rs_gbps", "nccl_ar_busbw_gbps",
                                      "nccl_latency_ms"}
    assert [size for size, _ in data["link_points"]["2"]["all_reduce"]] == [65536, 262144,
                                                                          1048576]
    # the AG/RS candidates timed on both ranks at the training sites, beside NCCL + cuBLAS, and
    # the GEMM + all-gather's at the prefill's gathered logits
    rows = data["measured_plans"]["rows"]
    assert {r["op"] for r in rows} == {"all_gather_matmul", "matmul_reduce_scatter",
                                       "matmul_all_gather"}
    assert all(r["world"] == 2 and "nccl_cublas" in r["ms"] and len(r["ms"]) > 2 for r in rows)
    # the world-1 compute of each plan family, the all-reduce + norm's among them
    families = {(r[0], r[1]) for r in data["world1_compute"]["rows"]}
    assert ("all_gather_matmul", "triton") in families and any(
        op == MATMUL_ALL_REDUCE_RMSNORM for op, _ in families)
    assert zero["agreed"] and one["agreed"]
    assert "(this machine's calibration, cpu, " in zero["why"]


def test_ranks_whose_evidence_differs_keep_nccl_everywhere_without_waiting():
    for rank in ranks():
        agreed, (plan, why), seconds = rank["differ"]
        assert not agreed and plan is None and "did not agree on the scheduler evidence" in why
        assert seconds < 10  # both came: no timeout
        assert rank["forced"] is False  # not even plan=fused forces a plan then


def test_a_rank_that_never_comes_is_a_bounded_wait_and_the_same_verdict():
    zero, one = ranks()
    agreed, seconds = zero["absent"]
    assert not agreed and 1.5 < seconds < 10
    assert one["late"] is False


def test_an_uncalibrated_card_is_said_once_on_rank_zero_and_fuses_only_wide_gains():
    zero, one = ranks()
    assert len(zero["warnings"]) == 1 and "calibrate" in zero["warnings"][0]
    assert one["warnings"] == []
    for rank in (zero, one):
        assert all(why.startswith("no predicted gain") and "uncalibrated card: fused from 1.5x"
                   in why for why in rank["uncalibrated"])


def test_show_prints_what_the_cache_holds(capsys, monkeypatch):
    ranks()
    monkeypatch.setenv("XDG_CACHE_HOME", CACHE)
    evidence.clear_caches()
    calibrate.main(["--show"])
    evidence.clear_caches()
    text = capsys.readouterr().out
    assert f"{calibration.calibration_path().name}  (this machine)" in text
    assert "on 2 rank(s): torchrun --nproc-per-node 2 -m ditron_inductor.calibrate" in text
    assert "link constants at 2 rank(s): nccl_ag_gbps=" in text
    assert "the scheduler reads this machine's calibration, then the shipped tables" in text


# ------------------------------------------------------------------------------ one process
def test_the_cache_is_keyed_by_what_makes_it_valid(cache, monkeypatch):
    path = calibration.calibration_path()
    assert path.parent == cache / "ditron_inductor" / "calibration"
    assert path.name.startswith("cpu-") and path.suffix == ".json"
    assert set(calibration.machine()) == set(L40S)
    names = {calibration.calibration_path(dict(L40S, **{key: "other"})).name for key in L40S}
    assert len(names) == len(L40S) and calibration.calibration_path(L40S).name not in names
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(calibration.cache_dir()).startswith(os.path.expanduser("~/.cache/"))


def test_a_later_run_replaces_its_rows_and_keeps_the_others(tmp_path):
    def run(ms, date):
        source = dict(machine="cpu", date=date, command="c")
        return dict(machine={}, sources=[dict(source, world=2)], link={"2": {"x": ms}},
                    link_points={}, world1_compute=dict(sources=[source], rows=[
                        ["all_gather_matmul", "cublas", "eager", 64, 64, 64 * ms, ms, 1.0]]),
                    measured_plans=dict(sources=[source], rows=[dict(
                        op="all_gather_matmul", world=2, dtype="bfloat16", m=64, k=64, n=64,
                        source=0, ms=dict(nccl_cublas=ms))]))
    merged = calibrate.merge(run(1.0, "first"), run(2.0, "second"))
    assert [s["date"] for s in merged["sources"]] == ["first", "second"]
    assert [r[-2] for r in merged["world1_compute"]["rows"]] == [1.0, 2.0]  # two shapes
    (row,) = merged["measured_plans"]["rows"]  # one shape: the later run's
    assert row["ms"] == {"nccl_cublas": 2.0} and row["source"] == 1
    assert merged["link"] == {"2": {"x": 2.0}}
    calibrate._write(tmp_path / "c.json", merged)
    text = (tmp_path / "c.json").read_text()
    assert json.loads(text) == merged
    assert '["all_gather_matmul", "cublas", "eager", 64, 64, 64.0, 1.0, 1.0]' in text


def test_the_link_constants_measured_on_several_ranks_go_into_link_json(tmp_path, monkeypatch):
    """calibration_check --export: a world size link.json has takes the measured constants over
    its own, the earlier provenance kept; one it lacks is added over the nearest's; the world-1
    GEMM rate goes with them; a world-1 run leaves the file as it is."""
    from benchmarks import calibration_check

    path = tmp_path / "link.json"
    path.write_text(evidence.LINK.read_text())
    shipped = evidence.link_calibrations()
    shipped_4 = next(e for e in json.loads(path.read_text())["calibrations"] if e["world"] == 4)

    def run(link, *worlds):
        return dict(link=link, sources=[dict(machine="GPU", date=f"day {w}", command=f"run {w}",
                                             world=w) for w in worlds])
    calibration_check.export_link(run({"1": {"cublas_tflops": 500.0}}, 1), path)
    assert json.loads(path.read_text()) == json.loads(evidence.LINK.read_text())
    calibration_check.export_link(run({"1": {"cublas_tflops": 500.0},
                                       "2": {"nccl_ag_gbps": 100.0}, "4": {"nccl_rs_gbps": 200.0}},
                                      1, 2, 4), path)
    monkeypatch.setattr(evidence, "LINK", path)
    evidence.clear_caches()
    try:
        got = evidence.link_calibrations()
        assert got[4] == {**shipped[4], "cublas_tflops": 500.0, "nccl_rs_gbps": 200.0}
        assert got[2] == {**got[4], "nccl_ag_gbps": 100.0}  # over the nearest, 4
        assert got[8] == shipped[8]
        entries = {e["world"]: e for e in json.loads(path.read_text())["calibrations"]}
        assert entries[4]["provenance"] == dict(machine="GPU", date="day 4", command="run 4")
        assert entries[4]["earlier"] == [shipped_4["provenance"]] and entries[2]["base"] == 4
    finally:
        monkeypatch.undo()
        evidence.clear_caches()


def _calibration(measured=(), world1=(), link=None) -> None:
    """This machine's calibration file with these rows."""
    source = dict(machine="cpu", date="today", command="test")
    path = calibration.calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(
        machine=calibration.machine(), sources=[dict(source, world=2)], link=link or {},
        world1_compute=dict(sources=[source], rows=list(world1)),
        measured_plans=dict(sources=[source], rows=list(measured)))))
    evidence.clear_caches()


GATE_UP = (8192, 4096, 14336)  # measured on 2x H200: fused 1.290 ms, NCCL + cuBLAS 1.393 ms


def test_the_calibration_is_read_before_the_shipped_tables(cache):
    plan, why = choose.choose_device_plan(_ag(*GATE_UP))
    assert plan.label == "cublas_each_first_ready_beside"
    assert "(NVIDIA H200, " in why and why.endswith("; shipped table")
    _calibration([dict(op="all_gather_matmul", world=2, dtype="bfloat16", m=8192, k=4096,
                       n=14336, source=0, ms=dict(nccl_cublas=1.0, cublas_1_3_4=1.2))])
    plan, why = choose.choose_device_plan(_ag(*GATE_UP))
    assert plan is None
    assert why == ("no measured gain: measured on 2 ranks at 8192x4096x14336 (this machine's "
                   "calibration, cpu, today): NCCL+cuBLAS 1.000 ms, fastest fused cublas_1_3_4 "
                   "1.200 ms")
    # a shape the calibration did not measure: the shipped row, as before
    assert "(NVIDIA H200, " in choose.choose_device_plan(_ag(8192, 4096, 3072))[1]


def test_a_calibration_on_several_gpus_decides_the_gemm_all_gather(cache):
    """The shipped tables hold no row of it: the graph keeps cuBLAS + NCCL until a calibration
    measured a candidate MEASURED_MIN_GAIN faster near the shape, which is then chosen."""
    head = calibrate.llama_sites("8b", 2, "prefill", 8192)[-1].task  # lm_head's logits gather
    assert head.describe() == ("matmul_all_gather M=8192 K=4096 N=64128 bfloat16 world=2 "
                               "group=0 dim=2")
    plan, why = choose.choose_device_plan(head)
    assert plan is None and "has no measured row near this shape on 2 ranks" in why
    row = dict(op="matmul_all_gather", world=2, dtype="bfloat16", m=8192, k=4096, n=64128,
               source=0, ms=dict(nccl_cublas=7.0, cublas_chunks_1=6.9, cublas_chunks_4=6.5))
    _calibration([row])
    plan, why = choose.choose_device_plan(head)
    assert plan.label == "cublas_chunks_4" and plan.chunks == 4
    assert why.startswith("fused plan cublas_chunks_4: measured on 2 ranks at 8192x4096x64128 "
                          "(this machine's calibration")
    _calibration([dict(row, ms=dict(nccl_cublas=7.0, cublas_chunks_4=6.95))])
    plan, why = choose.choose_device_plan(head)
    assert plan is None and why.startswith("no measured gain: ")
    # replayed from a CUDA graph: the op runs eagerly only
    assert "replayed from a CUDA graph" in choose.choose_device_plan(head, cuda_graphs=True)[1]


def test_the_experts_all_reduce_is_decided_from_its_world1_rows(cache):
    """The grouped-GEMM op: the shipped rows (its copy in, measured on one GPU) price it at
    Mixtral's width; where no row of it is near (the GEMM ops' rows do not stand for it),
    cuBLAS + NCCL; a calibration's rows then price it as the all-reduce ops are priced."""
    site = calibrate.experts_site(4096, 2, "decode", 16, graphs=True)
    assert (site.name, site.task.describe()) == (
        "experts all-reduce + norm", "grouped_mm_all_reduce_rmsnorm M=16 N=4096 bfloat16 "
        "world=2 group=0 sum")
    plan, why = choose.choose_device_plan(site.task, cuda_graphs=True)
    assert plan.algo == "lamport_all" and "compute from the shipped table" in why
    wide = calibrate.experts_site(16384, 2, "decode", 16, graphs=True).task
    plan, why = choose.choose_device_plan(wide, cuda_graphs=True)
    assert plan is None and why.startswith(
        "no world-1 measurement of grouped_mm_all_reduce_rmsnorm near this shape")
    row = [wide.op, "lamport_all", "graph", 16, 1, 16384, 0.012, 0.008]
    _calibration(world1=[row], link={"2": dict(nccl_ar_busbw_gbps=300.0, nccl_latency_ms=0.02)})
    plan, why = choose.choose_device_plan(wide, cuda_graphs=True)
    assert plan.algo == "lamport_all" and plan.gemm == "cublas"
    assert "compute 0.012 measured" in why and "compute 0.008 measured" in why
    _calibration(world1=[row], link={"2": dict(nccl_ar_busbw_gbps=300.0, nccl_latency_ms=0.0)})
    plan, why = choose.choose_device_plan(wide, cuda_graphs=True)
    assert plan is None and why.startswith("no predicted gain")
    # prefill, eagerly, past push's rows: no GEMM to push beside
    plan, why = choose.choose_device_plan(calibrate.experts_site(4096, 2, "prefill", 1024).task)
    assert plan is None and "has no GEMM to push beside" in why


def test_the_calibrations_world1_compute_and_link_are_read_first(cache):
    from benchmarks.llama_sites import sites

    site = sites("8b", 2, "prefill", 4096, cuda_graphs=True)[1]  # down's all-reduce + norm
    plan, why = choose.choose_device_plan(site.task, cuda_graphs=True)
    assert plan is not None and "compute from the shipped table" in why
    row = [MATMUL_ALL_REDUCE_RMSNORM, "copy_engine", "graph", 4096, 7168, 4096, 9.0, 1.0]
    _calibration(world1=[row], link={"2": dict(nccl_ar_busbw_gbps=1e4, nccl_latency_ms=0.0)})
    plan, why = choose.choose_device_plan(site.task, cuda_graphs=True)
    assert plan is None and "compute 9.000 measured" in why
    assert f"compute from {calibration.CALIBRATION}, link model, {calibration.CALIBRATION} at 2 ranks"\
        in why


def test_a_card_of_neither_needs_the_wide_margin(cache, monkeypatch):
    wide, narrow = _ag(8192, 8192, 7168, 8), _ag(16384, 8192, 3584, 4)  # predicted 1.28x, 1.57x
    assert choose.choose_device_plan(wide)[0] is not None
    monkeypatch.setattr(calibration, "machine", lambda: L40S)
    evidence.clear_caches()
    records: list = []
    handler = _warnings(records)
    try:
        plan, why = choose.choose_device_plan(wide)
        assert plan is None and f"uncalibrated card: fused from {policy.UNCALIBRATED_MIN_GAIN}x" \
            in why
        assert choose.choose_device_plan(narrow)[0] is not None
        # the shipped rows and world-1 compute are not read for this card
        assert "measured on" not in choose.choose_device_plan(_ag(*GATE_UP))[1]
        assert [r for r in records if "uncalibrated" in r] == [records[0]]
        assert "torchrun --nproc-per-node W -m ditron_inductor.calibrate" in records[0]
        # its own calibration makes it calibrated: no more word of it
        _calibration(link={"8": dict(nccl_ag_gbps=320.0)})
        assert choose.choose_device_plan(wide)[0] is not None
        assert len(records) == 1
    finally:
        logging.getLogger("ditron").removeHandler(handler)


def test_agreement_is_the_first_verdict_on_every_rank():
    import torch.distributed as dist

    def ranks_of(digests, timeout_s=5.0, late=()):
        store, out = dist.HashStore(), {}

        def one(rank):
            if rank in late:
                time.sleep(timeout_s + 0.5)
            out[rank] = calibration.agree(store, rank, len(digests), digests[rank], timeout_s)
        threads = [threading.Thread(target=one, args=(r,)) for r in range(len(digests))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return [out[r] for r in range(len(digests))]
    assert ranks_of(["a", "a", "a"]) == ["same"] * 3
    assert ranks_of(["a", "b", "a"]) == ["differ"] * 3
    assert ranks_of(["a", "a", "a"], timeout_s=0.5, late=(1,)) == ["late 1"] * 3


def test_the_pass_cache_key_carries_the_calibration(cache):
    before = DitronPass().uuid()
    _calibration()
    assert DitronPass().uuid() != before
    with fake_group(2):
        decision = decide(_ag(*GATE_UP))  # an empty calibration: the shipped rows decide
        assert decision.fuse and "(NVIDIA H200, " in decision.reason


def test_sites_from_a_saved_log(tmp_path):
    log = tmp_path / "ditron.log"
    log.write_text(
        "I1202 graph 0/0 forward: layers.0.attn.q_proj: all_gather_matmul M=8192 K=4096 "
        "N=2048,512,512 bfloat16 world=2 group=0 -> ditron.all_gather_matmul [fused plan x]\n"
        "I1202 graph 0/1 backward: layers.0.mlp.up_proj: matmul_reduce_scatter M=8192 K=14336 "
        "N=4096 bfloat16 world=2 group=0 dim=1 sum, 2 matmul products summed not fused: no\n"
        "I1202 graph 0/1 backward: layers.0.mlp.up_proj: matmul_reduce_scatter M=8192 K=14336 "
        "N=4096 bfloat16 world=2 group=0 dim=1 sum, 2 matmul products summed not fused: no\n"
        "I1202 graph 0/2 forward: layers.0.mlp.experts: grouped_mm_all_reduce_rmsnorm M=16 "
        "N=2048 bfloat16 world=4 group=0 sum not fused: no\n"
        "I1202 graph 0/0 forward: 3 candidate(s): 1 fused\n")
    ag, rs, experts = calibrate.sites_of(str(log), 0, 0)
    assert (experts.task.op, experts.task.m, experts.task.k, experts.task.ns) == (
        "grouped_mm_all_reduce_rmsnorm", 16, 1, (2048,))
    assert (ag.name, ag.task.ns, ag.task.world_size, ag.transposed) == (
        "layers.0.attn.q_proj", (2048, 512, 512), 2, True)
    assert (rs.task.k, rs.task.terms, rs.task.dim, rs.term_ks, rs.transposed) == (
        14336, 2, 1, (7168, 7168), False)
