"""Where each row of the multi-rank MoE dispatch goes (the routes of all_to_all_grouped_mm's put
kernel) and the rows its waiting GEMM expects per tile.

Sender p knows its input_split_sizes (x's rows [s_q, s_q + n_q) go to rank q). Receiver q knows
its output_split_sizes (sender p's rows start at received position start_q[p] = sum of
output_split_sizes[:p]), its row_index (its received rows' permutation into expert-major order)
and its offsets (hence its GEMM tiles). A row's expert-major row, inverse(row_index)[start_q[p]
+ i], and its tile depend on what only the receiver knows. So receiver q publishes its routes
into a small symmetric int32 table (`publish`; layout: templates/moe_routes.py) and signals
every sender; sender p's put kernel then reads its rows' routes from q's table and pushes each
row straight to its expert-major row, adding one to that tile's counter on q. Each tile waits
on its own rows and the GEMM reads the buffer without a gather; had the senders written in
arrival order for the GEMM to gather through row_index, a sender could not tell which tile a
row feeds, and every tile would wait for the whole exchange, for the same one signal.

The combine's senders (runtime/moe_combine.py) lack only the starts: its table is the first
2 * world words alone (`publish_splits`). Kernels write and read the tables, with one
host-to-device copy of the split sizes: no host sync, and three launches a call where torch ops
would take dozens of small kernels around the READY signal, leaving the GPU idle.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .kernel_launch import cdiv, launch, next_power_of_2

ROUTE_ROWS = 128  # rows per program of the routes kernel
# the publish kernel's rows per program: each compares itself with every expert's end, so a
# program holds rows x experts words
PUBLISH_WORDS, PUBLISH_MAX_ROWS = 4096, 128
PUT_ROWS, PUT_BLOCK_K = 16, 128  # put_rows_kernel: rows per program, columns a step


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
                   input_split_sizes: Sequence[int]) -> None:
    """table[:2 * world] = [each sender's start among my rows | the end of my rows to each
    rank], in one host-to-device copy."""
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
    """This rank's dispatch routes into its table (`table_words` long); this call's rows per
    GEMM tile added to `expect`, the counts the waiting tiles expect."""
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
    """(dst_rank, dst_row, dst_tile), int32 [rows]: where the row at send position index[i] (i
    without an index) goes, from the receivers' tables (route_of_rows)."""
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
             expert_major: bool) -> None:
    """put_rows_kernel: x's rows (contiguous, in send order) each to its route in its
    receiver's buffer, one added to the receiver's counter of its tile (the combine's: one word
    per sender)."""
    from ..templates.moe_routes import put_rows_kernel

    if x.shape[0]:
        width = x.shape[1]
        launch(put_rows_kernel, (cdiv(x.shape[0], PUT_ROWS),), x, table_table, recv_table,
               count_table, x.shape[0], width, rank, capacity, BLOCK_R=PUT_ROWS,
               BLOCK_K=min(PUT_BLOCK_K, next_power_of_2(width)), WORLD=world,
               WORLD_P2=next_power_of_2(world), EXPERT_MAJOR=expert_major)
