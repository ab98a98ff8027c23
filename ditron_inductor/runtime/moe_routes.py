"""Where each row of the MoE dispatch goes on more than one rank: the routes of
all_to_all_grouped_mm's push (templates/moe_routes.py `put_rows_kernel`) and the row counts its
waiting GEMM expects per tile.

What each rank knows. Sender p knows its input_split_sizes (x's rows [s_q, s_q + n_q) go to rank
q, in order). Receiver q knows its output_split_sizes (it receives them rank-major: sender p's rows
start at received position start_q[p] = sum of output_split_sizes[:p]), its row_index (the op's
rows are received[row_index]: the permutation of its received rows into expert-major order) and
its offsets (the experts' cumulative row counts, hence its GEMM tiles). A row's destination, the
expert-major row inverse(row_index)[start_q[p] + i] and that row's tile, depends on the receiver's
start_q[p] and row_index: the sender knows neither.

The protocol: the receiver publishes its routes, the senders read them. Receiver q writes, into a
small symmetric int32 table of its own (`publish`),
    [start_q[0..W) | send_end_q[0..W) | dst_row[0..capacity) | dst_tile[0..capacity)]
(dst_row[j], dst_tile[j]: the expert-major row and GEMM tile of its j-th received row; send_end_q:
its own input split sizes, cumulated, which only q reads), then signals every sender; sender p,
after that signal, reads its rows' slots of q's table from its put kernel and pushes each row
straight to its expert-major row, adding one to that row's tile counter on q.

Why this and not "senders write in arrival order, the receiver's GEMM gathers through
row_index": that one needs the same single signal (the sender still lacks start_q[p], the other
senders' counts), but the sender then cannot tell which tile a row feeds, so a tile could only
wait for every row of every sender: no tile would start before the whole exchange ended. With the
published routes each tile waits on exactly its own rows (the kernel's per-tile counters), the
GEMM reads the receive buffer without a gather, and the number of round trips is the minimum:
one signal receiver -> sender, then the push. The table is small (8 bytes a row).

The combine (grouped_mm_all_to_all, runtime/moe_combine.py) goes the other way: rank r's
product row j is position row_index[j] of what r sends, and lands on rank q at received
position start_q[r] + (row_index[j] - s_q), rank-major as the all-to-all lands it. Only the
starts are r's to lack, so the combine's table is the first 2 * world words alone
(`publish_splits`; the put kernel, or `routes` for the GEMM epilogue's push, reads them).

Row_index must be a permutation of the received rows (an argsort of each received row's expert,
as every MoE layer builds it): a received row goes to one place. The runtime checks its length
on the host; a repeated entry leaves a received row unplaced (dst_row -1: not sent) and its
tile short of a row (its wait never completes: a bounded wait reports ERR_ROWS).

The tables are written and read by Triton kernels (templates/moe_routes.py: one launch to publish,
the routes read inside the put kernel) and one host-to-device copy of the split sizes (host
ints): no host synchronisation, and three launches a call where torch ops took dozens of small
kernels on the caller's stream, before the READY signal and between it and the push (the
dispatch's calls idled 0.28-0.75 ms on 2x H100 with those and the READY handshake:
benchmarks/results/moe_ep_h100x2_profile.md). Tiles are numbered as the GEMM numbers them
(`expert_of_tile`): expert after expert, ceil(rows_e / block_m) each, then the rows past
offsets[-1] (none in an MoE layer).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .kernel_launch import cdiv, launch, next_power_of_2

ROUTE_ROWS = 128  # rows per program of the routes kernel
# the publish kernel's rows per program: each row compares itself with every expert's end, so
# a program holds rows x experts words (4096 of them)
PUBLISH_WORDS, PUBLISH_MAX_ROWS = 4096, 128
PUT_ROWS, PUT_BLOCK_K = 16, 128  # put_rows_kernel: rows per program, columns a step


def table_words(world: int, capacity: int) -> int:
    """int32 words of one rank's dispatch route table for up to `capacity` received rows (the
    combine's: split_words(world))."""
    return split_words(world) + 2 * capacity


def split_words(world: int) -> int:
    """The table's first words: the starts of the senders' rows, then my send ends."""
    return 2 * world


def max_tiles(capacity: int, experts: int, block_m: int) -> int:
    """The GEMM's m-tiles for up to `capacity` rows (each expert adds at most one partial tile;
    the rows past the last offset, at most one more)."""
    return -(-capacity // block_m) + experts + 1


def publish_splits(table: torch.Tensor, output_split_sizes: Sequence[int],
                   input_split_sizes: Sequence[int]) -> None:
    """table[:2 * world] = [where each sender's rows start among mine | the ends of the rows I
    send to each rank among mine]: one host-to-device copy (the whole table of the combine)."""
    words = [0]
    for n in output_split_sizes[:-1]:
        words.append(words[-1] + n)
    end = 0
    for n in input_split_sizes:
        end += n
        words.append(end)
    table[:len(words)].copy_(torch.tensor(words, dtype=torch.int32), non_blocking=True)


def publish(table: torch.Tensor, output_split_sizes: Sequence[int],
            input_split_sizes: Sequence[int], row_index: Optional[torch.Tensor],
            offsets: torch.Tensor, block_m: int, expect: torch.Tensor) -> None:
    """Write this rank's dispatch routes into its table (int32, `table_words` long) and add this
    call's rows per GEMM tile to `expect` (the counts the waiting tiles expect)."""
    from ..templates.moe_routes import publish_routes_kernel

    world = len(output_split_sizes)
    received = sum(output_split_sizes)
    capacity = (table.numel() - split_words(world)) // 2
    publish_splits(table, output_split_sizes, input_split_sizes)
    if row_index is not None:  # a position no entry claims stays -1: its row is not sent
        table[split_words(world):split_words(world) + received].fill_(-1)
    if received:
        experts = next_power_of_2(offsets.shape[0])
        block = max(1, min(PUBLISH_MAX_ROWS, PUBLISH_WORDS // experts))
        launch(publish_routes_kernel, (cdiv(received, block),), table,
               table if row_index is None else row_index, offsets, expect, received, capacity,
               offsets.shape[0], BLOCK=block, BLOCK_M=block_m, E_P2=experts, WORLD=world,
               HAS_INDEX=row_index is not None)


def routes(table_table: torch.Tensor, rank: int, world: int, rows: int, capacity: int,
           index: Optional[torch.Tensor], expert_major: bool):
    """(dst_rank, dst_row, dst_tile), int32 [rows]: where this sender's row at send position
    index[i] (i without an index) goes, read from the receivers' tables (table_table: each
    rank's table address). expert_major: the dispatch's tables (else the combine's: the
    position among the receiver's rows, tile 0). dst_rank -1: a position no entry claims."""
    from ..templates.moe_routes import routes_kernel

    device = table_table.device
    out = [torch.empty(rows, dtype=torch.int32, device=device) for _ in range(3)]
    if rows:
        launch(routes_kernel, (cdiv(rows, ROUTE_ROWS),), out[0] if index is None else index,
               *out, table_table, rows, rank, capacity, BLOCK=ROUTE_ROWS, WORLD=world,
               WORLD_P2=next_power_of_2(world), EXPERT_MAJOR=expert_major,
               HAS_INDEX=index is not None)
    return tuple(out)


def put_rows(x: torch.Tensor, table_table: torch.Tensor, recv_table: torch.Tensor,
             count_table: torch.Tensor, rank: int, world: int, capacity: int,
             expert_major: bool, stream: Optional[int] = None) -> None:
    """put_rows_kernel: x's rows (contiguous, in send order) each into its route's row of its
    receiver's buffer (recv_table: each rank's), one added to the receiver's counter of its
    tile (count_table: each rank's counter base, for the combine one word per sender); on
    `stream` (a CUstream handle; default: the current stream)."""
    from ..templates.moe_routes import put_rows_kernel

    if x.shape[0]:
        width = x.shape[1]
        launch(put_rows_kernel, (cdiv(x.shape[0], PUT_ROWS),), x, table_table, recv_table,
               count_table, x.shape[0], width, rank, capacity, BLOCK_R=PUT_ROWS,
               BLOCK_K=min(PUT_BLOCK_K, next_power_of_2(width)), WORLD=world,
               WORLD_P2=next_power_of_2(world), EXPERT_MAJOR=expert_major, stream=stream)
