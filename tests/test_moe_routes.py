"""The multi-rank dispatch's routes (runtime/moe_routes.py) on emulated ranks, against the op's
reference semantics (all_to_all_grouped_mm_reference: all_to_all_single of x by the splits, then
received[row_index]): every receiver publishes its table, every sender reads its routes from all
of them, the rows are put where the routes say, and each receiver's buffer must then hold exactly
its reference rows, and each tile's counter exactly the rows of that tile. Rows are labelled
(sender, row) so a row in the wrong place fails; the receive buffers start at -1."""

import pytest
import torch

from ditron_inductor.runtime import moe_routes

BLOCK_M = 4
EXPERTS = 3  # per rank


def host_tiles(offsets, block_m):
    """Each expert-major row's tile, counted the plain way (expert after expert)."""
    tiles, tile, start = [], 0, 0
    for end in offsets.tolist():
        for r in range(end - start):
            tiles.append(tile + r // block_m)
        tile += -(-(end - start) // block_m)
        start = end
    return tiles


def routing(world, case, gen):
    """Per sender: x (rows labelled sender * 1000 + row) and input_split_sizes; per receiver: the
    expert of each received row."""
    xs, splits = [], []
    for p in range(world):
        tokens = int(torch.randint(0, 12, (1,), generator=gen))
        if case == "all_to_one":
            dst = torch.full((tokens,), world - 1)
        elif case == "one_receives_nothing":
            dst = torch.randint(0, world - 1, (tokens,), generator=gen) if world > 1 else \
                torch.zeros(tokens, dtype=torch.int64)
        else:
            dst = torch.randint(0, world, (tokens,), generator=gen)
        dst = dst.sort().values  # x is sent rank-major: rows to rank 0 first
        splits.append(torch.bincount(dst, minlength=world).tolist())
        xs.append((p * 1000 + torch.arange(tokens, dtype=torch.float32))[:, None].repeat(1, 2))
    return xs, splits


def reference_received(world, xs, splits, q):
    parts = []
    for p in range(world):
        s = sum(splits[p][:q])
        parts.append(xs[p][s:s + splits[p][q]])
    return torch.cat(parts)


def expert_major(received_rows, case, gen):
    """(row_index, offsets): an argsort of a random local expert per row; expert 1 empty in
    "empty_expert"; every row to expert 0 in "all_to_one"."""
    expert = torch.randint(0, EXPERTS, (received_rows,), generator=gen)
    if case == "empty_expert":
        expert = torch.where(expert == 1, 2, expert)
    if case == "all_to_one":
        expert = torch.zeros_like(expert)
    row_index = torch.argsort(expert, stable=True)
    offsets = torch.cumsum(torch.bincount(expert, minlength=EXPERTS), 0).to(torch.int32)
    return row_index, offsets


CASES = ["random", "empty_expert", "one_receives_nothing", "all_to_one", "arrival_order"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(6))
def test_routes_put_every_row_where_the_reference_has_it(world, case, seed):
    gen = torch.Generator().manual_seed(seed * 31 + world)
    xs, splits = routing(world, case, gen)
    capacity = 12 * world
    tables, layouts = [], []
    for q in range(world):
        out_splits = [splits[p][q] for p in range(world)]
        received = sum(out_splits)
        row_index, offsets = expert_major(received, case, gen)
        if case == "arrival_order":
            row_index = None
        table = torch.zeros(moe_routes.table_words(world, capacity), dtype=torch.int32)
        moe_routes.publish(table, out_splits, row_index, offsets, BLOCK_M)
        tables.append(table)
        layouts.append((received, row_index, offsets))
    tiles = moe_routes.max_tiles(capacity, EXPERTS, BLOCK_M)
    recv = [torch.full((capacity, 2), -1.0) for _ in range(world)]
    counts = [torch.zeros(tiles, dtype=torch.int32) for _ in range(world)]
    for p in range(world):
        dst_rank, dst_row, dst_tile = moe_routes.read_routes(p, splits[p], tables)
        assert dst_rank.shape == (xs[p].shape[0],)
        assert (dst_rank >= 0).all()  # a permutation places every row
        assert dst_rank.tolist() == sorted(dst_rank.tolist())  # x's rank-major order
        for i in range(xs[p].shape[0]):  # the push, one row at a time
            q = int(dst_rank[i])
            assert torch.equal(recv[q][dst_row[i]], torch.tensor([-1.0, -1.0])), "written twice"
            recv[q][dst_row[i]] = xs[p][i]
            counts[q][dst_tile[i]] += 1
    for q, (received, row_index, offsets) in enumerate(layouts):
        ref = reference_received(world, xs, splits, q)
        if row_index is not None:
            ref = ref[row_index]
        assert torch.equal(recv[q][:received], ref), (q, case)
        assert (recv[q][received:] == -1).all()
        expect = moe_routes.tile_rows(offsets, received, BLOCK_M, tiles)
        assert torch.equal(counts[q], expect)
        if row_index is not None:  # the tile of each row, and each tile's rows, as counted
            host = torch.bincount(torch.tensor(host_tiles(offsets, BLOCK_M), dtype=torch.int64),
                                  minlength=tiles)
            assert expect.tolist() == host.tolist()


def test_tiles_as_the_kernel_numbers_them():
    """Expert after expert, ceil(rows / block_m) tiles each (none for an empty expert), then the
    rows past the last offset (as grouped_gemm.expert_of_tile: test_experts_of_tiles)."""
    offsets = torch.tensor([0, 17, 17, 40, 41], dtype=torch.int32)
    tiles = moe_routes.tile_of_rows(offsets, 45, 16).tolist()
    assert tiles == [0] * 16 + [1] + [2] * 16 + [3] * 7 + [4] + [5] * 4
    assert moe_routes.tile_rows(offsets, 45, 16, 8).tolist() == [16, 1, 16, 7, 1, 4, 0, 0]


def test_a_repeated_row_index_entry_leaves_a_row_unsent():
    """Not a permutation: received row 2 is claimed twice, row 1 by none: row 1 is not sent
    (dst_rank -1) and its tile is one row short of what the receiver expects."""
    table = torch.zeros(moe_routes.table_words(1, 4), dtype=torch.int32)
    offsets = torch.tensor([4], dtype=torch.int32)
    moe_routes.publish(table, [4], torch.tensor([0, 2, 2, 3]), offsets, 2)
    dst_rank, dst_row, _ = moe_routes.read_routes(0, [4], [table])
    assert dst_rank.tolist() == [0, -1, 0, 0]
