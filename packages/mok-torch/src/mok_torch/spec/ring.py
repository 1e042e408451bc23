"""The ring walk (docs/design.md §8), of every backend, and row blocks.

Rows of the schedule table are processed in minibatches, grouped into macrobatches; the
routed activation buffers (the ring) hold one macrobatch. Forward walks macrobatches from
last to first, so the ring ends holding macrobatch 0, the saved context; backward walks
first to last and replays the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MoKConfig, resolve_batching
from ..structs import Schedule
from ..workspace import Workspace


@dataclass(frozen=True)
class RingPlan:
    num_rows: int  # rows of the table in use (the end of the last segment)
    macrobatch: int  # ring rows
    minibatch: int
    # segment starts of the local experts, then num_rows; None where they stay on the device (the
    # GPU walks every row of the capacity)
    offsets: tuple[int, ...] | None

    def macrobatches(self) -> list[tuple[int, int]]:
        return [(lo, min(lo + self.macrobatch, self.num_rows)) for lo in range(0, self.num_rows, self.macrobatch)]

    def minibatches(self, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(m, min(m + self.minibatch, hi)) for m in range(lo, hi, self.minibatch)]

    @property
    def ring_rows(self) -> int:
        return min(self.macrobatch, self.num_rows)

    def block(self, lo: int, hi: int, device: torch.device) -> Block:
        """Table rows [lo, hi) as a Block (a plan with host offsets)."""
        if self.offsets is None:
            raise RuntimeError("this ring plan keeps the segment offsets on the device")
        return Block(self.offsets, lo, hi, device)


def plan_ring(cfg: MoKConfig, ws: Workspace, sched: Schedule, intermediate_size: int) -> RingPlan:
    offsets = tuple(sched.expert_offsets_El1.tolist())  # the reference reads the table on the host
    num_rows = offsets[-1]
    minibatch, macrobatch = resolve_batching(cfg, ws.hidden_size, intermediate_size, ws.num_sms)
    if macrobatch is None:
        macrobatch = max(num_rows, 1)
    return RingPlan(num_rows=num_rows, macrobatch=macrobatch, minibatch=minibatch, offsets=offsets)


def replays_in_backward(cfg: MoKConfig, ws: Workspace) -> bool:
    """Whether any rank's ring can be smaller than its rows, which makes backward re-pull x.

    Decided from values every rank shares, so all ranks join the same collectives.
    """
    return cfg.macrobatch_size is not None and cfg.macrobatch_size < ws.capacity


class Block:
    """Table rows [lo, hi) as an [n, L] grid: experts first..last-1, each padded to L rows."""

    def __init__(self, offsets: tuple[int, ...], lo: int, hi: int, device: torch.device) -> None:
        num_experts = len(offsets) - 1
        self.first = next(e for e in range(num_experts) if offsets[e + 1] > lo)
        self.last = next((e for e in range(self.first, num_experts) if offsets[e] >= hi), num_experts)
        spans = [(max(lo, offsets[e]), min(hi, offsets[e + 1])) for e in range(self.first, self.last)]
        width = max(max(t - s for s, t in spans), 0)
        index = torch.full((len(spans), width), -1, dtype=torch.int64)
        for i, (s, t) in enumerate(spans):
            if t > s:
                index[i, : t - s] = torch.arange(s, t)
        self.index = index.to(device)
        self.mask = self.index >= 0

    def gather(self, rows: torch.Tensor, base: int = 0) -> torch.Tensor:
        """rows[index - base] as [n, L, ...], zero where the grid is padding."""
        g = rows[(self.index - base).clamp(min=0)]
        mask = self.mask.reshape(self.mask.shape + (1,) * (rows.dim() - 1))
        return torch.where(mask, g, torch.zeros_like(g))

    def scatter(self, values: torch.Tensor, out: torch.Tensor, base: int = 0) -> None:
        """out[index - base] = values, for the grid cells that are real rows."""
        out[self.index[self.mask] - base] = values[self.mask]
