"""Where each row of the MoE dispatch goes on more than one rank: the routes of
all_to_all_grouped_mm's push (templates/grouped_gemm.py `dispatch_put_kernel`) and the row counts
its waiting GEMM expects per tile.

What each rank knows. Sender p knows its input_split_sizes (x's rows [s_q, s_q + n_q) go to rank
q, in order). Receiver q knows its output_split_sizes (it receives them rank-major: sender p's rows
start at received position start_q[p] = sum of output_split_sizes[:p]), its row_index (the op's
rows are received[row_index]: the permutation of its received rows into expert-major order) and
its offsets (the experts' cumulative row counts, hence its GEMM tiles). A row's destination, the
expert-major row inverse(row_index)[start_q[p] + i] and that row's tile, depends on the receiver's
start_q[p] and row_index: the sender knows neither.

The protocol: the receiver publishes its routes, the senders read them. Receiver q writes, into a
small symmetric int32 table of its own (`publish`),
    [start_q[0..W) | dst_row[0..capacity) | dst_tile[0..capacity)]
(dst_row[j], dst_tile[j]: the expert-major row and GEMM tile of its j-th received row), then
signals every sender; sender p, after that signal, reads its slice of q's table (`read_routes`)
and pushes each row straight to its expert-major row, adding one to that row's tile counter on q.

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
starts are r's to lack, so the combine's table is the first world words alone
(`publish_starts`, `read_combine_routes`).

Row_index must be a permutation of the received rows (an argsort of each received row's expert,
as every MoE layer builds it): a received row goes to one place. The runtime checks its length
on the host; a repeated entry leaves a received row unplaced (dst_row -1: not sent) and its
tile short of a row (its wait never completes: a bounded wait reports ERR_ROWS).

Everything here is torch ops on the tensors' device with host-known sizes only (the split sizes
are host ints): no host synchronisation, so the runtime calls it on the hot path. Tiles are
numbered as the kernel numbers them (`expert_of_tile`): expert after expert, ceil(rows_e /
block_m) each, then the rows past offsets[-1] (none in an MoE layer).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def table_words(world: int, capacity: int) -> int:
    """int32 words of one rank's route table for up to `capacity` received rows."""
    return world + 2 * capacity


def max_tiles(capacity: int, experts: int, block_m: int) -> int:
    """The GEMM's m-tiles for up to `capacity` rows (each expert adds at most one partial tile;
    the rows past the last offset, at most one more)."""
    return -(-capacity // block_m) + experts + 1


def tile_of_rows(offsets: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """[rows] int32: the GEMM m-tile of each expert-major row under these offsets."""
    device = offsets.device
    ends = offsets.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    first_tile = torch.cat([tiles.new_zeros(1), torch.cumsum(tiles, 0)])  # [E + 1]
    starts = torch.cat([starts, ends[-1:]])  # "expert" E: the rows past the last offset
    row = torch.arange(rows, device=device)
    expert = torch.searchsorted(ends, row, right=True)
    return (first_tile[expert] + (row - starts[expert]) // block_m).to(torch.int32)


def publish_starts(table: torch.Tensor, output_split_sizes: Sequence[int]) -> None:
    """table[:world] = start_q[0..world): where each sender's rows start among mine (the whole
    table of the combine, whose rows land in rank-major order)."""
    starts = [0]
    for n in output_split_sizes[:-1]:
        starts.append(starts[-1] + n)
    table[:len(starts)] = torch.tensor(starts, dtype=torch.int32).to(table.device,
                                                                     non_blocking=True)


def publish(table: torch.Tensor, output_split_sizes: Sequence[int],
            row_index: Optional[torch.Tensor], offsets: torch.Tensor, block_m: int) -> None:
    """Write this receiver's routes into its table (int32, `table_words` long)."""
    world = len(output_split_sizes)
    received = sum(output_split_sizes)
    publish_starts(table, output_split_sizes)
    capacity = (table.numel() - world) // 2
    dst_row = table[world:world + received]
    dst_tile = table[world + capacity:world + capacity + received]
    rows = torch.arange(received, dtype=torch.int32, device=table.device)
    if row_index is None:
        dst_row.copy_(rows)
    else:  # the inverse permutation: received row row_index[j] is expert-major row j
        dst_row.fill_(-1)
        dst_row.index_copy_(0, row_index.to(torch.int64), rows)
    dst_tile.copy_(tile_of_rows(offsets, received, block_m)[dst_row.clamp(min=0).to(torch.int64)])


def read_routes(rank: int, input_split_sizes: Sequence[int], tables: Sequence[torch.Tensor]):
    """(dst_rank, dst_row, dst_tile), int32 [sum(input_split_sizes)]: where each of this
    sender's x rows goes, read from each receiver q's published table (tables[q], its int32
    words as this rank sees them). dst_rank -1: a row no position claims (not sent)."""
    world = len(input_split_sizes)
    parts = []
    for q, at in received_positions(rank, input_split_sizes, tables):
        table = tables[q]
        capacity = (table.numel() - world) // 2
        row = table[world + at]
        tile = table[world + capacity + at]
        parts.append((torch.where(row < 0, -1, q).to(torch.int32), row, tile))
    return _concat(parts, 3, tables[rank].device)


def received_positions(rank: int, input_split_sizes: Sequence[int],
                       tables: Sequence[torch.Tensor]):
    """[(q, at)] for each rank q this sender sends rows to: at (int64 [n_q]), the positions of
    my rows among q's received rows, start_q[rank] + i, read from q's published starts (a device
    index: no host sync). A rank I send nothing is left out: its table is not read (see the
    runtimes' reuse argument)."""
    return [(q, tables[q][rank].to(torch.int64) + torch.arange(n, device=tables[q].device))
            for q, n in enumerate(input_split_sizes) if n]


def read_combine_routes(rank: int, input_split_sizes: Sequence[int],
                        tables: Sequence[torch.Tensor], row_index: Optional[torch.Tensor]):
    """(dst_rank, dst_row), int32 [rows]: where the combine's row j goes, the rank and row of
    rank-major position row_index[j] (j without an index) of what this rank sends, from each
    receiver's published starts (tables[q]: the first world words of q's table)."""
    parts = [(torch.full_like(at, q, dtype=torch.int32), at.to(torch.int32))
             for q, at in received_positions(rank, input_split_sizes, tables)]
    dst_rank, dst_row = _concat(parts, 2, tables[rank].device)
    if row_index is None:
        return dst_rank, dst_row
    at = row_index.to(device=dst_rank.device, dtype=torch.int64)
    return dst_rank[at], dst_row[at]


def _concat(parts, fields: int, device):
    if not parts:
        return tuple(torch.empty(0, dtype=torch.int32, device=device) for _ in range(fields))
    return tuple(torch.cat([p[i] for p in parts]).to(device) for i in range(fields))


def tile_rows(offsets: torch.Tensor, rows: int, block_m: int, tiles: int) -> torch.Tensor:
    """[tiles] int32: the rows of each GEMM m-tile this call (what its arrival counter grows by:
    expect = the previous expect + this)."""
    counts = torch.zeros(tiles, dtype=torch.int32, device=offsets.device)
    ones = torch.ones(rows, dtype=torch.int32, device=offsets.device)
    return counts.index_add_(0, tile_of_rows(offsets, rows, block_m).to(torch.int64), ones)
