"""The schedule table of docs/design.md §6 against a plain Python construction."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, config

import mok_torch as mok
from mok_torch.spec.schedule import route_rows, send_side, table_from_routes


def naive_table(routes, tokens, rank, El, align, capacity):
    R = routes.shape[0]
    rows_src, rows_route, offsets, counts = [], [], [0], []
    for e in range(rank * El, (rank + 1) * El):
        seg = [
            (s, t * routes.shape[2] + k)
            for s in range(R)
            for t in range(tokens[s])
            for k in range(routes.shape[2])
            if routes[s, t, k] == e
        ]
        counts.append(len(seg))
        pad = -len(seg) % align
        rows_src += [s for s, _ in seg] + [-1] * pad
        rows_route += [r for _, r in seg] + [-1] * pad
        offsets.append(len(rows_src))
    rows_src += [-1] * (capacity - len(rows_src))
    rows_route += [-1] * (capacity - len(rows_route))
    return rows_src, rows_route, offsets, counts


def random_routes(R, seed, El=3, K=2, Tmax=9):
    """(routes [R, Tmax, K], tokens [R]) of R ranks; rank 0 full, seed 1 with a hot expert."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, Tmax + 1, (R,), generator=g)
    tokens[0] = Tmax
    routes = torch.stack(
        [torch.stack([torch.randperm(El * R, generator=g)[:K] for _ in range(Tmax)]) for _ in range(R)]
    )
    if seed == 1:
        routes[:, :, 0] = 0  # a hot expert
    return routes, tokens


@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("align", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_table_matches_naive(R, align, seed):
    El, K, Tmax = 3, 2, 9
    routes, tokens = random_routes(R, seed, El, K, Tmax)
    capacity = mok.workspace.align_up(R * Tmax * K + El * (align - 1), align)
    for rank in range(R):
        got = table_from_routes(
            routes.to(DEVICE), tokens.to(DEVICE), rank=rank, num_local_experts=El, alignment=align, capacity=capacity
        )
        src, route, offsets, counts = naive_table(routes, tokens.tolist(), rank, El, align, capacity)
        assert got.row_src_rank_C.cpu().tolist() == src
        assert got.row_route_C.cpu().tolist() == route
        assert got.expert_offsets_El1.cpu().tolist() == offsets
        assert got.expert_counts_El.cpu().tolist() == counts
        assert got.row_src_rank_C.dtype == torch.int32 and got.row_route_C.dtype == torch.int32
        assert got.recv_counts_R.cpu().tolist() == [sum(1 for x in src if x == s) for s in range(R)]


@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("align", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_route_rows_point_at_their_table_rows(R, align, seed):
    """Every route's (rank, row) is the row that rank's table gives it: the address a push
    dispatch writes to and a pull combine reads from."""
    El, K, Tmax = 3, 2, 9
    routes, tokens = random_routes(R, seed, El, K, Tmax)
    capacity = mok.workspace.align_up(R * Tmax * K + El * (align - 1), align)
    tables = [
        table_from_routes(routes, tokens, rank=r, num_local_experts=El, alignment=align, capacity=capacity)
        for r in range(R)
    ]
    for s in range(R):
        T = int(tokens[s])
        rank, row = route_rows(routes, tokens, rank=s, num_tokens=T, num_local_experts=El, alignment=align)
        assert rank.dtype == torch.int32 and row.dtype == torch.int32 and rank.shape == (T * K,)
        assert rank.tolist() == (routes[s, :T].reshape(-1) // El).tolist()
        for j in range(T * K):
            table = tables[int(rank[j])]
            assert int(table.row_src_rank_C[row[j]]) == s and int(table.row_route_C[row[j]]) == j


def test_send_side_orders_by_expert_then_route():
    te = torch.tensor([[3, 0], [1, 3], [0, 2]])
    order, counts = send_side(te, num_local_experts=2, world_size=2)
    assert order.tolist() == [1, 4, 2, 5, 0, 3]  # experts 0,0,1,2,3,3
    assert counts.tolist() == [3, 3]


def test_every_route_has_exactly_one_row():
    te = torch.tensor([[1, 2], [2, 1], [0, 1], [1, 0], [3, 2]]).to(DEVICE)
    cfg = config(expert_alignment=4)
    ws = mok.get_workspace(cfg, None, device=DEVICE, max_tokens=5, hidden_size=8, topk=2, num_experts=4)
    sched = mok.build_schedule(ws, cfg, te)
    routes = sched.row_route_C[sched.row_route_C >= 0].cpu()
    assert sorted(routes.tolist()) == list(range(10))
    assert sched.expert_counts_El.tolist() == [2, 4, 3, 1]
    assert sched.expert_offsets_El1.tolist() == [0, 4, 8, 12, 16]
    assert ws.capacity >= 16 and sched.row_src_rank_C.shape == (ws.capacity,)
    # worst case: everything to one expert still fits the capacity
    worst = mok.build_schedule(ws, cfg, torch.tensor([[0, 1]] * 5, device=DEVICE))
    assert int(worst.expert_offsets_El1[-1]) <= ws.capacity
