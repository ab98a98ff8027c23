"""What every GPU test rank does last: leave its status for the parent and close the group."""

from __future__ import annotations

import os


def report_and_close(result_dir: str, rank: int, status: str) -> None:
    import torch.distributed as dist

    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as fh:
        fh.write(status)
    dist.barrier()
    dist.destroy_process_group()
