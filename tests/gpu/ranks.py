"""How the GPU tests start their ranks, and what every rank does last: leave its status for the
parent and close the group."""

from __future__ import annotations

import os


def init_rank(rank: int, world: int, port: int) -> None:
    """This process on GPU `rank` of a fresh NCCL group of `world` ranks on localhost."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))


def report_and_close(result_dir: str, rank: int, status: str) -> None:
    import torch.distributed as dist

    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as fh:
        fh.write(status)
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(worker, args: tuple, world: int) -> None:
    """`worker(rank, *args)` on `world` fresh processes, one per GPU, running the compiled kernels:
    the interpreter test modules that pytest collected into the same process set
    TRITON_INTERPRET=1 in its environment, which the ranks would otherwise inherit."""
    import torch.multiprocessing as mp

    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        mp.start_processes(worker, args=args, nprocs=world, join=True, start_method="spawn")
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
