"""benchmarks/bench_power.py without GPUs: the nvidia-smi samples it reads."""

import math

import pytest

from benchmarks.bench_power import parse_samples, shape_arg


def test_clock_and_power_medians_from_nvidia_smi_lines():
    text = "1980, 690.51\n1755, 700.02\n[N/A], [N/A]\n1830, 695.00\n\n"
    assert parse_samples(text) == {"sm_mhz": 1830.0, "power_w": 695.0, "samples": 3}
    empty = parse_samples("")
    assert empty["samples"] == 0 and math.isnan(empty["sm_mhz"]) and math.isnan(empty["power_w"])


def test_torchrun_passes_the_shape_option_to_the_script():
    """torchrun reads a script option that abbreviates its own (--n: --nnodes, ...) as its own
    and exits: the shape travels as --shape, which torchrun leaves to the script."""
    from torch.distributed.run import get_args_parser

    script = ["benchmarks/bench_power.py", "--shape", "8192,4096,7168", "--out", "x"]
    args = get_args_parser().parse_args(["--nproc-per-node", "2", *script])
    assert [args.training_script, *args.training_script_args] == script
    with pytest.raises(SystemExit):  # what the old --n did
        get_args_parser().parse_args(["--nproc-per-node", "2", script[0], "--n", "7168"])
    assert shape_arg("8192,4096,7168") == (8192, 4096, 7168)
