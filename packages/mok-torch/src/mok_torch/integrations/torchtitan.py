"""A torchtitan-style token dispatcher over mok's schedule and transport.

Code written against torchtitan's expert-parallel interface calls

    routed_input, tokens_per_local_expert = dispatcher.dispatch(routed_input, num_tokens_per_expert)
    routed_output = experts(routed_input, tokens_per_local_expert)
    routed_output = dispatcher.combine(routed_output)

where `routed_input` [N, H] holds this rank's routes sorted by global expert id (stable,
so each expert's rows are in token order) and `num_tokens_per_expert` [E] counts them. The
dispatcher hands each rank the rows of its local experts, expert-major, each expert's rows
in global token order (source rank, then the source's order) and padded with zero rows to
`config.expert_alignment`; `combine` returns the rows to their sources in the input's order.
Both are differentiable (the adjoint of a pull is a push of the same rows and vice versa).

`MoKExpertParallel` adds the method names torchtitan's `ExpertParallel` uses
(`_token_dispatch(mod, inputs, device_mesh)` / `_token_combine(mod, routed_output,
device_mesh)`), for code that calls those directly.

Shape letters: N routes on this rank, H hidden, E experts, El local experts, C capacity,
M rows handed to the local experts (sum of the padded counts).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import functional
from ..autograd import agree_max_tokens
from ..backends.reference import transport
from ..config import MoKConfig
from ..structs import Schedule
from ..validation import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from ..workspace import get_workspace, group_rank_and_size


class _Pull(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows_NH: torch.Tensor, sched: Schedule) -> torch.Tensor:  # type: ignore[override]
        ctx.sched = sched
        return transport.pull(sched, rows_NH, per_route=True)

    @staticmethod
    def backward(ctx: Any, grad_CH: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return transport.push(ctx.sched, grad_CH.contiguous()), None


class _Push(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows_CH: torch.Tensor, sched: Schedule) -> torch.Tensor:  # type: ignore[override]
        ctx.sched = sched
        return transport.push(sched, rows_CH)

    @staticmethod
    def backward(ctx: Any, grad_NH: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return transport.pull(ctx.sched, grad_NH.contiguous(), per_route=True), None


class MoKTokenDispatcher:
    """dispatch / combine of routed rows across the expert-parallel `group`.

    One dispatcher serves one dispatch/combine pair at a time (it keeps the schedule of the
    last dispatch for the combine), like torchtitan's ExpertParallel.
    """

    def __init__(self, group: Any = None, config: MoKConfig | None = None) -> None:
        self.group = group
        self.config = MoKConfig() if config is None else config
        self._schedule: Schedule | None = None
        self._num_rows = 0

    def dispatch(
        self, routed_input_NH: torch.Tensor, num_tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [M, H] of this rank's experts, padded rows per local expert [El])."""
        check_tensor("routed_input", routed_input_NH, dtypes=FLOAT_DTYPES, shape=[("N", None), ("H", None)])
        N, H = routed_input_NH.shape
        dev = routed_input_NH.device
        counts = check_tensor(
            "num_tokens_per_expert", num_tokens_per_expert_E, dtypes=INDEX_DTYPES, shape=[("E", None)], device=dev
        )
        if int(counts.sum()) != N or bool((counts < 0).any()):
            raise ValueError(f"num_tokens_per_expert must be >= 0 and sum to the rows of routed_input ({N})")
        E = counts.shape[0]
        # Each row is one route: a "token" with K = 1 whose expert is known from the counts.
        experts_N1 = torch.repeat_interleave(torch.arange(E, device=dev), counts.to(torch.int64))[:, None]
        max_rows = agree_max_tokens(N, self.group, dev, self.config.timeout_s)
        ws = get_workspace(
            self.config, self.group, device=dev, max_tokens=max_rows, hidden_size=H, topk=1, num_experts=E
        )
        sched = functional.build_schedule(ws, self.config, experts_N1)
        offsets = sched.expert_offsets_El1
        self._schedule, self._num_rows = sched, int(offsets[-1])
        rows_CH = _Pull.apply(routed_input_NH, sched)
        return rows_CH[: self._num_rows], (offsets[1:] - offsets[:-1]).to(torch.int64)

    def combine(self, routed_output_MH: torch.Tensor) -> torch.Tensor:
        """The local experts' output rows [M, H] back to their sources: [N, H] in dispatch order."""
        if self._schedule is None:
            raise ValueError("combine() needs a dispatch() first")
        sched, M = self._schedule, self._num_rows
        check_tensor("routed_output", routed_output_MH, dtypes=FLOAT_DTYPES, shape=[("M", M), ("H", None)])
        C = sched.workspace.capacity
        padded = torch.nn.functional.pad(routed_output_MH, (0, 0, 0, C - M))
        self._schedule = None
        return _Push.apply(padded, sched)


class MoKExpertParallel(MoKTokenDispatcher):
    """The dispatcher under torchtitan ExpertParallel's method names."""

    def _token_dispatch(self, mod: Any, inputs: tuple[torch.Tensor, torch.Tensor], device_mesh: Any) -> Any:
        if device_mesh is not None and self.group is None:
            self.group = device_mesh.get_group()
        if self.group is not None:
            group_rank_and_size(self.group)  # fails clearly if torch.distributed is not initialised
        return self.dispatch(*inputs)

    def _token_combine(self, mod: Any, routed_output: torch.Tensor, device_mesh: Any) -> torch.Tensor:
        return self.combine(routed_output)
