"""Flop counts and floors: the least work and traffic a layer call must have.

Shape letters: docs/design.md §1, and N_r: routes that land on rank r's experts (from every
rank, counted from the actual routing); P[s, d]: tokens of rank s with at least one route
to an expert of rank d (each such token must cross from s to d once).

Throughput is counted as the seed counts it (docs/benchmarks.md "Throughput"): forward
`6 * (T*Is/I + T*K) * H * I` flops, backward twice that, whatever the routing.

The floor of a call is `max(flops / matmul rate, HBM bytes / HBM rate, NVLink bytes /
NVLink rate)` on its most loaded rank, with the fewest bytes counted (bf16 = 2 bytes):

forward, rank r
    flops    6 * (N_r * I + T * Is) * H (the rows its experts really process)
    HBM      x read, y written (T*H each); routed weights El*3*I*H and shared 3*Is*H read
             once; the saved context written: routed rows x_routed, a, b (N_r * (H + 2I))
             and the shared a, b (T * 2Is); router weights (fp32) and expert ids (int32)
             read (T*K*4 each)
    NVLink   per direction: dispatch sends every token once to each other rank it routes
             to (sum_d!=r P[r, d] rows), combine brings one reduced row per such pair back
             (sum_s!=r P[s, r] rows out); in = out by symmetry. 0 at R = 1.
backward (added to the forward for "forward+backward")
    flops    twice the forward
    HBM      dy read, dx written (T*H each); weights read again and their gradients
             written (2 * (El*3*I*H + 3*Is*H)); the saved context read back; x read again
             for the shared expert's weight gradient (T*H, with a shared expert only);
             router-weight gradients written (T*K*4)
    NVLink   as the forward: dy goes out as x did, dx comes back as y did.

The combine is counted with rows reduced at the expert rank, which a bitwise-deterministic
layer may not do (mok sends one row per route): the floor stays a lower bound for any
implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .shapes import Shape

BF16_BYTES = 2
FP32_BYTES = 4
INDEX_BYTES = 4


def forward_flops(shape: Shape) -> int:
    """Seed-style forward flops of one rank: 2 flops x 3 GEMMs per routed row and shared token."""
    T, H, I, K, Is = shape.tokens, shape.hidden, shape.inner, shape.topk, shape.shared_inner
    return 6 * (T * Is + T * K * I) * H


def pass_flops(shape: Shape, pass_name: str) -> int:
    """Flops of "forward" or "forward+backward" (backward = 2x forward)."""
    return forward_flops(shape) * (1 if pass_name == "forward" else 3)


@dataclass(frozen=True)
class Traffic:
    """The least one rank's call must do: flops, HBM bytes, NVLink bytes per direction."""

    flops: float
    hbm_bytes: float
    nvlink_bytes: float

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.flops + other.flops, self.hbm_bytes + other.hbm_bytes, self.nvlink_bytes + other.nvlink_bytes
        )


def rank_traffic(
    shape: Shape, routes_RR: Sequence[Sequence[float]], pairs_RR: Sequence[Sequence[float]], rank: int
) -> tuple[Traffic, Traffic]:
    """(forward, backward) traffic of `rank`; routes_RR[s][d] routes and pairs_RR[s][d] tokens s -> d."""
    T, H, I, K, Is, El = (
        shape.tokens,
        shape.hidden,
        shape.inner,
        shape.topk,
        shape.shared_inner,
        shape.local_experts,
    )
    R = len(routes_RR)
    n_rows = sum(routes_RR[s][rank] for s in range(R))
    weights = BF16_BYTES * 3 * H * (El * I + Is)
    context = BF16_BYTES * (n_rows * (H + 2 * I) + T * 2 * Is)
    cross = sum(pairs_RR[rank][d] for d in range(R) if d != rank) + sum(
        pairs_RR[s][rank] for s in range(R) if s != rank
    )
    nvlink = BF16_BYTES * H * cross
    fwd_flops = 6 * (n_rows * I + T * Is) * H
    forward = Traffic(
        flops=fwd_flops,
        hbm_bytes=BF16_BYTES * 2 * T * H + weights + context + (FP32_BYTES + INDEX_BYTES) * T * K,
        nvlink_bytes=nvlink,
    )
    backward = Traffic(
        flops=2 * fwd_flops,
        hbm_bytes=BF16_BYTES * 2 * T * H
        + 2 * weights
        + context
        + (BF16_BYTES * T * H if Is else 0)
        + FP32_BYTES * T * K,
        nvlink_bytes=nvlink,
    )
    return forward, backward


@dataclass(frozen=True)
class Floor:
    """The floor of one pass: ms (None without ceilings), the term that binds, its rank's traffic."""

    ms: float | None
    bound: str | None
    rank: int
    traffic: Traffic

    def asdict(self) -> dict[str, object]:
        return {
            "ms": self.ms,
            "bound": self.bound,
            "rank": self.rank,
            "flops": self.traffic.flops,
            "hbm_bytes": self.traffic.hbm_bytes,
            "nvlink_bytes": self.traffic.nvlink_bytes,
        }


def floor_ms(
    traffic: Traffic, matmul_tflops: float | None, hbm_gbps: float | None, nvlink_gbps: float | None
) -> tuple[float | None, str | None]:
    """(ms, binding term) or (None, None) when a needed rate was not measured."""
    terms: dict[str, float] = {}
    for name, amount, rate, scale in (
        ("matmul", traffic.flops, matmul_tflops, 1e12),
        ("hbm", traffic.hbm_bytes, hbm_gbps, 1e9),
        ("nvlink", traffic.nvlink_bytes, nvlink_gbps, 1e9),
    ):
        if amount == 0:
            continue
        if rate is None or rate <= 0:
            return None, None
        terms[name] = amount / (rate * scale) * 1e3
    if not terms:
        return 0.0, None
    bound = max(terms, key=lambda k: terms[k])
    return terms[bound], bound


def layer_floors(
    shape: Shape,
    routes_RR: Sequence[Sequence[float]],
    pairs_RR: Sequence[Sequence[float]],
    *,
    matmul_tflops: float | None,
    hbm_gbps: float | None,
    nvlink_gbps: float | None,
) -> dict[str, Floor]:
    """Floors of "forward" and "forward+backward": the largest over ranks."""
    floors: dict[str, Floor] = {}
    per_rank = [rank_traffic(shape, routes_RR, pairs_RR, r) for r in range(len(routes_RR))]
    for pass_name in ("forward", "forward+backward"):
        best: Floor | None = None
        for r, (fwd, bwd) in enumerate(per_rank):
            traffic = fwd if pass_name == "forward" else fwd + bwd
            ms, bound = floor_ms(traffic, matmul_tflops, hbm_gbps, nvlink_gbps)
            candidate = Floor(ms, bound, r, traffic)
            if best is None or (ms is not None and (best.ms is None or ms > best.ms)):
                best = candidate
        assert best is not None
        floors[pass_name] = best
    return floors
