"""This machine's calibration beside the shipped tables: each site's decision from both, and the
calibration's rows written into the shipped tables' files (the same measurements make both).

    python -m benchmarks.calibration_check --sites llama-8b --tp 2      # decisions, compared
    python -m benchmarks.calibration_check --export ditron_inductor/scheduler/evidence

Decisions: the scheduler's choice at every site of ditron_inductor.calibrate's --sites (the
training step's AG/RS sites at --tokens, prefill's and decode's all-reduce + norm sites, each
launched eagerly or from a CUDA graph as the site is), first with the evidence in the order the
scheduler reads it (this machine's calibration, then the shipped tables), then with the shipped
tables alone; each site that differs is printed with both reasons, whose figures (measured and
predicted ms of fused and NCCL + cuBLAS, and their source) say why. --export merges the
calibration's world-1 compute and measured AG/RS rows into world1_compute.json and
measured_plans.json in that directory: its rows replace those of the same key, its runs are
added to their sources; and the link constants it measured on several ranks into link.json
(`export_link`; the copy engine's and the fused kernels' own constants come from the benchmarks):
the shipped tables are made this way (bench_compute_parity.py and bench_fused.py time their
comparisons only).

--compile: what a compile names as its evidence, in one process on one GPU: a fake process group
of --tp ranks (its collectives move nothing) lets transformers' LlamaForCausalLM (--layers of
Llama-3-8B's on CUDA, of the tiny sizes on CPU) compile under the sequence-parallel TP plan (a
training step: forward and backward, the backward compiled at once) and the plain TP plan (a
prefill forward) with backend="ditron"'s pass; the compiled graphs are not run (ditron's ops need
peers that are there), the captured graphs run eagerly instead. It prints each candidate's line
the pass logged (TORCH_LOGS=ditron), how many name this machine's calibration, the shipped
tables or the link model; on CPU, whose compiles take the reference plan, then the scheduler's
decision for each candidate read back from those lines (calibrate's --sites from a log): what the
same graph decides on CUDA. The exit status is 1 where no candidate
was logged.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ditron_inductor import calibrate  # noqa: E402
from ditron_inductor.scheduler import calibration, evidence  # noqa: E402
from ditron_inductor.scheduler.choose import choose_device_plan  # noqa: E402


def decisions(sites) -> int:
    """Prints each site's decision from this machine's evidence and from the shipped tables
    alone; returns how many differ."""
    mine = [choose_device_plan(s.task, s.graphs) for s in sites]
    home = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory() as empty:  # no calibration: the shipped tables alone
        os.environ["XDG_CACHE_HOME"] = empty
        evidence.clear_caches()
        shipped = [choose_device_plan(s.task, s.graphs) for s in sites]
    os.environ.pop("XDG_CACHE_HOME") if home is None else os.environ.update(XDG_CACHE_HOME=home)
    evidence.clear_caches()
    differ = 0
    for site, (plan, why), (plan0, why0) in zip(sites, mine, shipped):
        same = (plan and plan.label) == (plan0 and plan0.label)
        differ += not same
        mode = "CUDA graph" if site.graphs else "eager"
        print(f"{'same' if same else 'DIFFERS'}: {site.name}, {site.task.describe()}, {mode}\n"
              f"  here:    {why}" + ("" if same else f"\n  shipped: {why0}"))
    print(f"{len(sites)} sites: {len(sites) - differ} decided as from the shipped tables alone, "
          f"{differ} otherwise (both reasons above)")
    return differ


def export(directory: str) -> None:
    data = json.loads(calibration.calibration_path().read_text())
    for table in ("world1_compute", "measured_plans"):
        path = pathlib.Path(directory) / f"{table}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        merged = calibrate.merge({table: old}, {table: data[table]})[table]
        calibrate._write(path, {"what": old.get("what", "written from a calibration"), **merged})
        print(f"{path}: {len(merged['rows'])} rows, {len(merged['sources'])} sources")
    export_link(data, pathlib.Path(directory) / "link.json")


def export_link(data: dict, path: pathlib.Path) -> None:
    """The link constants the calibration measured on several ranks (NCCL's bandwidths and
    latency, with its world-1 GEMM rate) into link.json's calibration of that world size: one
    there is updated (the constants it did not measure keep their values, the earlier provenance
    is kept), else one is added over the nearest world size's. The constants no calibration
    measures (the copy engine's, the fused kernels' own) stay as the benchmarks gave them."""
    worlds = sorted((int(w), c) for w, c in data.get("link", {}).items() if w != "1")
    if not worlds:
        print(f"{path}: unchanged (no link constants measured on several ranks)")
        return
    link = json.loads(path.read_text())
    entries = {e["world"]: e for e in link["calibrations"]}
    rate = data["link"].get("1", {})
    for world, measured in worlds:
        source = next(s for s in reversed(data["sources"]) if s["world"] == world)
        constants = {k: round(v, 4) for k, v in {**rate, **measured}.items()}
        provenance = {k: source[k] for k in ("machine", "date", "command")}
        entry = entries.get(world)
        if entry is None:
            base = min(entries, key=lambda w: (abs(w - world), -w))
            entry = entries[world] = dict(world=world, base=base, provenance=provenance,
                                          constants=constants)
            link["calibrations"].append(entry)
        else:
            earlier = entry.pop("earlier", []) + [entry["provenance"]]
            entry.update(provenance=provenance, earlier=earlier,
                         constants={**entry["constants"], **constants})
        print(f"{path}: {sorted(constants)} at {world} ranks")
    calibrate._write(path, link)


def compile_check(tp: int, layers: int) -> int:
    """--compile (the module's docs); returns how many candidate lines the compile logged."""
    import logging

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks import e2e_llama
    from ditron_inductor.backend import ditron_backend
    from ditron_inductor.log_names import LOGGER_NAME
    from tests import llama_tp

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    e2e_llama.local_collectives()  # the eager runs' collectives write finite values
    lines, logger = e2e_llama.Lines(), logging.getLogger(LOGGER_NAME)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)  # as TORCH_LOGS=ditron: every graph compiled, not cached
    d = calibrate.LLAMA["8b" if device == "cuda" else "tiny"]
    config = llama_tp.llama_config(d.hidden, d.intermediate, d.heads, d.kv_heads, layers, d.vocab)
    mesh = init_device_mesh(device, (tp,))

    def compile_only(gm, inputs):  # the pass decides and logs; the graph runs as captured
        ditron_backend(gm, inputs)
        return gm.forward

    def model(plan):
        return torch.compile(llama_tp.parallelize(llama_tp.build_llama(
            config, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device),
            plan, mesh), backend=compile_only, dynamic=False)
    rows = 8192 if device == "cuda" else 64
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        llama_tp.train_loss(model(llama_tp.SEQUENCE_PARALLEL), llama_tp.tokens(
            1, rows, config.vocab_size, seed=0, device=device))
        with torch.no_grad():
            model(llama_tp.TENSOR_PARALLEL)(llama_tp.tokens(1, rows // 2, config.vocab_size,
                                                           seed=1, device=device))
    logger.removeHandler(lines)
    found = [line for line in lines.lines if calibrate._LINE.search(line) and (
        " -> ditron." in line or " not fused: " in line)]  # a decision each, no notes
    named = {what: sum(what in line for line in found) for what in (
        calibration.CALIBRATION, "shipped table", "link model", "reference plan")}
    print(f"compiled on {device} (a fake group of {tp} ranks), {layers} layer(s):")
    for line in found:
        print(f"  {line}")
    print(f"{len(found)} candidate lines, {sum(' -> ditron.' in x for x in found)} fused; naming "
          + ", ".join(f"{what}: {n}" for what, n in named.items()))
    if device == "cuda":
        dist.destroy_process_group()
        return len(found)
    with tempfile.NamedTemporaryFile("w", suffix=".log") as log:
        log.write("\n".join(found))
        log.flush()
        sites = calibrate.sites_of(log.name, tp, [])
    print(f"the scheduler at these {len(sites)} sites, as on CUDA:")
    mine = 0
    for site in sites:
        why = choose_device_plan(site.task, site.graphs)[1]
        mine += calibration.CALIBRATION in why
        print(f"  {site.name}: {site.task.describe()}\n    {why}")
    print(f"{mine} of {len(sites)} decisions name {calibration.CALIBRATION}"
          f"{'' if calibration.calibration_path().exists() else ' (none here)'}")
    dist.destroy_process_group()
    return len(found)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", default="llama-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", default=[8192], type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--export", default="", help="merge the calibration into this directory's "
                    "shipped tables instead")
    ap.add_argument("--compile", action="store_true", help="what a compile names instead")
    ap.add_argument("--layers", type=int, default=2, help="--compile's decoder layers")
    args = ap.parse_args(argv)
    if args.export:
        return export(args.export)
    if args.compile:
        sys.exit(0 if compile_check(args.tp, args.layers) else 1)
    print(f"evidence: {calibration.calibration_path()}"
          f"{'' if calibration.calibration_path().exists() else ' (none)'}")
    decisions(calibrate.sites_of(args.sites, args.tp, args.tokens))


if __name__ == "__main__":
    main()
