"""One rank's inputs of a benchmarked layer call, made on its device.

Shape letters: docs/design.md §1.

Activations and weights are random bf16 scaled by 1/sqrt(fan_in) as in
`mok_torch.testing.make_inputs` (never zeros: a zero operand would flatter a GEMM), drawn
on the device from a generator seeded per (shape, rank). The routing comes from
`mok_torch.testing.make_routing` over all E experts, seeded per (shape, rank), so each
rank's slice of the global batch is fixed whatever the provider.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..testing import make_routing
from .shapes import Shape
from .timing import Ranks

Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def case_seed(shape: Shape, rank: int) -> int:
    return zlib.crc32(f"{shape.name}/{rank}".encode()) & 0x7FFFFFFF


@dataclass
class Weights:
    """This rank's expert weights (leaves that take gradients), x and dy of one shape."""

    x_TH: torch.Tensor  # bf16
    dy_TH: torch.Tensor  # bf16
    routed: Weights3  # bf16 [El, I, H], [El, I, H], [El, H, I]
    shared: Weights3 | None  # bf16 [Is, H], [Is, H], [H, Is]


def make_weights(shape: Shape, ranks: Ranks) -> Weights:
    dev = ranks.device
    g = torch.Generator(device=dev).manual_seed(case_seed(shape, ranks.rank))
    T, H, I, Is, El = shape.tokens, shape.hidden, shape.inner, shape.shared_inner, shape.local_experts

    def rnd(*size: int, fan_in: int = 1, grad: bool = True) -> torch.Tensor:
        # Drawn in bf16 directly: an fp32 draw of a large model's experts would not fit beside them.
        t = torch.randn(*size, generator=g, device=dev, dtype=torch.bfloat16)
        if fan_in != 1:
            t.mul_(1.0 / math.sqrt(fan_in))
        return t.requires_grad_(grad)

    routed = (rnd(El, I, H, fan_in=H), rnd(El, I, H, fan_in=H), rnd(El, H, I, fan_in=I))
    shared = (rnd(Is, H, fan_in=H), rnd(Is, H, fan_in=H), rnd(H, Is, fan_in=Is)) if Is else None
    return Weights(x_TH=rnd(T, H), dy_TH=rnd(T, H, grad=False), routed=routed, shared=shared)


@dataclass
class LayerCall:
    """Everything one layer call takes, on this rank's device.

    x_TH, router_weights_TK and the weights are leaves: their .grad is what backward gives.
    A provider that runs on weights of its own (SonicMoE's, in its layout) adds them to
    `extra_leaves`: inputs like the call's, their gradients dropped, compared and left out of
    the saved activations with the call's own.
    """

    shape: Shape
    routing: str
    x_TH: torch.Tensor
    top_experts_TK: torch.Tensor  # int64 global expert ids
    router_weights_TK: torch.Tensor  # fp32
    routed: Weights3
    shared: Weights3 | None
    dy_TH: torch.Tensor
    extra_leaves: list[torch.Tensor] = field(default_factory=list)

    def leaves(self) -> list[torch.Tensor]:
        return [self.x_TH, self.router_weights_TK, *self.routed, *(self.shared or ()), *self.extra_leaves]

    def drop_grads(self) -> None:
        for t in self.leaves():
            t.grad = None

    def grads(self) -> list[torch.Tensor | None]:
        return [t.grad for t in self.leaves()]


def make_call(shape: Shape, routing: str, weights: Weights, ranks: Ranks) -> LayerCall:
    g = torch.Generator().manual_seed(case_seed(shape, ranks.rank))
    top, router_weights = make_routing(shape.tokens, shape.experts, shape.topk, routing, generator=g)
    return LayerCall(
        shape=shape,
        routing=routing,
        x_TH=weights.x_TH,
        top_experts_TK=top.to(ranks.device),
        router_weights_TK=router_weights.to(ranks.device).requires_grad_(),
        routed=weights.routed,
        shared=weights.shared,
        dy_TH=weights.dy_TH,
    )


def route_counts(call: LayerCall, world: int) -> tuple[list[float], list[float]]:
    """(routes, tokens) this rank sends to each rank's experts: the rows of R x R matrices."""
    dest_TK = call.top_experts_TK // call.shape.local_experts
    routes = torch.bincount(dest_TK.flatten(), minlength=world)
    tokens = F.one_hot(dest_TK, world).amax(dim=1).sum(dim=0)
    return [float(v) for v in routes.tolist()], [float(v) for v in tokens.tolist()]
