"""Row transport of the reference backend, over torch.distributed collectives.

The directions are those of docs/design.md §7: the rank that owns an expert *pulls* the input
row of every route in its table (forward x, backward dy and the router weight), and
*pushes* every output row back to the source rank, into one slot per route (t*K + k), so
nothing is summed in flight. Here a pull or a push is one `all_to_all_single` whose split
sizes the host reads; the compiled backends do the same moves over symmetric memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...agreement import bounded
from ...structs import Schedule


def _received_rows(sched: Schedule) -> torch.Tensor:
    """Table rows in the order the collective delivers them: by source rank, then table order."""
    cached = sched.aux.get("received_rows")
    if cached is None:
        ws = sched.workspace
        src = sched.row_src_rank_C.to(torch.int64)
        key = torch.where(src >= 0, src, torch.full_like(src, ws.world_size))
        order = torch.sort(key, stable=True).indices
        cached = order[: int(sched.recv_counts_R.sum())]
        sched.aux["received_rows"] = cached
    return cached


def _exchange(sched: Schedule, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    ws = sched.workspace
    if ws.world_size == 1:
        return send
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    send = send.contiguous()
    issue = lambda: dist.all_to_all_single(recv, send, recv_counts, send_counts, group=ws.group, async_op=True)  # noqa: E731
    bounded(issue, "moving rows across the group", ws.state.get("timeout_s", 300.0), ws)
    return recv


def pull(sched: Schedule, values: torch.Tensor, *, per_route: bool = False) -> torch.Tensor:
    """Rows of the schedule table gathered from the source ranks: [C, ...], padding rows zero.

    values: this rank's per-token rows [T, ...] (x, dy), or per-route values [T*K, ...]
    (router weights) when `per_route` is set.
    """
    ws = sched.workspace
    order = sched.send_order_TK if per_route else torch.div(sched.send_order_TK, sched.topk, rounding_mode="floor")
    recv = _exchange(sched, values[order], sched.send_counts_R.tolist(), sched.recv_counts_R.tolist())
    out = values.new_zeros((ws.capacity,) + tuple(values.shape[1:]))
    out[_received_rows(sched)] = recv
    return out


def push(sched: Schedule, rows: torch.Tensor) -> torch.Tensor:
    """Per-row results [C, ...] sent back to their source ranks: [T*K, ...] in route order."""
    send = rows[_received_rows(sched)]
    recv = _exchange(sched, send, sched.recv_counts_R.tolist(), sched.send_counts_R.tolist())
    out = rows.new_empty((sched.num_tokens * sched.topk,) + tuple(rows.shape[1:]))
    out[sched.send_order_TK] = recv
    return out
