"""The multi-rank MoE routes (runtime/moe_routes.py, its kernels templates/moe_routes.py under the
Triton interpreter) on emulated ranks, against the op's reference semantics
(all_to_all_grouped_mm_reference: all_to_all_single of x by the splits, then received[row_index]):
every receiver publishes its table, every sender reads its routes from all of them and puts its
rows where they say; each receiver's buffer must then hold exactly its reference rows, and each
tile's counter (and the count its GEMM expects) exactly the rows of that tile. Rows are labelled
(sender, row) so a row in the wrong place fails; the receive buffers start at -1."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported by the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from ditron_inductor.runtime import moe_routes  # noqa: E402

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


def addresses(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(6))
def test_routes_put_every_row_where_the_reference_has_it(world, case, seed):
    gen = torch.Generator().manual_seed(seed * 31 + world)
    xs, splits = routing(world, case, gen)
    capacity = 12 * world
    tiles = moe_routes.max_tiles(capacity, EXPERTS, BLOCK_M)
    tables, layouts, expects = [], [], []
    for q in range(world):
        out_splits = [splits[p][q] for p in range(world)]
        received = sum(out_splits)
        row_index, offsets = expert_major(received, case, gen)
        if case == "arrival_order":
            row_index = None
        table = torch.zeros(moe_routes.table_words(world, capacity), dtype=torch.int32)
        expect = torch.full((tiles,), 5, dtype=torch.int32)  # the previous call's counts
        moe_routes.publish(table, out_splits, splits[q], row_index, offsets, BLOCK_M, expect)
        tables.append(table)
        layouts.append((received, row_index, offsets))
        expects.append(expect - 5)
    table_table = addresses(tables)
    recv = [torch.full((capacity, 2), -1.0) for _ in range(world)]
    counts = [torch.zeros(tiles, dtype=torch.int32) for _ in range(world)]
    for p in range(world):
        moe_routes.put_rows(xs[p], table_table, addresses(recv), addresses(counts), p, world,
                            capacity, expert_major=True)
    for q, (received, row_index, offsets) in enumerate(layouts):
        ref = reference_received(world, xs, splits, q)
        if row_index is not None:
            ref = ref[row_index]
        assert torch.equal(recv[q][:received], ref), (q, case)
        assert (recv[q][received:] == -1).all()
        assert torch.equal(counts[q], expects[q])  # the count each tile's GEMM waits for
        if row_index is not None:  # each tile's rows, counted the plain way
            host = torch.bincount(torch.tensor(host_tiles(offsets, BLOCK_M), dtype=torch.int64),
                                  minlength=tiles)
            assert expects[q].tolist() == host.tolist()


def test_tiles_as_the_kernel_numbers_them():
    """Expert after expert, ceil(rows / block_m) tiles each (none for an empty expert), then the
    rows past the last offset (as grouped_gemm.expert_of_tile: test_experts_of_tiles)."""
    offsets = torch.tensor([0, 17, 17, 40, 41], dtype=torch.int32)
    table = torch.zeros(moe_routes.table_words(1, 45), dtype=torch.int32)
    expect = torch.zeros(8, dtype=torch.int32)
    moe_routes.publish(table, [45], [45], None, offsets, 16, expect)
    words = moe_routes.split_words(1)
    assert table[:words].tolist() == [0, 45]  # my senders' starts, my rows' ends
    assert table[words:words + 45].tolist() == list(range(45))
    tiles = table[words + 45:].tolist()
    assert tiles == [0] * 16 + [1] + [2] * 16 + [3] * 7 + [4] + [5] * 4
    assert expect.tolist() == [16, 1, 16, 7, 1, 4, 0, 0]


def test_a_repeated_row_index_entry_leaves_a_row_unsent():
    """Not a permutation: received row 2 is claimed twice, row 1 by none: row 1 is not sent
    (its route of an earlier call overwritten by the publish's copy) and its tile is one row
    short of what the receiver expects."""
    table = torch.ones(moe_routes.table_words(1, 4), dtype=torch.int32)  # an earlier call's
    expect = torch.zeros(3, dtype=torch.int32)
    moe_routes.publish(table, [4], [4], torch.tensor([0, 2, 2, 3]),
                       torch.tensor([4], dtype=torch.int32), 4, expect)
    x = torch.arange(4, dtype=torch.float32)[:, None]
    recv, counts = torch.full((4, 1), -1.0), torch.zeros(3, dtype=torch.int32)
    moe_routes.put_rows(x, addresses([table]), addresses([recv]), addresses([counts]), 0, 1, 4,
                        expert_major=True)
    assert not (recv == 1).any()
    assert expect.tolist() == [4, 0, 0] and counts.tolist() == [3, 0, 0]


@pytest.mark.parametrize("indexed", [False, True])
def test_combine_puts_rows_at_the_receivers_rank_major_positions(indexed):
    """The combine's routes (no expert-major table): rank p's row i to rank q goes to q's
    start for p plus i's index among p's rows to q, counted in q's word for p; indexed, x's
    rows are in another order and send_index names each one's send row."""
    world, sends = 3, [[2, 0, 3], [1, 4, 0], [0, 2, 2]]  # sends[p][q]: rows p sends q
    tables = [torch.zeros(moe_routes.split_words(world), dtype=torch.int32) for _ in sends]
    for q, table in enumerate(tables):
        moe_routes.publish_splits(table, [sends[p][q] for p in range(world)], sends[q])
    received = [sum(sends[p][q] for p in range(world)) for q in range(world)]
    recv = [torch.full((n, 1), -1.0) for n in received]
    arrived = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]  # [q][p]
    xs = [(100 * p + torch.arange(sum(sends[p]), dtype=torch.float32))[:, None]
          for p in range(world)]
    for p in range(world):
        count_table = torch.tensor([a[p:].data_ptr() for a in arrived], dtype=torch.int64)
        x, send_index = xs[p], None
        if indexed:
            send_index = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(p))
            x = x[send_index]
        moe_routes.put_rows(x, addresses(tables), addresses(recv), count_table, p, world, 0,
                            expert_major=False, send_index=send_index)
    for q in range(world):
        assert torch.equal(recv[q], reference_received(world, xs, sends, q))
        assert arrived[q].tolist() == [sends[p][q] for p in range(world)]
