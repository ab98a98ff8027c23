"""NVLink multicast stays off on the machines this project measures on: NCCL's NVLS, PyTorch's
symmetric-memory multicast and NVSHMEM's NVLS are switched off wherever the environment does not
say otherwise. The benchmarks and the GPU tests call `keep_multicast_off()` before any process
group exists (NCCL, PyTorch and NVSHMEM read these when a communicator or heap is set up)."""

import os

SWITCHES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off() -> None:
    for name, value in SWITCHES.items():
        os.environ.setdefault(name, value)
