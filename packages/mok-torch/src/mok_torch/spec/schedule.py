"""The schedule table (docs/design.md §6), built with integer tensor ops only: the definition.

`table_from_routes` is the definition every other builder (the C++ CPU one, the CUDA
kernels) is tested against bitwise. It needs no host synchronisation: counts come from
searches in a stable sort, offsets from prefix sums, rows from one scatter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Table(NamedTuple):
    row_src_rank_C: torch.Tensor  # int32, -1 = padding
    row_route_C: torch.Tensor  # int32, t*K + k, -1 = padding
    expert_offsets_El1: torch.Tensor  # int32
    expert_counts_El: torch.Tensor  # int32
    recv_counts_R: torch.Tensor  # int64


def table_from_routes(
    routes_RTK: torch.Tensor,
    tokens_per_rank_R: torch.Tensor,
    *,
    rank: int,
    num_local_experts: int,
    alignment: int,
    capacity: int,
) -> Table:
    """Schedule table of `rank` from every rank's routes.

    routes_RTK: [R, Tmax, K] global expert ids; rows t >= tokens_per_rank_R[s] are ignored.
    Rows of each local expert are in (source rank, t, k) order; each expert's segment starts
    at a multiple of `alignment`; rows past the last segment and padding rows are -1.
    """
    R, Tmax, K = routes_RTK.shape
    El = num_local_experts
    dev = routes_RTK.device
    n = R * Tmax * K
    experts = routes_RTK.reshape(-1).to(torch.int64)
    src = torch.arange(R, device=dev).repeat_interleave(Tmax * K)
    route = torch.arange(Tmax * K, device=dev).repeat(R)
    valid = (route // K) < tokens_per_rank_R.to(dev, torch.int64)[src]
    local = experts - rank * El
    mine = valid & (local >= 0) & (local < El)
    # Routes to other ranks sort after every local expert (key El).
    key = torch.where(mine, local, torch.full_like(local, El))
    order = torch.sort(key, stable=True).indices
    key_sorted = key[order]
    group_start = torch.searchsorted(key_sorted, torch.arange(El + 1, device=dev))
    counts = group_start[1:] - group_start[:-1]
    aligned = (counts + alignment - 1) // alignment * alignment
    offsets = torch.zeros(El + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(aligned, 0)
    pos_in_expert = torch.arange(n, device=dev) - group_start[key_sorted.clamp(max=El - 1)]
    dest = torch.where(
        key_sorted < El,
        offsets[key_sorted.clamp(max=El - 1)] + pos_in_expert,
        torch.full_like(key_sorted, capacity),  # a spare slot, dropped below
    )
    row_src = torch.full((capacity + 1,), -1, dtype=torch.int32, device=dev)
    row_route = torch.full((capacity + 1,), -1, dtype=torch.int32, device=dev)
    row_src[dest] = src[order].to(torch.int32)
    row_route[dest] = route[order].to(torch.int32)
    row_src[capacity] = -1
    row_route[capacity] = -1
    recv_counts = mine.reshape(R, Tmax * K).sum(1)
    return Table(
        row_src[:capacity],
        row_route[:capacity],
        offsets.to(torch.int32),
        counts.to(torch.int32),
        recv_counts,
    )


def send_side(
    top_experts_TK: torch.Tensor, num_local_experts: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(send_order, send_counts): this rank's routes sorted by (expert, t, k), and per-rank counts."""
    keys = top_experts_TK.reshape(-1).to(torch.int64)
    order = torch.sort(keys, stable=True).indices
    bounds = torch.arange(world_size + 1, device=keys.device) * num_local_experts
    edges = torch.searchsorted(keys[order], bounds)
    return order, edges[1:] - edges[:-1]


def route_rows(
    routes_RTK: torch.Tensor,
    tokens_per_rank_R: torch.Tensor,
    *,
    rank: int,
    num_tokens: int,
    num_local_experts: int,
    alignment: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, row) of each route of `rank`: its expert's rank and its row in that rank's table.

    The row is what `table_from_routes` gives the route on the expert's rank: the expert's
    segment start (aligned counts of the rank's earlier experts), plus the routes to the same
    expert from lower source ranks, plus this rank's earlier routes to it. int32 [T*K] each,
    T = num_tokens (this rank's, = tokens_per_rank_R[rank]).
    """
    R, Tmax, K = routes_RTK.shape
    El = num_local_experts
    E = R * El
    dev = routes_RTK.device
    tokens = tokens_per_rank_R.to(dev, torch.int64)
    valid = torch.arange(Tmax, device=dev)[None, :] < tokens[:, None]  # [R, Tmax]
    experts = routes_RTK.to(torch.int64)
    ok = valid[:, :, None] & (experts >= 0) & (experts < E)
    flat = torch.where(ok, experts, torch.full_like(experts, E)).reshape(R, Tmax * K)
    counts = torch.zeros(R, E + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    counts = counts[:, :E]  # [source rank, expert]
    aligned = (counts.sum(0) + alignment - 1) // alignment * alignment
    starts = (torch.cumsum(aligned.view(R, El), 1) - aligned.view(R, El)).reshape(E)  # segment starts
    before = torch.cumsum(counts, 0) - counts  # routes from lower source ranks
    mine = experts[rank, :num_tokens].reshape(-1)  # this rank's routes (valid ids: checked by the API)
    order = torch.sort(mine, stable=True).indices
    sorted_ids = mine[order]
    first = torch.searchsorted(sorted_ids, sorted_ids)  # first route of each id in sorted order
    within = torch.empty_like(mine)
    within[order] = torch.arange(mine.numel(), device=dev) - first
    row = starts[mine] + before[rank, mine] + within
    return (mine // El).to(torch.int32), row.to(torch.int32)
