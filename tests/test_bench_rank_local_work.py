"""benchmarks/bench_rank_local_work.py on CPU: every chosen plan's emulated local work computes the
site's products (checked before it is timed), and an emulation that leaves rows out is refused."""

import json

import pytest

from benchmarks import bench_rank_local_work as bench

ARGS = ["--device", "cpu", "--tiny", "--tp", "2", "--iters", "1", "--reps", "1"]


def test_every_chosen_plan_is_checked_and_timed(tmp_path):
    bench.main(ARGS + ["--out", str(tmp_path / "work")])
    rows = json.loads((tmp_path / "work.json").read_text())["rows"]
    chosen = [r for r in rows if r["label"] is not None]
    assert {r["op"] for r in chosen} == {"all_gather_matmul", "matmul_reduce_scatter"}
    for r in chosen:
        assert r["rel_err"] < 2e-2, r
        wanted = {"unfused", "gemms", "plan"}
        if r["op"] == "all_gather_matmul":
            wanted |= {"no_buffer", "two_gemms"}
        assert all(r[c] > 0 for c in wanted), r
    text = (tmp_path / "work.md").read_text()
    assert "| 8b | 2 | gate/up input-grad scatter |" in text
    assert "- 8b TP 2: plan - unfused per decoder layer" in text


def test_an_emulation_that_skips_the_peers_rows_is_refused(monkeypatch):
    # the all-gather's GEMMs of my own rows only: the peers' rows of the products stay NaN
    monkeypatch.setattr(bench, "chunk_groups", lambda order, sizes: [order[:1]])
    with pytest.raises(SystemExit, match="computes something else"):
        bench.main(ARGS)


def test_gemm_tiles_checks_each_tile_against_the_product(tmp_path):
    """bench_gemm_tiles (the Triton interpreter): every tile of a site is checked before it is
    timed, and the report names the best tile per site."""
    from benchmarks import bench_gemm_tiles

    tiles = "128x256x64_s3_w8_g8,128x128x64_s4_w8_g8"
    bench_gemm_tiles.main(["--device", "cpu", "--tiny", "--tp", "4", "--models", "8b", "--tiles",
                           tiles, "--iters", "1", "--reps", "1", "--out", str(tmp_path / "t")])
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    # the TP 4 all-gathers whose chosen plan runs the Triton GEMM
    from benchmarks.llama_sites import sites
    from ditron_inductor.scheduler.choose import choose_device_plan

    wanted = [s.name for s in sites("8b", 4, "train", 8192)
              if s.task.op == "all_gather_matmul"
              and getattr(choose_device_plan(s.task)[0], "gemm", None) == "triton"]
    assert wanted and [r["site"] for r in rows] == wanted
    assert all(set(r["ms"]) == {"cublas", *tiles.split(",")} for r in rows)
    # a forward site multiplies by the Linear weight's transpose, a backward one by the weight
    assert [r["b_transposed"] for r in rows] == ["grad" not in r["site"] for r in rows]
