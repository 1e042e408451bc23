"""The reference backend's schedule: every rank's routes gathered with torch collectives, then
the table, send side and route rows of `mok_torch.spec.schedule` (the definitions)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...agreement import bounded
from ...spec.schedule import route_rows, send_side, table_from_routes
from ...structs import Schedule
from ...workspace import Workspace


def _all_gather_routes(ws: Workspace, top_experts_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = top_experts_TK.shape
    if ws.world_size == 1:
        return top_experts_TK.reshape(1, T, K), torch.tensor([T], device=ws.device)
    tokens = torch.tensor([T], dtype=torch.int64, device=ws.device)
    tokens_all = [torch.empty_like(tokens) for _ in range(ws.world_size)]
    timeout_s = ws.state.get("timeout_s", 300.0)
    bounded(lambda: dist.all_gather(tokens_all, tokens, group=ws.group, async_op=True), "the schedule", timeout_s, ws)
    padded = torch.full((ws.max_tokens, K), -1, dtype=torch.int32, device=ws.device)
    padded[:T] = top_experts_TK
    routes_all = [torch.empty_like(padded) for _ in range(ws.world_size)]
    bounded(lambda: dist.all_gather(routes_all, padded, group=ws.group, async_op=True), "the schedule", timeout_s, ws)
    return torch.stack(routes_all), torch.cat(tokens_all)


def build_schedule(ws: Workspace, top_experts_TK: torch.Tensor) -> Schedule:
    top_experts_TK = top_experts_TK.to(torch.int32).contiguous()
    routes_RTK, tokens_R = _all_gather_routes(ws, top_experts_TK)
    table = table_from_routes(
        routes_RTK,
        tokens_R,
        rank=ws.rank,
        num_local_experts=ws.num_local_experts,
        alignment=ws.expert_alignment,
        capacity=ws.capacity,
    )
    send_order, send_counts = send_side(top_experts_TK, ws.num_local_experts, ws.world_size)
    route_rank, route_row = route_rows(
        routes_RTK, tokens_R, rank=ws.rank, num_tokens=top_experts_TK.shape[0],
        num_local_experts=ws.num_local_experts, alignment=ws.expert_alignment,
    )  # fmt: skip
    return Schedule(
        workspace=ws,
        backend="reference",
        top_experts_TK=top_experts_TK,
        tokens_per_rank_R=tokens_R,
        row_src_rank_C=table.row_src_rank_C,
        row_route_C=table.row_route_C,
        expert_offsets_El1=table.expert_offsets_El1,
        expert_counts_El=table.expert_counts_El,
        recv_counts_R=table.recv_counts_R,
        send_order_TK=send_order,
        send_counts_R=send_counts,
        route_rank_TK=route_rank,
        route_row_TK=route_row,
    )
