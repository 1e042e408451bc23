"""The values that pass between the calls of the functional API.

Shape letters: docs/design.md §1 (M: the rows of macrobatch 0, which the context keeps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .workspace import Workspace


@dataclass(frozen=True, eq=False)
class Schedule:
    """The schedule table (docs/design.md §6) for one call, plus what the source side needs.

    Expert side (the rows this rank's experts process, on the device):
        row_src_rank_C: source rank of each row, -1 for padding rows.
        row_route_C: route index t*K + k on the source rank, -1 for padding rows.
        expert_offsets_El1: start row of each local expert's segment (a multiple of the
            expert alignment); the last entry is the number of rows in use.
        expert_counts_El: real (non-padding) rows of each local expert.
        recv_counts_R: real rows that come from each source rank.
    Source side (this rank's own routes):
        top_experts_TK: the routes, as given (int32).
        send_order_TK: this rank's route indices t*K + k in the order the expert ranks list
            them, i.e. sorted by (expert, t, k).
        send_counts_R: routes from this rank to each rank's experts.
        route_rank_TK: the rank of each route's expert (int32 [T*K], route t*K + k).
        route_row_TK: each route's row in that rank's table (int32 [T*K]): where a push
            dispatch writes the route's input and a pull combine reads its output.
        tokens_per_rank_R: T of every rank of the group.
    At one rank mok.moe's call makes a LazySendSide: the send side (SEND_SIDE) is issued at its
    first read.

    Rows of one expert are in global token order (source rank, t, k), so the same expert
    sees the same rows in the same order at every expert-parallel size.
    """

    workspace: Workspace
    backend: str
    top_experts_TK: torch.Tensor
    tokens_per_rank_R: torch.Tensor
    row_src_rank_C: torch.Tensor
    row_route_C: torch.Tensor
    expert_offsets_El1: torch.Tensor
    expert_counts_El: torch.Tensor
    recv_counts_R: torch.Tensor
    send_order_TK: torch.Tensor
    send_counts_R: torch.Tensor
    route_rank_TK: torch.Tensor
    route_row_TK: torch.Tensor
    # Index arrays a backend derives from the table, computed once per schedule.
    aux: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.top_experts_TK.shape[0]

    @property
    def topk(self) -> int:
        return self.top_experts_TK.shape[1]


# The send side: what only this rank's row moves read (docs/design.md §6).
SEND_SIDE = ("send_order_TK", "send_counts_R", "route_rank_TK")
# Schedule.aux's key of a send side not yet issued (LazySendSide).
PENDING_SEND_SIDE = "pending_send_side"


def _issued_at_first_read(name: str) -> property:
    def read(self: Schedule) -> torch.Tensor:
        issue = self.aux.pop(PENDING_SEND_SIDE, None)
        if issue is not None:
            issue(self)  # sets every field of SEND_SIDE
        return self.__dict__[name]

    def write(self: Schedule, value: torch.Tensor | None) -> None:  # the dataclass's __init__, the issue
        self.__dict__[name] = value

    return property(read, write, doc=f"{name}, issued at the first read of the send side")


class LazySendSide(Schedule):
    """A Schedule whose send side (SEND_SIDE) is issued on the device at its first read, not with
    the table: at one rank mok.moe's forward, its direct backward and a forward that no backward
    follows read none of it (only the row moves of the other paths do), so a call that never reads
    it issues none of its kernels and none of its host work. `aux[PENDING_SEND_SIDE]` is the issue,
    a function of the Schedule that sets the three fields; it reads `top_experts_TK`, which is then
    the schedule's own int32 copy of the routes (made with the table), so that routes rewritten by
    the caller after the call do not change it. Constructed with None in those three fields."""

    send_order_TK = _issued_at_first_read("send_order_TK")  # type: ignore[assignment]
    send_counts_R = _issued_at_first_read("send_counts_R")  # type: ignore[assignment]
    route_rank_TK = _issued_at_first_read("route_rank_TK")  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What the forward pass keeps for the backward pass (docs/design.md §2, §8).

    Only macrobatch 0 of the routed rows is kept (the ring ends holding it); the backward
    pass replays the others. Nothing of size rows x H is kept beyond `x_routed_MH`.

        x_routed_MH: routed input rows of macrobatch 0 (bf16), or None where the backward reads
            them by route from the layer's input itself (the native backend's one-call lane).
        a_MI, b_MI: gate and up pre-activations of those rows (bf16).
        shared_a_TIs, shared_b_TIs: the shared expert's pre-activations (None without one).
    """

    schedule: Schedule
    backend: str
    x_routed_MH: torch.Tensor | None
    a_MI: torch.Tensor
    b_MI: torch.Tensor
    shared_a_TIs: torch.Tensor | None
    shared_b_TIs: torch.Tensor | None

    def routed_x(self) -> torch.Tensor:
        """x_routed_MH, for a backward that reads the saved rows (every backward but the native
        backend's one-call lane, which the forward that keeps none chose for this context)."""
        if self.x_routed_MH is None:
            raise ValueError(
                "this context keeps no routed x rows (its forward left them to the one-call backward's "
                "gather): run its backward with the config and workspace of its forward"
            )
        return self.x_routed_MH

    def saved_bytes(self) -> int:
        """Bytes of saved activations this context holds."""
        tensors = [self.x_routed_MH, self.a_MI, self.b_MI, self.shared_a_TIs, self.shared_b_TIs]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Grads(NamedTuple):
    """Gradients of one layer call.

    dx: [T, H]; d_router_weights: [T, K]; d_routed: (dWg, dWu, dWd) of this rank's experts;
    d_shared: (dWg_s, dWu_s, dWd_s) or None.
    """

    dx: torch.Tensor
    d_router_weights: torch.Tensor
    d_routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    d_shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
