"""`moe`: the differentiable MoE layer call.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

from . import ops
from .agreement import bounded
from .config import MoKConfig, default_config
from .structs import ForwardContext
from .validation import FLOAT_DTYPES, INDEX_DTYPES, CheckedCalls, call_signature, check_tensor, describe
from .workspace import Workspace, cache_generation, get_workspace, group_rank_and_size

Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_MAX_TOKENS_ROUNDING = 128  # agreed max_tokens is rounded up so workspaces are reused
# Eager calls that passed mok.moe's checks: (call_signature, group, max_tokens) -> (workspace, the
# workspace cache's generation then). A call like one of them skips the checks and the lookup.
_CALLS = CheckedCalls()


def agree_max_tokens(num_tokens: int, group: Any, device: torch.device, timeout_s: float = 300.0) -> int:
    """The largest T of the group, rounded up (one all-reduce on the host when R > 1, its wait
    bounded by `timeout_s`)."""
    _, world = group_rank_and_size(group)
    top = num_tokens
    if world > 1:
        t = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        issue = lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)  # noqa: E731
        bounded(issue, "agreeing on max_tokens (pass max_tokens to skip this all-reduce)", timeout_s)
        top = int(t.item())
    return max(-(-top // _MAX_TOKENS_ROUNDING) * _MAX_TOKENS_ROUNDING, _MAX_TOKENS_ROUNDING)


def moe(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    router_weights: torch.Tensor,
    routed: Weights3,
    shared: Weights3 | None = None,
    config: MoKConfig | None = None,
    group: Any = None,
    *,
    max_tokens: int | None = None,
    _group_name: str | None = None,
) -> torch.Tensor:
    """y[t] = S(x[t]) + sum_k router_weights[t,k] * E_{top_experts[t,k]}(x[t]), differentiable.

    Args:
        x: [T, H] float32/bf16/fp16; computed in bf16, y has x's dtype.
        top_experts: [T, K] int32/int64 global expert ids (the router's choice, or a replay).
        router_weights: [T, K] float; receives a gradient.
        routed: (Wg [El, I, H], Wu [El, I, H], Wd [El, H, I]) of this rank's experts. Their
            gradients come back in fp32 when they are fp32 (fp32 accumulation end to end),
            else in bf16.
        shared: (Wg_s [Is, H], Wu_s [Is, H], Wd_s [H, Is]) or None.
        config: MoKConfig (default MoKConfig()).
        group: the expert-parallel process group; None = this rank holds every expert.
        max_tokens: the most tokens any rank brings; None agrees on it with one all-reduce.

    With R > 1 ranks, every rank must call this (and run its backward) the same number of
    times, as with any collective.
    """
    cfg = default_config() if config is None else config
    given_max_tokens = max_tokens
    eager = not torch.compiler.is_compiling()
    signature = call_signature(top_experts, x, router_weights, routed, shared) if eager else None
    s = (None, None, None) if shared is None or not isinstance(shared, (tuple, list)) else tuple(shared)
    if signature is not None and (max_tokens is not None or group is None):
        # The arguments of a call that passed these checks before (and the same config, group and
        # max_tokens): its workspace, without the checks (the functional API skips its own too).
        known = _CALLS.get(cfg, (signature, id(group), max_tokens))
        if known is not None:
            ws, generation = cast(tuple[Workspace, int], known)
            if generation == cache_generation() and ws.group is group:
                return _eager(cfg, ws, signature, top_experts, x, router_weights, routed, s)
    if not isinstance(cfg, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(cfg).__name__}")
    check_tensor("x", x, dtypes=FLOAT_DTYPES, shape=[("T", None), ("H", None)], contiguous=False)
    T, H = x.shape
    if isinstance(top_experts, torch.Tensor) and top_experts.device != x.device:
        raise ValueError(
            f"x and top_experts must be on one device: x is on {x.device}, top_experts on {top_experts.device} "
            "(as are router_weights and the weights: the layer runs where x is)"
        )
    check_tensor(
        "top_experts",
        top_experts,
        dtypes=INDEX_DTYPES,
        shape=[("T", T), ("K", None)],
        device=x.device,
        contiguous=False,
    )
    if not isinstance(routed, (tuple, list)) or len(routed) != 3:
        raise TypeError(f"routed must be a tuple (gate, up, down), got {describe(routed)}")
    check_tensor(
        "routed[0] (gate)",
        routed[0],
        dtypes=FLOAT_DTYPES,
        shape=[("El", None), ("I", None), ("H", H)],
        device=x.device,
        contiguous=False,
    )
    if shared is not None and (not isinstance(shared, (tuple, list)) or len(shared) != 3):
        raise TypeError(f"shared must be None or a tuple (gate, up, down), got {describe(shared)}")
    _, world = group_rank_and_size(group)
    num_experts = routed[0].shape[0] * world
    for name, weights in (("routed", routed), ("shared", shared)):
        if weights is not None:
            for i, w in enumerate(weights):
                if not isinstance(w, torch.Tensor) or w.dtype not in FLOAT_DTYPES:
                    raise TypeError(f"{name}[{i}] must be a float tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if max_tokens is None:
        if world > 1 and torch.compiler.is_compiling():
            raise ValueError("max_tokens: under torch.compile with an expert-parallel group, pass max_tokens")
        max_tokens = agree_max_tokens(T, group, x.device, cfg.timeout_s)
    if eager:
        # Eager: the same functional calls as the custom ops, without their dispatch and autograd
        # (0.87 of the 1.95 ms a qwen3-30b-a3b forward took to issue on an H200's host,
        # docs/megakernel.md).
        ws = get_workspace(
            cfg, group, device=x.device, max_tokens=max_tokens, hidden_size=H, topk=top_experts.shape[1],
            num_experts=num_experts,
        )  # fmt: skip
        y = _eager(cfg, ws, signature, top_experts, x, router_weights, routed, s)
        if given_max_tokens is not None or group is None:  # (else an all-reduce agrees on it each call)
            _CALLS.add(cfg, (signature, id(group), given_max_tokens), (ws, cache_generation()))
        return y
    name = ops.group_name(group) if _group_name is None else _group_name
    if not _wants_grad(x, router_weights, routed, s):  # no context kept, as eagerly (_eager)
        return cast(
            torch.Tensor,
            torch.ops.mok.forward_only(x, router_weights, *routed, *s, top_experts, name, max_tokens, cfg.key),
        )
    schedule = torch.ops.mok.build_schedule(top_experts.contiguous(), name, max_tokens, H, num_experts, cfg.key)
    outputs = torch.ops.mok.forward(x, router_weights, *routed, *s, schedule, top_experts, name, max_tokens, cfg.key)
    return outputs[0]


def _eager(
    cfg: MoKConfig, ws: Workspace, signature: tuple | None, top_experts: torch.Tensor, x: torch.Tensor,
    router_weights: torch.Tensor, routed: Weights3, shared: tuple[torch.Tensor | None, ...],
) -> torch.Tensor:  # fmt: skip
    """An eager call: through autograd (Layer) where a gradient may be asked for, else the forward
    alone with no context kept (autograd off, as under torch.no_grad or inference_mode, or no
    input that requires a gradient): the same y, without the stores only a backward reads."""
    if _wants_grad(x, router_weights, routed, shared):
        return Layer.apply(cfg, ws, signature, top_experts, x, router_weights, *routed, *shared)
    return ops.run_forward_only(cfg, ws, top_experts, x, router_weights, routed, shared, signature)


def _wants_grad(
    x: torch.Tensor, router_weights: torch.Tensor, routed: Weights3, shared: tuple[torch.Tensor | None, ...]
) -> bool:
    """Whether a gradient may be asked of this call: autograd on and an input that requires one
    (else the forward keeps no context: under torch.no_grad or inference_mode, or with frozen
    weights and inputs, as in RL's log-prob passes and evaluation)."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, router_weights, *routed, *shared)
    )


class Layer(torch.autograd.Function):
    """mok.moe outside torch.compile: `mok::build_schedule`, `mok::forward` and `mok::backward`'s
    arithmetic (ops.run_schedule_forward, ops.run_backward) on the schedule object itself, with none of the
    custom ops' dispatch; the schedule and the forward in one call (functional.schedule_and_forward),
    so that a backend may start the forward's kernels before the schedule's last ones. Under
    torch.compile, mok.moe calls the custom ops instead; both give the same bits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, cfg: MoKConfig, ws: Any, signature: tuple | None, top_experts: torch.Tensor, x: torch.Tensor,
        router_weights: torch.Tensor, *weights: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        routed, shared = weights[:3], weights[3:]
        sched, y, fctx = ops.run_schedule_forward(cfg, ws, top_experts, x, router_weights, routed, shared, signature)  # type: ignore[arg-type]
        has_x = fctx.x_routed_MH is not None
        ctx.meta = (cfg, ws, sched, fctx.backend, fctx.shared_a_TIs is not None, has_x, signature)
        # What the context keeps as a view is copied: a view of a workspace buffer would be
        # rewritten by the next call before this backward runs, one of a larger tensor would keep
        # all of it. Fresh tensors (the usual case) are kept as they are, with no copy.
        parts = (fctx.x_routed_MH, fctx.a_MI, fctx.b_MI, fctx.shared_a_TIs, fctx.shared_b_TIs)
        kept = [t.clone() if t is not None and t._base is not None and t.numel() else t for t in parts]
        if kept[3] is None or kept[4] is None:  # (save_for_backward takes no None)
            kept[3:] = [x.new_empty(0, dtype=torch.bfloat16)] * 2
        if kept[0] is None:
            kept[0] = x.new_empty(0, dtype=torch.bfloat16)
        ctx.save_for_backward(x, router_weights, *weights, *kept)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, router_weights, *rest = ctx.saved_tensors
        weights, (x_routed, a, b, shared_a, shared_b) = rest[:6], rest[6:]
        cfg, ws, sched, backend, has_shared, has_x, signature = ctx.meta
        if not has_shared:
            shared_a = shared_b = None
        if not has_x:
            x_routed = None
        fctx = ForwardContext(sched, backend, x_routed, a, b, shared_a, shared_b)
        # The forward's signature decides the backward's metadata checks too: the saved tensors are
        # the ones it checked, and autograd gives dy the shape, dtype and device of y.
        key = None if signature is None else ("autograd.Layer", signature)
        g = ops.run_backward(cfg, ws, sched, fctx, dy, x, router_weights, tuple(weights[:3]), tuple(weights[3:]), key)
        shared = (None, None, None) if g.d_shared is None else g.d_shared
        return None, None, None, None, g.dx, g.d_router_weights, *g.d_routed, *shared
