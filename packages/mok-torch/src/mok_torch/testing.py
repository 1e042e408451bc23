"""Routing and input generators shared by the tests, the benchmarks and the demo.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROUTINGS = ("balanced", "skewed", "worst", "sparse")


def _zipf_exponent(num_experts: int, hot_over_mean: float) -> float:
    """Exponent a of p_e ~ (e+1)^-a with p_0 * E = hot_over_mean (bisection)."""
    lo, hi = 0.0, 8.0
    for _ in range(60):
        a = (lo + hi) / 2
        weights = [(e + 1) ** -a for e in range(num_experts)]
        if weights[0] / sum(weights) * num_experts < hot_over_mean:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def make_routing(
    num_tokens: int,
    num_experts: int,
    topk: int,
    kind: str = "balanced",
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_experts [T, K] int64, router_weights [T, K] fp32) on the CPU.

    balanced: top-K of the softmax of random logits (weights renormalised over K).
    skewed: experts drawn without replacement from a Zipf law whose hottest expert gets
        about 8x the mean load.
    worst: every token routed to experts 0..K-1 (one rank's experts take everything).
    sparse: only the first max(K, E/4) experts are ever chosen (the others stay empty).
    """
    if kind not in ROUTINGS:
        raise ValueError(f"kind must be one of {ROUTINGS}, got {kind!r}")
    if topk > num_experts:
        raise ValueError(f"topk ({topk}) must be <= num_experts ({num_experts})")
    g = generator
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if kind == "skewed":
        a = _zipf_exponent(num_experts, 8.0)
        log_p = torch.tensor([-a * math.log(e + 1) for e in range(num_experts)])
        gumbel = -torch.log(-torch.log(torch.rand(num_tokens, num_experts, generator=g).clamp(1e-9, 1 - 1e-9)))
        top = torch.sort(log_p + gumbel, dim=-1, descending=True, stable=True).indices[:, :topk]
    elif kind == "worst":
        top = torch.arange(topk).expand(num_tokens, topk).clone()
    elif kind == "sparse":
        used = max(topk, num_experts // 4)
        top = torch.sort(logits[:, :used], dim=-1, descending=True, stable=True).indices[:, :topk]
    else:
        top = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :topk]
    top = top.contiguous()
    weights = torch.softmax(logits.gather(1, top), dim=-1)
    return top, weights


@dataclass
class LayerInputs:
    """One layer call's inputs, global view (all E experts), on the CPU."""

    x_TH: torch.Tensor  # bf16
    top_experts_TK: torch.Tensor  # int64
    router_weights_TK: torch.Tensor  # fp32
    routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # bf16 [E, I, H], [E, I, H], [E, H, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    dy_TH: torch.Tensor  # bf16

    def local_routed(self, rank: int, world: int) -> tuple[torch.Tensor, ...]:
        El = self.routed[0].shape[0] // world
        return tuple(w[rank * El : (rank + 1) * El].contiguous() for w in self.routed)

    def to(self, device: torch.device | str) -> LayerInputs:
        def three(ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return ws[0].to(device), ws[1].to(device), ws[2].to(device)

        return LayerInputs(
            self.x_TH.to(device),
            self.top_experts_TK.to(device),
            self.router_weights_TK.to(device),
            three(self.routed),
            None if self.shared is None else three(self.shared),
            self.dy_TH.to(device),
        )


def make_inputs(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    topk: int,
    shared_intermediate_size: int = 0,
    routing: str = "balanced",
    seed: int = 0,
) -> LayerInputs:
    """Random bf16 inputs scaled so activations stay O(1) through the layer."""
    g = torch.Generator().manual_seed(seed)
    H, I, E, Is = hidden_size, intermediate_size, num_experts, shared_intermediate_size

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(torch.bfloat16)

    x = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    top, weights = make_routing(num_tokens, E, topk, routing, generator=g)
    routed = (rnd(E, I, H, fan_in=H), rnd(E, I, H, fan_in=H), rnd(E, H, I, fan_in=I))
    shared = (rnd(Is, H, fan_in=H), rnd(Is, H, fan_in=H), rnd(H, Is, fan_in=Is)) if Is else None
    dy = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    return LayerInputs(x, top, weights, routed, shared, dy)
