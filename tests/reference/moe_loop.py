"""The MoE layer as a per-token loop in float64: the ground truth of the accuracy tests.

No rounding to bf16 anywhere after the inputs, no batching, no tricks: the formulas of
docs/design.md §2 token by token, differentiated by autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F64 = torch.float64


def _bf16_straight_through(t: torch.Tensor) -> torch.Tensor:
    return t + (t.to(torch.bfloat16).to(F64) - t).detach()


def swiglu64(a: torch.Tensor, b: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        # The clamp is a discontinuity of the gradient. The layer stores a and b in bf16 and
        # decides "clamped or not" on those values; so does the reference, or one element
        # that rounds onto the limit flips a gradient entry and dominates the comparison.
        a, b = _bf16_straight_through(a), _bf16_straight_through(b)
        a = a.clamp(max=limit)
        b = b.clamp(-limit, limit)
    return torch.nn.functional.silu(a) * b


def expert64(
    x_H: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, limit: float | None
) -> torch.Tensor:
    return wd @ swiglu64(wg @ x_H, wu @ x_H, limit)


@dataclass
class LoopResult:
    y: torch.Tensor
    dx: torch.Tensor
    d_router_weights: torch.Tensor
    d_routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    d_shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def moe_loop(
    x_TH: torch.Tensor,
    top_experts_TK: torch.Tensor,
    router_weights_TK: torch.Tensor,
    routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    dy_TH: torch.Tensor,
    limit: float | None = None,
) -> LoopResult:
    """y and every gradient in float64; routed weights are the global [E, ...] tensors."""
    x = x_TH.to(F64).requires_grad_()
    w = router_weights_TK.to(F64).requires_grad_()
    rw = [t.to(F64).requires_grad_() for t in routed]
    sw = None if shared is None else [t.to(F64).requires_grad_() for t in shared]
    rows = []
    for t in range(x.shape[0]):
        acc = expert64(x[t], *sw, limit) if sw is not None else torch.zeros(x.shape[1], dtype=F64)
        for k in range(top_experts_TK.shape[1]):
            e = int(top_experts_TK[t, k])
            acc = acc + w[t, k] * expert64(x[t], rw[0][e], rw[1][e], rw[2][e], limit)
        rows.append(acc)
    y = torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=F64)
    y.backward(dy_TH.to(F64))
    zero = lambda p: p.grad if p.grad is not None else torch.zeros_like(p)  # noqa: E731
    return LoopResult(
        y.detach(),
        zero(x),
        zero(w),
        tuple(zero(p) for p in rw),  # type: ignore[arg-type]
        None if sw is None else tuple(zero(p) for p in sw),  # type: ignore[arg-type]
    )
