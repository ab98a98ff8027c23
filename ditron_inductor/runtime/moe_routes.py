"""The multi-rank MoE exchange's routes (where the put kernel sends each row) and, for the
dispatch, the rows each waiting GEMM tile expects.

A dispatched row's expert-major row and tile depend on what only its receiver q knows (its
output_split_sizes, row_index and offsets), so q publishes its routes into a small symmetric
int32 table (`publish`; layout: templates/moe_routes.py) and signals every sender, whose put
kernel sends each row straight to its expert-major row and counts it on that tile's counter on
q. Each tile then waits on its own rows and the GEMM reads the buffer without a gather; rows in
arrival order would leave every tile waiting for the whole exchange. The combine's senders need
only the table's first 2 * world words (`publish_splits`). One host-to-device copy of the split
sizes and a few launches a call: no host sync, where torch ops would take dozens of small
kernels around the READY signal.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from .kernel_launch import cdiv, launch, next_power_of_2

# the publish kernel's rows per program: a program holds rows x experts words (each row compared
# with every expert's end)
PUBLISH_WORDS, PUBLISH_MAX_ROWS = 4096, 128
# put_rows_kernel: one row per program, in steps of up to 2048 columns, on 2 warps: a program
# per row keeps enough copies in flight at a few hundred rows, where 16-row programs leave most
# SMs idle (benchmarks/bench_put_rows.py measures the configs)
PUT_ROWS, PUT_BLOCK_K, PUT_WARPS = 1, 2048, 2
PUT_CONFIG = (PUT_ROWS, PUT_BLOCK_K, PUT_WARPS)


def table_words(world: int, capacity: int) -> int:
    """int32 words of a dispatch route table for up to `capacity` received rows."""
    return split_words(world) + 2 * capacity


def split_words(world: int) -> int:
    """The table's first words: the starts of the senders' rows, then my send ends."""
    return 2 * world


def max_tiles(capacity: int, experts: int, block_m: int) -> int:
    """The GEMM's m-tiles for up to `capacity` rows: each expert adds at most one partial tile,
    the rows past the last offset one more."""
    return -(-capacity // block_m) + experts + 1


def publish_splits(table: torch.Tensor, output_split_sizes: Sequence[int],
                   input_split_sizes: Sequence[int], counts: bool = False,
                   unclaimed: int = 0) -> None:
    """table[:2 * world] = [each sender's start among my rows | the end of my rows to each
    rank], then (counts: the combine's) the rows from each sender, then `unclaimed` words of -1
    (the dispatch's dst_row before its publish kernel claims them), in one host-to-device
    copy."""
    words = [0]
    for n in output_split_sizes[:-1]:
        words.append(words[-1] + n)
    end = 0
    for n in input_split_sizes:
        end += n
        words.append(end)
    if counts:
        words += output_split_sizes
    n = len(words)
    if not unclaimed:
        table[:n].copy_(torch.tensor(words, dtype=torch.int32), non_blocking=True)
        return
    # pageable host memory: the copy has read it when copy_ returns, so the buffer is reused
    host = _host_words.get(n)
    if host is None or host.numel() < n + unclaimed:
        host = _host_words[n] = torch.full((n + next_power_of_2(unclaimed),), -1,
                                           dtype=torch.int32)
    host[:n] = torch.tensor(words, dtype=torch.int32)
    table[:n + unclaimed].copy_(host[:n + unclaimed], non_blocking=True)


_host_words: dict[int, torch.Tensor] = {}  # by the count of split words: [words | -1 ...]


@dataclasses.dataclass(frozen=True)
class Handshake:
    """The dispatch's READY handshake in its publish kernel (templates/moe_routes.py): READY =
    epoch on each peer (a bit of signal_mask: its word's address in addrs), then until my flag
    words[q] >= epoch for each bit q of wait_mask; done counts the kernel's programs (the
    last one does it). limit and err: the bounded wait's (runtime/context.wait_limit)."""

    done: torch.Tensor
    addrs: torch.Tensor
    signal_mask: int
    epoch: int
    words: torch.Tensor
    wait_mask: int
    limit: int
    err: torch.Tensor


def publish(table: torch.Tensor, output_split_sizes: Sequence[int],
            input_split_sizes: Sequence[int], row_index: Optional[torch.Tensor],
            offsets: torch.Tensor, block_m: int, expect: torch.Tensor,
            handshake: Optional[Handshake] = None) -> bool:
    """This rank's dispatch routes into its table (`table_words` long); this call's rows per
    GEMM tile added to `expect`, what the waiting tiles wait for; then `handshake` in the
    same launch. Whether the handshake ran (not where I receive no rows: no launch)."""
    from ..templates.moe_routes import publish_routes_kernel

    world = len(output_split_sizes)
    received = sum(output_split_sizes)
    capacity = (table.numel() - split_words(world)) // 2
    # with an index, a position no entry claims stays -1: its row is not sent
    publish_splits(table, output_split_sizes, input_split_sizes,
                   unclaimed=received if row_index is not None else 0)
    if not received:
        return False
    experts = next_power_of_2(offsets.shape[0])
    block = max(1, min(PUBLISH_MAX_ROWS, PUBLISH_WORDS // experts))
    h = handshake or Handshake(expect, table, 0, 0, expect, 0, 0, expect)
    launch(publish_routes_kernel, (cdiv(received, block),), table,
           table if row_index is None else row_index, offsets, expect, received, capacity,
           offsets.shape[0], h.done, h.addrs, h.signal_mask, h.epoch, h.words, h.wait_mask,
           h.limit, h.err, BLOCK=block, BLOCK_M=block_m, E_P2=experts, WORLD=world,
           HAS_INDEX=row_index is not None,
           **({} if handshake is None else dict(SIGNAL=True, WORDS=next_power_of_2(world))))
    return handshake is not None


@dataclasses.dataclass(frozen=True)
class ArrivalWait:
    """What the put kernel's last program waits for after its rows (templates/moe_routes.py):
    tiles, my tile counters `words` until counter t reaches wants[t] for t < count; else my
    flag words words[first + i] until each reaches wants[i] for each bit i of count, then
    taken back off. limit and err: the bounded wait's (runtime/context.wait_limit)."""

    tiles: bool
    words: torch.Tensor
    first: int
    wants: torch.Tensor
    count: int
    limit: int
    err: torch.Tensor


def put_rows(x: torch.Tensor, table_table: torch.Tensor, recv_table: torch.Tensor,
             count_table: torch.Tensor, rank: int, world: int, capacity: int,
             expert_major: bool, send_index: Optional[torch.Tensor] = None,
             config: tuple[int, int, int] = PUT_CONFIG,
             wait: Optional[ArrivalWait] = None) -> bool:
    """put_rows_kernel: x's rows (contiguous; in send order, or row r sent as send row
    send_index[r]) each to its route in its receiver's buffer, counted on the receiver's
    counter of its tile (the combine's: its word for me); then `wait`, in the same launch.
    Whether it launched (x has rows): if not, nothing waited. `config`: (rows per program,
    columns a step, warps), another for benchmarks/bench_put_rows."""
    from ..templates.moe_routes import WAIT_TILES, WAIT_WORDS, put_rows_kernel

    if not x.shape[0]:
        return False
    rows_per_program, block_k, warps = config
    width = x.shape[1]
    waits = ({} if wait is None else
             dict(WAIT=WAIT_TILES, WAIT_BLOCK=min(1024, next_power_of_2(wait.count)),
                  PROXY_FENCE=x.device.type == "cuda") if wait.tiles else dict(WAIT=WAIT_WORDS))
    w = wait or ArrivalWait(False, table_table, 0, table_table, 0, 0, table_table)
    launch(put_rows_kernel, (cdiv(x.shape[0], rows_per_program),), x,
           x if send_index is None else send_index, table_table, recv_table, count_table,
           x.shape[0], width, rank, capacity, w.words, w.first, w.wants, w.count, w.limit, w.err,
           BLOCK_R=rows_per_program, BLOCK_K=min(block_k, next_power_of_2(width)), WORLD=world,
           WORLD_P2=next_power_of_2(world), EXPERT_MAJOR=expert_major,
           HAS_INDEX=send_index is not None, **waits, num_warps=warps)
    return True
