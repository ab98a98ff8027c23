"""benchmarks/bench_copy.py's copy with the copy-engine hint, without a GPU: the arguments it
hands cuMemcpyBatchAsync in either ABI, and the plain copy where the driver has no batch call."""

import ctypes

import pytest

from benchmarks import bench_copy


def _attributes(arg) -> bench_copy._MemcpyAttributes:
    return ctypes.cast(arg, ctypes.POINTER(bench_copy._MemcpyAttributes)).contents


@pytest.mark.parametrize("fail_idx", [False, True])
def test_copy_engine_copy_is_one_hinted_batch_copy(monkeypatch, fail_idx):
    calls = []

    def batch(*args):
        calls.append(args)
        return 0
    monkeypatch.setattr(bench_copy, "_batch_copy", lambda: (batch, fail_idx))
    bench_copy.memcpy_copy_engine(0x1000, 0x2000, 96, 0x30, 3)
    (args,) = calls
    dsts, srcs, sizes, count, attrs, attrs_idx, num_attrs = args[:7]
    assert (dsts[0], srcs[0], sizes[0], count.value) == (0x1000, 0x2000, 96, 1)
    assert (attrs_idx[0], num_attrs.value) == (0, 1)
    a = _attributes(attrs)
    assert a.flags == bench_copy.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    assert a.src_access_order == bench_copy.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert (a.src_location.type, a.src_location.id) == (bench_copy.CU_MEM_LOCATION_TYPE_DEVICE, 3)
    assert (a.dst_location.type, a.dst_location.id) == (bench_copy.CU_MEM_LOCATION_TYPE_DEVICE, 3)
    # CUDA 13's cuMemcpyBatchAsync_v2 takes no failIdx: 8 arguments; the 12.8 call 9
    assert len(args) == (9 if fail_idx else 8)
    assert args[-1].value == 0x30


def test_copy_engine_copy_without_the_batch_call_is_a_plain_copy(monkeypatch):
    plain = []
    monkeypatch.setattr(bench_copy, "_batch_copy", lambda: None)
    monkeypatch.setattr(bench_copy.driver, "memcpy", lambda *args: plain.append(args))
    bench_copy.memcpy_copy_engine(0x1000, 0x2000, 96, 0x30, 0)
    assert plain == [(0x1000, 0x2000, 96, 0x30)]


def test_attributes_match_the_drivers_layout():
    # CUmemcpyAttributes: srcAccessOrder, srcLocHint {type, id}, dstLocHint {type, id}, flags
    assert ctypes.sizeof(bench_copy._MemcpyAttributes) == 24
