"""runtime/kernel_launch.py: the class of an argument separates every input Triton would compile
differently, and the fast path launches the compiled kernel with the arguments Triton would pass
(a fake Triton kernel stands in for the GPU)."""

import contextlib

import torch

from ditron_inductor.runtime import kernel_launch


def test_arg_class_separates_what_triton_specializes_on():
    c = kernel_launch.arg_class
    t = torch.zeros(64, dtype=torch.bfloat16)
    assert c(t) == c(torch.zeros(64, dtype=torch.bfloat16))
    assert c(t) != c(t[1:])  # 2-byte offset: not 16-byte aligned
    assert c(t) != c(t.float())
    assert len({c(1), c(2), c(3), c(16), c(32), c(2 ** 40), c(2 ** 63)}) == 5
    assert c(2) == c(3) and c(16) == c(32)
    assert c(True) != c(1) and c(False) != c(0) and c(None) != c(0)
    assert c(1.0) == c(2.5) and c(1.0) != c(1)


def test_descriptor_class_is_its_dtype_and_block_not_its_shape():
    """One runner for every row count (the MoE GEMMs' rows through TMA change call after call),
    and never coarser than the installed Triton's own key for a descriptor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    c = kernel_launch.arg_class

    def desc(rows, width=64, block=(16, 32), dtype=torch.bfloat16):
        return TensorDescriptor.from_tensor(torch.zeros(rows, width, dtype=dtype), list(block))

    strided = torch.zeros(40, 128, dtype=torch.bfloat16)[:, :64]
    descs = [desc(16), desc(100), desc(4097), desc(16, width=128),
             TensorDescriptor(strided, list(strided.shape), list(strided.stride()), [16, 32]),
             desc(16, block=(32, 32)), desc(16, dtype=torch.float16)]
    classes = [c(d) for d in descs]
    assert len(set(classes[:5])) == 1  # rows, width and strides: one class
    assert len(set(classes)) == 3  # another block shape or dtype: a class of its own
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:  # a Triton that specializes in Python: the classes above still hold
        return
    keys = [native_specialize_impl(BaseBackend, d, False, True, True)[0] for d in descs]
    for i, j in ((i, j) for i in range(len(descs)) for j in range(i)):
        assert classes[i] != classes[j] or keys[i] == keys[j], (keys[i], keys[j])


class FakeCompiled:
    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.launches.append(("fast", grid, args, stream))
        return runner

    def _init_handles(self):  # Triton's: loads the module
        self.launches.append(("load",))


class FakeKernel:
    """Stands for a @triton.jit kernel: fn (its signature), kernel[grid](...) -> compiled."""

    def __init__(self):
        def kernel(x_ptr, n, scale, BLOCK, EVEN=True):
            pass
        self.fn = kernel
        self.launches = []
        self.compiled = FakeCompiled(self.launches)

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.launches.append(("triton", grid, args, meta))
            return self.compiled
        return run

    def warmup(self, *args, grid, **meta):  # compiles, launches nothing
        self.launches.append(("compile", grid, args, meta))
        return self.compiled


def on_gpu(monkeypatch, stream: int) -> None:
    """As on a CUDA build: a current device and stream (this handle), no runners yet."""
    monkeypatch.setattr(kernel_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(kernel_launch, "_current_stream", lambda device: stream)
    monkeypatch.setattr(kernel_launch, "_runners", {})


def test_launch_compiles_once_per_class_then_calls_the_compiled_launcher(monkeypatch):
    on_gpu(monkeypatch, stream=1234)
    k = FakeKernel()
    x = torch.zeros(64)
    kernel_launch.launch(k, (4,), x, 100, 0.5, BLOCK=128, num_warps=4)
    kernel_launch.launch(k, (4,), x, 200, 0.25, BLOCK=128, num_warps=4)
    kernel_launch.launch(k, (4,), x, 200, 0.25, BLOCK=128, num_warps=4, stream=99)
    assert [entry[0] for entry in k.launches] == ["triton", "fast", "fast"]
    # the params after the positional ones: BLOCK from meta, EVEN its default; a 3-d grid
    assert k.launches[1] == ("fast", (4, 1, 1), (x, 200, 0.25, 128, True), 1234)
    assert k.launches[2][3] == 99
    # another class of any argument or option goes through Triton again
    kernel_launch.launch(k, (4,), x, 1, 0.5, BLOCK=128, num_warps=4)  # n == 1
    kernel_launch.launch(k, (4,), x[1:], 100, 0.5, BLOCK=128, num_warps=4)  # misaligned
    kernel_launch.launch(k, (4,), x, 100, 0.5, BLOCK=256, num_warps=4)
    kernel_launch.launch(k, (8,), x, 100, 0.5, BLOCK=128, num_warps=4)
    assert [entry[0] for entry in k.launches[3:]] == ["triton"] * 4


def test_a_first_launch_runs_on_the_stream_its_handle_names(monkeypatch):
    """Triton launches on torch's current stream, so a first launch (Triton's path) on a given
    handle makes that stream current: for handle 0 the default stream's own object, since
    torch.cuda.ExternalStream(0) is a new stream of torch's pool (a null pointer reads as "none
    given"), which a kernel meant for the default stream then ran on, unordered with it."""
    on_gpu(monkeypatch, stream=0)
    entered = []

    @contextlib.contextmanager
    def current(stream):
        entered.append(stream)
        yield

    monkeypatch.setattr(torch.cuda, "stream", current)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: "the default stream")
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle: f"stream {handle}")
    k = FakeKernel()
    x = torch.zeros(64)
    kernel_launch.launch(k, (4,), x, 100, 0.5, BLOCK=128, stream=0)
    kernel_launch.launch(k, (4,), x, 1, 0.5, BLOCK=128, stream=1234)  # another class
    kernel_launch.launch(k, (4,), x, 100, 0.5, BLOCK=128, stream=0)  # the compiled launcher's
    assert [entry[0] for entry in k.launches] == ["triton", "triton", "fast"]
    assert entered == ["the default stream", "stream 1234"]
    assert k.launches[2][3] == 0  # the handle itself: 0 is the default stream there


def test_preload_compiles_and_loads_so_that_the_launch_loads_nothing(monkeypatch):
    """A kernel queued where another may spin on a peer is loaded first: preload compiles and
    loads the module once per class, launches nothing, and the launch that follows goes
    straight to the compiled launcher."""
    on_gpu(monkeypatch, stream=7)
    k = FakeKernel()
    x = torch.zeros(64)
    kernel_launch.preload(k, (4,), x, 100, 0.5, BLOCK=128, num_warps=4)
    assert k.launches == [("compile", (4,), (x, 100, 0.5), dict(BLOCK=128, num_warps=4)),
                          ("load",)]
    kernel_launch.preload(k, (4,), x, 200, 0.5, BLOCK=128, num_warps=4)  # the same class
    kernel_launch.launch(k, (4,), x, 200, 0.5, BLOCK=128, num_warps=4)
    assert k.launches[2:] == [("fast", (4, 1, 1), (x, 200, 0.5, 128, True), 7)]
    kernel_launch.preload(k, (4,), x, 1, 0.5, BLOCK=128, num_warps=4)  # n == 1: another class
    assert k.launches[3:] == [("compile", (4,), (x, 1, 0.5), dict(BLOCK=128, num_warps=4)),
                              ("load",)]


def test_launch_without_a_compiled_kernel_always_goes_through_triton(monkeypatch):
    """The interpreter (and a CPU build of torch) hands no compiled kernel back."""
    on_gpu(monkeypatch, stream=0)
    k = FakeKernel()
    k.compiled = None
    for _ in range(3):
        kernel_launch.launch(k, (1,), torch.zeros(4), 4, 1.0, BLOCK=16)
    assert [entry[0] for entry in k.launches] == ["triton"] * 3


def test_the_table_of_runners_is_bounded(monkeypatch):
    """Dynamic shapes give a new grid per size: the table starts over instead of growing."""
    on_gpu(monkeypatch, stream=0)
    monkeypatch.setattr(kernel_launch, "_MAX_RUNNERS", 3)
    k = FakeKernel()
    x = torch.zeros(16)
    for progs in range(1, 8):
        kernel_launch.launch(k, (progs,), x, 4, 1.0, BLOCK=16)
        assert len(kernel_launch._runners) <= 3
    kernel_launch.launch(k, (7,), x, 4, 1.0, BLOCK=16)  # the latest entry survived
    assert k.launches[-1][0] == "fast"


def test_arguments_of_other_kinds_are_classed_by_value():
    import enum

    class Mode(enum.IntEnum):
        A = 1
        B = 2

    c = kernel_launch.arg_class
    assert c(Mode.A) != c(Mode.B) and c(Mode.A) != c(1)
    assert c("x") != c("y")
