"""benchmarks/bench_ep_local_work.py on CPU (the Triton interpreter): one tiny layer on rank 0 of
EP 2, each contender (the unfused path, the fused plan's runtime steps on the emulated rank, each
stage alone) checked against the reference before it is timed, the table with its columns; and
an emulation whose rows never land (a skipped push) is refused."""

import json

import pytest

from benchmarks import bench_ep_local_work as bench

ARGS = ["--device", "cpu", "--tiny", "--worlds", "2", "--tokens", "13", "--iters", "1",
        "--reps", "1", "--warmup", "1"]


def test_every_contender_is_checked_timed_and_tabled(tmp_path):
    bench.main(ARGS + ["--out", str(tmp_path / "ep")])
    result = json.loads((tmp_path / "ep.json").read_text())
    assert result["meta"]["machine"].startswith("CPU")
    (row,) = result["rows"]
    names = {"unfused", "common", "fused:tiny", "unfused dispatch", "fused:tiny dispatch",
             "unfused combine", "fused:tiny combine"}
    assert set(row["ms"]) == names and set(row["rel_err"]) == names
    assert all(row["ms"][n] > 0 and row["rel_err"][n] < 2e-2 for n in names), row
    assert row["rows_sent"] == 26 and row["own_rows"] <= 26
    text = (tmp_path / "ep.md").read_text()
    assert "| " + " | ".join(bench.HEAD) + " |" in text
    assert "| tiny | 2 | 13 | 26 / " in text
    assert "- command: `python benchmarks/bench_ep_local_work.py --device cpu --tiny" in text


def test_inference_runs_the_fused_dispatch_without_its_rows_output(tmp_path, monkeypatch):
    """... and a '/steps' plan signals by ctx.signal (stream writes), the others in the wait's
    launch."""
    streamed = []
    signal = bench.EmulatedRank.signal
    monkeypatch.setattr(bench.EmulatedRank, "signal",
                        lambda self, *a: streamed.append(
                            bench.moe_dispatch.signal_and_wait is bench.stream_signal_and_wait)
                        or signal(self, *a))
    bench.main(ARGS + ["--no-stages", "--inference", "--plans", "tiny,tiny/steps", "--out",
                       str(tmp_path / "ep")])
    (row,) = json.loads((tmp_path / "ep.json").read_text())["rows"]
    assert row["inference"] and row["rel_err"]["fused:tiny"] < 2e-2  # the rows checked too
    assert row["rel_err"]["fused:tiny/steps"] < 2e-2 and streamed and all(streamed)
    assert not bench.plans_of(bench.parse_args(ARGS + ["--inference"]))["tiny"].rows


@pytest.mark.parametrize("step", ["dispatch", "combine"])
def test_an_emulation_whose_rows_never_land_is_refused(monkeypatch, step):
    module = bench.moe_dispatch if step == "dispatch" else bench.moe_combine
    monkeypatch.setattr(module, "push", lambda *args, **kwargs: None)
    with pytest.raises(SystemExit, match="fused:tiny: the emulation computes something else"):
        bench.main(ARGS + ["--no-stages"])


def test_kernels_are_bucketed_by_name_then_by_their_step():
    assert bench.bucket_of("grouped_gemm_kernel", "fused_dispatch") == "gemm"
    assert bench.bucket_of("wait_flags_kernel", "fused_combine") == "flags"
    assert bench.bucket_of("put_rows_kernel", "fused_dispatch") == "copies"
    assert bench.bucket_of("publish_routes_kernel", "fused_dispatch") == "routing"
    assert bench.bucket_of("void at::native::reduce_kernel<...>", "sums") == "sums"
    assert bench.bucket_of("void at::native::vectorized_elementwise_kernel<FillFunctor>",
                           "fused_dispatch") == "routing"
    assert bench.bucket_of("wait_words_kernel", "fused_dispatch") == "flags"
    assert bench.bucket_of("Memcpy DtoD (Device -> Device)", "copies") == "copies"
    assert bench.bucket_of("void at::native::vectorized_elementwise_kernel<silu>", None) == "other"
