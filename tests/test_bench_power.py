"""benchmarks/bench_power.py without GPUs: the nvidia-smi samples it reads."""

import math

from benchmarks.bench_power import parse_samples


def test_clock_and_power_medians_from_nvidia_smi_lines():
    text = "1980, 690.51\n1755, 700.02\n[N/A], [N/A]\n1830, 695.00\n\n"
    assert parse_samples(text) == {"sm_mhz": 1830.0, "power_w": 695.0, "samples": 3}
    empty = parse_samples("")
    assert empty["samples"] == 0 and math.isnan(empty["sm_mhz"]) and math.isnan(empty["power_w"])
