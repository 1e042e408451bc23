"""The reference backend: the MoE layer in plain PyTorch, on any device.

It is the executable statement of docs/design.md: the schedule table of §6, the transfer
directions of §7, the ring of §8 and the fixed reduction orders of §2 (docs/determinism.md),
with torch collectives for transport. It reads sizes on the host and is slow; it is always available
and every other backend is tested against its contract.
"""

from __future__ import annotations

import torch

from ...agreement import step_in
from ...config import MoKConfig
from ...mxfp8 import pack_rows, unpack_rows
from ...spec.experts import (
    BF16,
    ExpertWeights,
    accumulate_wgrads,
    combine_epilogue,
    down,
    expert_weights,
    gate_up,
    routed_wgrads,
    row_backward,
    shared_backward,
    shared_forward,
    swiglu,
)
from ...spec.ring import plan_ring, replays_in_backward
from ...structs import ForwardContext, Grads, Schedule
from ...workspace import Workspace
from . import transport
from .schedule import build_schedule as _build_schedule

Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def pull_activations(cfg: MoKConfig, sched: Schedule, rows_TH: torch.Tensor) -> torch.Tensor:
    """x or dy rows gathered onto the table [C, ...]: bf16, or MXFP8 rows quantized before they
    travel (half the bytes)."""
    if cfg.precision == "mxfp8":
        return transport.pull(sched, pack_rows(rows_TH, compiled=False))
    return transport.pull(sched, rows_TH)


def activation_values(cfg: MoKConfig, rows: torch.Tensor, hidden: int) -> torch.Tensor:
    """A GEMM's view of pulled rows: bf16 as they are, MXFP8 rows as their float32 values."""
    return unpack_rows(rows, hidden) if cfg.precision == "mxfp8" else rows


class ReferenceBackend:
    name = "reference"
    reference_experts = True  # the expert GEMMs are sequential elementwise loops

    def unavailable_reason(self, precision: str, device: torch.device) -> str | None:
        return None  # bf16 and mxfp8, on any device

    def build_schedule(self, ws: Workspace, cfg: MoKConfig, top_experts_TK: torch.Tensor) -> Schedule:
        step_in(ws, "schedule", cfg.timeout_s)
        return _build_schedule(ws, top_experts_TK)

    def _routed_pass(
        self,
        cfg: MoKConfig,
        sched: Schedule,
        x_TH: torch.Tensor,
        weights: ExpertWeights,
        *,
        outputs: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward over the routed rows: (output rows [C, H] or None, ring x, ring a, ring b)."""
        ws = sched.workspace
        inner = weights.intermediate_size
        plan = plan_ring(cfg, ws, sched, inner)
        x_C = pull_activations(cfg, sched, x_TH)
        out_C = x_TH.new_zeros(ws.capacity, ws.hidden_size) if outputs else None
        ring_x = x_C.new_empty(plan.ring_rows, x_C.shape[1])
        ring_a = x_TH.new_empty(plan.ring_rows, inner)
        ring_b = x_TH.new_empty(plan.ring_rows, inner)
        macrobatches = plan.macrobatches()
        # Last to first: the ring ends holding macrobatch 0. Without outputs, only it is needed.
        for lo, hi in reversed(macrobatches) if outputs else macrobatches[:1]:
            for mlo, mhi in plan.minibatches(lo, hi):
                ring_x[mlo - lo : mhi - lo] = x_C[mlo:mhi]
                block = plan.block(mlo, mhi, x_TH.device)
                w = weights.select(block.first, block.last)
                a, b = gate_up(activation_values(cfg, block.gather(ring_x, lo), ws.hidden_size), w)
                block.scatter(a, ring_a, lo)
                block.scatter(b, ring_b, lo)
                if out_C is not None:
                    block.scatter(down(swiglu(a, b, cfg.swiglu_limit), w), out_C)
        return out_C, ring_x, ring_a, ring_b

    def forward(
        self,
        cfg: MoKConfig,
        ws: Workspace,
        sched: Schedule,
        x_TH: torch.Tensor,
        router_weights_TK: torch.Tensor,
        routed: Weights3,
        shared: Weights3 | None,
    ) -> tuple[torch.Tensor, ForwardContext]:
        step_in(ws, "forward", cfg.timeout_s)
        T, K = sched.num_tokens, sched.topk
        out_C, ring_x, ring_a, ring_b = self._routed_pass(cfg, sched, x_TH, expert_weights(cfg, routed), outputs=True)
        assert out_C is not None
        rows_TKH = transport.push(sched, out_C).view(T, K, ws.hidden_size)
        ys_TH, shared_a, shared_b = shared_forward(x_TH, shared, cfg.swiglu_limit)
        y_TH = combine_epilogue(ys_TH, rows_TKH, router_weights_TK.float())
        ctx = ForwardContext(sched, self.name, ring_x, ring_a, ring_b, shared_a, shared_b)
        return y_TH, ctx

    def recompute_forward_context(
        self,
        cfg: MoKConfig,
        ws: Workspace,
        sched: Schedule,
        x_TH: torch.Tensor,
        routed: Weights3,
        shared: Weights3 | None,
    ) -> ForwardContext:
        step_in(ws, "recompute", cfg.timeout_s)
        _, ring_x, ring_a, ring_b = self._routed_pass(cfg, sched, x_TH, expert_weights(cfg, routed), outputs=False)
        _, shared_a, shared_b = shared_forward(x_TH, shared, cfg.swiglu_limit, outputs=False)
        return ForwardContext(sched, self.name, ring_x, ring_a, ring_b, shared_a, shared_b)

    def backward(
        self,
        cfg: MoKConfig,
        ws: Workspace,
        sched: Schedule,
        ctx: ForwardContext,
        dy_TH: torch.Tensor,
        x_TH: torch.Tensor,
        router_weights_TK: torch.Tensor,
        routed: Weights3,
        shared: Weights3 | None,
        wgrad_dtype: torch.dtype,
    ) -> Grads:
        step_in(ws, "backward", cfg.timeout_s)
        T, K, H = sched.num_tokens, sched.topk, ws.hidden_size
        El = ws.num_local_experts
        weights = expert_weights(cfg, routed)
        inner = weights.intermediate_size
        plan = plan_ring(cfg, ws, sched, inner)
        dy_C = pull_activations(cfg, sched, dy_TH)
        w_C = transport.pull(sched, router_weights_TK.float().reshape(-1), per_route=True)
        # Replay re-pulls x for the macrobatches the ring no longer holds.
        x_C = pull_activations(cfg, sched, x_TH) if replays_in_backward(cfg, ws) else None
        dx_C = dy_TH.new_zeros(ws.capacity, H)  # bf16 rows
        dw_C = torch.zeros(ws.capacity, dtype=torch.float32, device=dy_TH.device)
        # fp32 weight-gradient partials, carried across every minibatch and macrobatch.
        d_gate_up = torch.zeros(El, 2 * inner, H, dtype=torch.float32, device=dy_TH.device)
        d_down = torch.zeros(El, H, inner, dtype=torch.float32, device=dy_TH.device)
        for m, (lo, hi) in enumerate(plan.macrobatches()):  # first to last
            for mlo, mhi in plan.minibatches(lo, hi):
                block = plan.block(mlo, mhi, dy_TH.device)
                w = weights.select(block.first, block.last)
                if m == 0:
                    xs = activation_values(cfg, block.gather(ctx.routed_x(), lo), H)
                    a, b = block.gather(ctx.a_MI, lo), block.gather(ctx.b_MI, lo)
                else:
                    assert x_C is not None
                    xs = activation_values(cfg, block.gather(x_C), H)
                    a, b = gate_up(xs, w)
                dys, ws_ = activation_values(cfg, block.gather(dy_C), H), block.gather(w_C)
                rg = row_backward(xs, a, b, dys, ws_, w, cfg.swiglu_limit)
                block.scatter(rg.dx, dx_C)
                block.scatter(rg.d_w, dw_C)
                accumulate_wgrads(
                    xs,
                    dys,
                    ws_,
                    rg,
                    d_gate_up[block.first : block.last],
                    d_down[block.first : block.last],
                    weights=w,
                )
        dxr_TKH = transport.push(sched, dx_C).view(T, K, H)
        d_router = transport.push(sched, dw_C).view(T, K).to(router_weights_TK.dtype)

        dxs_TH, d_shared = shared_backward(
            x_TH, dy_TH, ctx.shared_a_TIs, ctx.shared_b_TIs, shared, cfg.swiglu_limit, wgrad_dtype
        )
        dx_TH = combine_epilogue(dxs_TH, dxr_TKH, None)
        d_routed = routed_wgrads(d_gate_up, d_down, wgrad_dtype)
        return Grads(dx_TH, d_router, d_routed, d_shared)


__all__ = ["BF16", "ReferenceBackend"]
