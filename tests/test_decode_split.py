"""`benchmarks/e2e_decode.py --profile-device N`'s split of a decode step's device time (GEMV/GEMM,
attention, collectives, small ops, idle; `e2e_llama.step_split`) on made-up kernels: no GPU, no
profiler run. On CPU the option is refused (no CUDA kernels to profile)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from benchmarks import e2e_decode, e2e_llama


@pytest.mark.parametrize("name, part", [
    # the decode GEMM template, cuBLAS (gemv, nvjet, its split-K reduction), Triton matmul
    ("gemv_kernel", "gemm"), ("gemv_group_kernel", "gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4>",
     "gemm"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    # the decode attention template, SDPA's kernels
    ("decode_attention_split_kernel", "attention"),
    ("decode_attention_combine_kernel", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
     "attention"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0", "attention"),
    # NCCL, ditron's all-reduces (with their residual and RMSNorm) and copy-engine sums
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("lamport_kernel", "collectives"), ("lamport_all_kernel", "collectives"),
    ("push_kernel", "collectives"), ("sum_slots_norm_kernel", "collectives"),
    # the rest: Inductor's fused kernels, copies, ATen's elementwise and reductions
    ("triton_poi_fused_add_mul_0", "small"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "small"),
    ("triton_per_fused_add_mean_2", "small"), ("Memcpy DtoD (Device -> Device)", "small"),
    ("Memset (Device)", "small"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "small"),
])
def test_each_kernel_takes_its_part(name, part):
    assert e2e_llama.step_part(name) == part


def test_every_ditron_template_module_has_a_part():
    # a new template module must say where its kernels go (else step_part raises on them)
    modules = set(e2e_llama.ditron_kernels().values())
    assert "gemv" in modules and "all_reduce_lamport" in modules, modules
    assert set(e2e_llama.DITRON_PARTS) == modules
    assert set(e2e_llama.DITRON_PARTS.values()) | set(e2e_llama.KIND_PARTS.values()) == set(
        e2e_llama.STEP_PARTS[:-1])
    assert set(e2e_llama.KIND_PARTS) == set(e2e_llama.PROFILE_KINDS) - {"ditron"}


# (start, end, name) in us over 2 steps: a GEMV with a small kernel inside it (another stream),
# a norm after it, attention overlapping a copy, an all-reduce, a gap, a cuBLAS GEMM
SPANS = [(0, 1000, "gemv_kernel"), (100, 300, "triton_poi_fused_add_0"),
         (1000, 1500, "triton_red_fused_rms_0"), (2000, 2600, "decode_attention_split_kernel"),
         (2400, 2800, "Memcpy DtoD (Device -> Device)"), (3000, 3400, "lamport_kernel"),
         (5000, 6000, "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT")]


def test_split_idle_is_the_span_less_the_union_of_kernels():
    split = e2e_llama.step_split(SPANS, calls=2)
    # busy: [0, 1500] + [2000, 2800] + [3000, 3400] + [5000, 6000] = 3700 us, the kernel inside
    # the GEMV and the copy beside attention counted once
    assert split == pytest.approx({
        "gemm": 1.0, "attention": 0.3, "collectives": 0.2, "small": 0.55, "span": 3.0,
        "busy": 1.85, "idle": 1.15, "overlap": 0.2})
    parts = sum(split[p] for p in e2e_llama.STEP_PARTS)
    assert parts - split["overlap"] == pytest.approx(split["span"])
    shuffled = random.Random(0).sample(SPANS, len(SPANS))  # the profiler's order is no order
    assert e2e_llama.step_split(shuffled, calls=2) == pytest.approx(split)
    assert e2e_llama.step_split([], calls=3) == dict.fromkeys(split, 0.0)


def _events():
    """The profiler's events of SPANS: kernels, a host op and a record_function range that the
    device's timeline shows too (not a kernel: it would cover the idle time)."""
    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               device_time_total=end - start,
                               time_range=SimpleNamespace(start=start, end=end))
    return [event(name, start, end) for start, end, name in SPANS] + [
        event("aten::mm", 0, 100, device=DeviceType.CPU),
        event("## decode step ##", 0, 6000, annotation=True)]


def test_kernel_times_carry_the_split():
    times = e2e_llama.kernel_times(_events(), calls=2)
    assert times["split"] == pytest.approx(e2e_llama.step_split(SPANS, calls=2))
    assert (times["span"], times["busy"]) == (times["split"]["span"], times["split"]["busy"])
    assert times["idle"] == pytest.approx(times["split"]["idle"])  # the gaps sum to it


def _row(**extra) -> dict:
    return {"batch": 16, "prompt": 512, "new_tokens": 64, "params": "local",
            "contender": "ditron", "bare_ms": 3.25, **extra}


def test_split_table_columns():
    profile = {"split": e2e_llama.step_split(SPANS, calls=2)}
    lines = e2e_decode.split_table([_row(device_profile=profile), _row(contender="eager")],
                                   5).splitlines()
    assert lines[0].startswith("Device time per decode step by part (torch profiler over 5 bare "
                               "steps, rank 0; share: of the span")
    assert lines[2] == ("| B | prompt | new | params | contender | bare step ms | span ms | "
                        "GEMV/GEMM ms (share) | attention ms (share) | collectives ms (share) | "
                        "small ops ms (share) | idle ms (share) | overlap ms |")
    # one row: the one without a profile left out
    assert lines[4:] == ["| 16 | 512 | 64 | local | ditron | 3.250 | 3.000 | 1.000 (33%) | "
                         "0.300 (10%) | 0.200 (7%) | 0.550 (18%) | 1.150 (38%) | 0.200 |"]
    empty = {"split": e2e_llama.step_split([], calls=2)}  # no kernels: no shares
    assert e2e_decode.split_table([_row(device_profile=empty)], 5).splitlines()[4] == (
        "| 16 | 512 | 64 | local | ditron | 3.250 | 0.000 | 0.000 | 0.000 | 0.000 | 0.000 | "
        "0.000 | 0.000 |")


def test_report_prints_the_split_and_writes_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e_decode.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    row = _row(failed=None, tokens_per_s=4000.0, step_ms=4.0, step_p99_ms=5.0, step_host_ms=4.0,
               bare_host_ms=0.4, prefill_ms=110.0, graphs_first_call=1, graphs_later_calls=0,
               calls_unlike_first=0, device_profile=e2e_llama.kernel_times(_events(), calls=2))
    out = tmp_path / "split.json"
    e2e_decode.report({"rows": [row], "ditron_log": [], "world": 1},
                      ["--profile-device", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "Device time per call by kernel kind (torch profiler, 2 calls" in text
    assert ("| 16 | 512 | 64 | local | ditron | 3.250 | 3.000 | 1.000 (33%) | 0.300 (10%) | "
            "0.200 (7%) | 0.550 (18%) | 1.150 (38%) | 0.200 |") in text
    # the main table still last
    assert text.index("Device time per decode step by part") < text.index("## Llama decode")
    (written,) = json.loads(out.read_text())["rows"]
    assert written["device_profile"]["split"] == pytest.approx(
        e2e_llama.step_split(SPANS, calls=2))


def test_profile_device_is_off_by_default_and_refused_on_cpu(capsys):
    assert e2e_decode.parse_args(["--device", "cpu"]).profile_device == 0
    assert e2e_decode.parse_args(["--profile-device", "8"]).profile_device == 8  # CUDA: taken
    with pytest.raises(SystemExit):
        e2e_decode.parse_args(["--device", "cpu", "--tiny", "--profile-device", "2"])
    assert "--profile-device: CUDA kernels only (--device cuda)" in capsys.readouterr().err
