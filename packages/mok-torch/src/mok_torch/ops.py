"""The layer's launches as `torch.library` custom ops, so `torch.compile(fullgraph=True)` works.

`mok::build_schedule`, `mok::forward` and `mok::backward` mirror the functional API. They
take the values that define a workspace (group name, max_tokens, H, E, config key) rather
than Python objects, find the cached workspace inside, and return tensors of shapes the
fake implementations know in advance — except the saved context, whose row count (the rows
of macrobatch 0) depends on the routing and is a dynamic size for the compiler. None of the
ops mutates its inputs. Autograd is registered on `mok::forward`; its backward calls
`mok::backward`.

Shape letters: docs/design.md §1 (M: the saved rows, those of macrobatch 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import functional
from .config import MoKConfig
from .structs import ForwardContext, Grads, Schedule
from .validation import call_signature
from .workspace import Workspace, get_workspace, schedule_capacity

BF16 = torch.bfloat16
# The Schedule fields that travel between the ops, in this order.
SCHEDULE_FIELDS = (
    "tokens_per_rank_R",
    "row_src_rank_C",
    "row_route_C",
    "expert_offsets_El1",
    "expert_counts_El",
    "recv_counts_R",
    "send_order_TK",
    "send_counts_R",
    "route_rank_TK",
    "route_row_TK",
)


def group_name(group: Any) -> str:
    """The name custom ops use for a process group ("" = no group, one rank)."""
    return "" if group is None else group.group_name


def _group(name: str) -> Any:
    return None if not name else dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def _world(name: str) -> int:
    return 1 if not name else dist.get_world_size(_group(name))


def _workspace(
    device: torch.device, name: str, max_tokens: int, hidden_size: int, topk: int, num_experts: int, cfg: MoKConfig
) -> Workspace:
    return get_workspace(
        cfg,
        _group(name),
        device=device,
        max_tokens=max_tokens,
        hidden_size=hidden_size,
        topk=topk,
        num_experts=num_experts,
    )


def _schedule(ws: Workspace, top_experts: torch.Tensor, tensors: list[torch.Tensor], backend: str) -> Schedule:
    fields = dict(zip(SCHEDULE_FIELDS, tensors, strict=True))
    top = top_experts.to(torch.int32).contiguous()
    return Schedule(workspace=ws, backend=backend, top_experts_TK=top, **fields)  # type: ignore[arg-type]


def owned(outputs: list[torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """`outputs` as a custom op may return them: each one that is a view, or shares storage with an
    input or an earlier output (a workspace buffer, say), is cloned; the rest (fresh tensors, the
    usual case) go out as they are, with no copy on the hot path."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel() > 0}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() > 0 and (t._base is not None or ptr in seen):
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if t.numel() > 0:
            seen.add(ptr)
        out.append(t)
    return out


def _bf16(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == BF16 and t.is_contiguous():  # the usual case, without two dispatcher calls
        return t
    return t.to(BF16).contiguous()


def _three(a: torch.Tensor | None, b: torch.Tensor | None, c: torch.Tensor | None) -> Any:
    if a is None or b is None or c is None:
        return None
    return (_bf16(a), _bf16(b), _bf16(c))


def run_forward(
    cfg: MoKConfig, ws: Workspace, sched: Schedule, x: torch.Tensor, router_weights: torch.Tensor,
    routed: tuple[torch.Tensor, ...], shared: tuple[torch.Tensor | None, ...],
) -> tuple[torch.Tensor, ForwardContext]:  # fmt: skip
    """y in x's dtype and the context, on the functional API: what `mok::forward` runs, and what
    mok.moe runs outside torch.compile (autograd.Layer, through run_schedule_forward), so both
    give the same bits."""
    y, ctx = functional.forward(cfg, ws, sched, *_forward_args(x, router_weights, routed, shared))
    return _like(y, x), ctx


def run_schedule_forward(
    cfg: MoKConfig, ws: Workspace, top_experts: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor,
    routed: tuple[torch.Tensor, ...], shared: tuple[torch.Tensor | None, ...], signature: tuple | None,
) -> tuple[Schedule, torch.Tensor, ForwardContext]:  # fmt: skip
    """`mok::build_schedule` then run_forward, from one call (functional.schedule_and_forward):
    (schedule, y in x's dtype, context). `signature`: validation.call_signature of (top_experts, x,
    router_weights, routed, shared) as given here (the conversions below change no check's outcome)."""
    xb, w, routed_b, shared_b = _forward_args(x, router_weights, routed, shared)
    sched, y, ctx = functional._schedule_and_forward(cfg, ws, top_experts, xb, w, routed_b, shared_b, signature)
    return sched, _like(y, x), ctx


def run_forward_only(
    cfg: MoKConfig, ws: Workspace, top_experts: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor,
    routed: tuple[torch.Tensor, ...], shared: tuple[torch.Tensor | None, ...], signature: tuple | None,
) -> torch.Tensor:  # fmt: skip
    """run_schedule_forward for a forward that no backward follows: y in x's dtype, no context
    kept (the megakernel then stores neither the routed x nor the pre-activations)."""
    xb, w, routed_b, shared_b = _forward_args(x, router_weights, routed, shared)
    y = functional._schedule_and_forward(cfg, ws, top_experts, xb, w, routed_b, shared_b, signature, context=False)[1]
    return _like(y, x)


def _like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y in x's dtype (the kernels' y is bf16)."""
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _forward_args(
    x: torch.Tensor, router_weights: torch.Tensor, routed: tuple[torch.Tensor, ...],
    shared: tuple[torch.Tensor | None, ...],
) -> tuple[Any, ...]:  # fmt: skip
    """The forward's operands as the functional API takes them (bf16 x and weights)."""
    return _bf16(x), router_weights.contiguous(), _three(*routed), _three(*shared)


def run_backward(
    cfg: MoKConfig, ws: Workspace, sched: Schedule, ctx: ForwardContext, dy: torch.Tensor, x: torch.Tensor,
    router_weights: torch.Tensor, routed: tuple[torch.Tensor, ...], shared: tuple[torch.Tensor | None, ...],
    signature: tuple | None = None,
) -> Grads:  # fmt: skip
    """The gradients with dx in x's dtype (`mok::backward`'s and autograd.Layer's). `signature`:
    one that decides the functional API's metadata checks (functional._backward; autograd.Layer
    passes its forward's), else None: that of these arguments."""
    args = (_bf16(dy), _bf16(x), router_weights.contiguous(), _three(*routed), _three(*shared))
    if signature is None:
        signature = call_signature(*args[1:], args[0])
    grads = functional._backward(cfg, ws, sched, ctx, *args, _wgrad_dtype(routed[0]), signature)
    return grads if grads.dx.dtype == x.dtype else grads._replace(dx=grads.dx.to(x.dtype))


# ---------------------------------------------------------------------------- schedule


@torch.library.custom_op("mok::build_schedule", mutates_args=())
def build_schedule_op(
    top_experts: torch.Tensor, group: str, max_tokens: int, hidden_size: int, num_experts: int, config: str
) -> list[torch.Tensor]:
    """The schedule tensors (SCHEDULE_FIELDS) for this rank's routes [T, K]. Collective."""
    cfg = MoKConfig.from_key(config)
    ws = _workspace(top_experts.device, group, max_tokens, hidden_size, top_experts.shape[1], num_experts, cfg)
    sched = functional.build_schedule(ws, cfg, top_experts.contiguous())
    return owned([getattr(sched, f) for f in SCHEDULE_FIELDS], (top_experts,))


@build_schedule_op.register_fake
def _(
    top_experts: torch.Tensor, group: str, max_tokens: int, hidden_size: int, num_experts: int, config: str
) -> list[torch.Tensor]:
    cfg = MoKConfig.from_key(config)
    T, K = top_experts.shape
    R = _world(group)
    El = num_experts // R
    A = cfg.expert_alignment
    C = schedule_capacity(R, max_tokens, K, El, A)
    new = top_experts.new_empty
    i32, i64 = torch.int32, torch.int64
    return [
        new(R, dtype=i64),
        new(C, dtype=i32),
        new(C, dtype=i32),
        new(El + 1, dtype=i32),
        new(El, dtype=i32),
        new(R, dtype=i64),
        new(T * K, dtype=i64),
        new(R, dtype=i64),
        new(T * K, dtype=i32),
        new(T * K, dtype=i32),
    ]


# ---------------------------------------------------------------------------- forward


def _capacity_rows(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """A routed context array as `mok::forward` returns it: `capacity` rows (the table's, a shape
    known before the call, so that torch.compile traces the op without a data-dependent shape and
    no graph break), its first rows the context's (the backward reads only the rows of macrobatch
    0), the rest zeros. The megakernel's arrays have the capacity's rows already (no copy)."""
    rows = t.shape[0]
    if rows == capacity:
        return t
    if rows > capacity:
        raise RuntimeError(f"mok::forward: a context of {rows} rows, more than the table's {capacity}")
    out = t.new_empty((capacity, *t.shape[1:]))
    out[:rows].copy_(t)
    out[rows:].zero_()
    return out


@torch.library.custom_op("mok::forward", mutates_args=())
def forward_op(
    x: torch.Tensor,
    router_weights: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wg_s: torch.Tensor | None,
    wu_s: torch.Tensor | None,
    wd_s: torch.Tensor | None,
    schedule: list[torch.Tensor],
    top_experts: torch.Tensor,
    group: str,
    max_tokens: int,
    config: str,
) -> list[torch.Tensor]:
    """[y (x's dtype), x_routed, a, b, shared_a, shared_b]; absent shared parts are empty; the
    routed ones with the table's capacity of rows (_capacity_rows)."""
    cfg = MoKConfig.from_key(config)
    H = x.shape[1]
    ws = _workspace(x.device, group, max_tokens, H, top_experts.shape[1], wg.shape[0] * _world(group), cfg)
    backend = functional.resolve_backend(cfg, ws.device).name
    sched = _schedule(ws, top_experts, schedule, backend)
    y, ctx = run_forward(cfg, ws, sched, x, router_weights, (wg, wu, wd), (wg_s, wu_s, wd_s))
    shared_a = x.new_empty(0, dtype=BF16) if ctx.shared_a_TIs is None else ctx.shared_a_TIs
    shared_b = x.new_empty(0, dtype=BF16) if ctx.shared_b_TIs is None else ctx.shared_b_TIs
    C = schedule[1].shape[0]  # row_src_rank_C: the table's capacity
    routed_rows = [_capacity_rows(t, C) for t in (ctx.routed_x(), ctx.a_MI, ctx.b_MI)]
    outputs = [y, *routed_rows, shared_a, shared_b]
    inputs = tuple(
        t for t in (x, router_weights, wg, wu, wd, wg_s, wu_s, wd_s, top_experts, *schedule) if t is not None
    )
    return owned(outputs, inputs)


@forward_op.register_fake
def _(
    x: torch.Tensor,
    router_weights: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wg_s: torch.Tensor | None,
    wu_s: torch.Tensor | None,
    wd_s: torch.Tensor | None,
    schedule: list[torch.Tensor],
    top_experts: torch.Tensor,
    group: str,
    max_tokens: int,
    config: str,
) -> list[torch.Tensor]:
    T, H = x.shape
    inner = wg.shape[1]
    rows = schedule[1].shape[0]  # the table's capacity (_capacity_rows): no data-dependent shape
    # the saved routed x: bf16 rows, or MXFP8 rows (H E4M3 bytes then H/32 scale bytes)
    if MoKConfig.from_key(config).precision == "mxfp8":
        x_routed = x.new_empty(rows, H + H // 32, dtype=torch.uint8)
    else:
        x_routed = x.new_empty(rows, H, dtype=BF16)
    if wg_s is None:
        shared = [x.new_empty(0, dtype=BF16), x.new_empty(0, dtype=BF16)]
    else:
        shared = [x.new_empty(T, wg_s.shape[0], dtype=BF16), x.new_empty(T, wg_s.shape[0], dtype=BF16)]
    return [
        x.new_empty(T, H),
        x_routed,
        x.new_empty(rows, inner, dtype=BF16),
        x.new_empty(rows, inner, dtype=BF16),
        *shared,
    ]


@torch.library.custom_op("mok::forward_only", mutates_args=())
def forward_only_op(
    x: torch.Tensor,
    router_weights: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wg_s: torch.Tensor | None,
    wu_s: torch.Tensor | None,
    wd_s: torch.Tensor | None,
    top_experts: torch.Tensor,
    group: str,
    max_tokens: int,
    config: str,
) -> torch.Tensor:
    """y (x's dtype) of a forward that no backward follows: the schedule and the forward in one
    call with no context kept (run_forward_only, what mok.moe runs eagerly without autograd), for
    mok.moe under torch.compile where no gradient can be asked for. Collective."""
    cfg = MoKConfig.from_key(config)
    H = x.shape[1]
    ws = _workspace(x.device, group, max_tokens, H, top_experts.shape[1], wg.shape[0] * _world(group), cfg)
    y = run_forward_only(cfg, ws, top_experts.contiguous(), x, router_weights, (wg, wu, wd), (wg_s, wu_s, wd_s), None)
    inputs = tuple(t for t in (x, router_weights, wg, wu, wd, wg_s, wu_s, wd_s, top_experts) if t is not None)
    return owned([y], inputs)[0]


@forward_only_op.register_fake
def _(
    x: torch.Tensor,
    router_weights: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wg_s: torch.Tensor | None,
    wu_s: torch.Tensor | None,
    wd_s: torch.Tensor | None,
    top_experts: torch.Tensor,
    group: str,
    max_tokens: int,
    config: str,
) -> torch.Tensor:
    return x.new_empty(x.shape)


# ---------------------------------------------------------------------------- backward


def _wgrad_dtype(w: torch.Tensor) -> torch.dtype:
    """fp32 parameters get the fp32 accumulator itself; others its bf16 rounding."""
    return torch.float32 if w.dtype == torch.float32 else BF16


@torch.library.custom_op("mok::backward", mutates_args=())
def backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wg_s: torch.Tensor | None,
    wu_s: torch.Tensor | None,
    wd_s: torch.Tensor | None,
    schedule: list[torch.Tensor],
    top_experts: torch.Tensor,
    context: list[torch.Tensor],
    group: str,
    max_tokens: int,
    config: str,
) -> list[torch.Tensor]:
    """[dx, d_router_weights, dWg, dWu, dWd, dWg_s, dWu_s, dWd_s] (absent shared parts empty)."""
    cfg = MoKConfig.from_key(config)
    H = x.shape[1]
    ws = _workspace(x.device, group, max_tokens, H, top_experts.shape[1], wg.shape[0] * _world(group), cfg)
    backend = functional.resolve_backend(cfg, ws.device).name
    sched = _schedule(ws, top_experts, schedule, backend)
    x_routed, a, b, shared_a, shared_b = context
    has_shared = wg_s is not None
    ctx = ForwardContext(
        sched, backend, x_routed, a, b, shared_a if has_shared else None, shared_b if has_shared else None
    )
    grads = run_backward(cfg, ws, sched, ctx, dy, x, router_weights, (wg, wu, wd), (wg_s, wu_s, wd_s))
    shared = list(grads.d_shared) if grads.d_shared is not None else [x.new_empty(0, dtype=BF16) for _ in range(3)]
    return [grads.dx, grads.d_router_weights, *grads.d_routed, *shared]


@backward_op.register_fake
def _(
    dy: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wg_s: torch.Tensor | None,
    wu_s: torch.Tensor | None,
    wd_s: torch.Tensor | None,
    schedule: list[torch.Tensor],
    top_experts: torch.Tensor,
    context: list[torch.Tensor],
    group: str,
    max_tokens: int,
    config: str,
) -> list[torch.Tensor]:
    dt = _wgrad_dtype(wg)
    if wg_s is None or wu_s is None or wd_s is None:
        shared = [x.new_empty(0, dtype=BF16) for _ in range(3)]
    else:
        shared = [w.new_empty(w.shape, dtype=dt) for w in (wg_s, wu_s, wd_s)]
    return [
        x.new_empty(x.shape),
        router_weights.new_empty(router_weights.shape),
        *(w.new_empty(w.shape, dtype=dt) for w in (wg, wu, wd)),
        *shared,
    ]


# ---------------------------------------------------------------------------- autograd


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    x, w, wg, wu, wd, wg_s, wu_s, wd_s, schedule, top, group, max_tokens, config = inputs
    ctx.num_schedule = len(schedule)
    ctx.meta = (group, max_tokens, config)
    ctx.save_for_backward(x, w, wg, wu, wd, wg_s, wu_s, wd_s, top, *schedule, *output[1:])


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    x, w, wg, wu, wd, wg_s, wu_s, wd_s, top, *rest = ctx.saved_tensors
    schedule, context = rest[: ctx.num_schedule], rest[ctx.num_schedule :]
    dy = grads[0] if grads[0] is not None else torch.zeros_like(x)
    out = torch.ops.mok.backward(dy, x, w, wg, wu, wd, wg_s, wu_s, wd_s, schedule, top, context, *ctx.meta)
    dx, dw, dwg, dwu, dwd, dwg_s, dwu_s, dwd_s = out
    if wg_s is None:
        dwg_s = dwu_s = dwd_s = None
    # One entry per input, and a list for the list input (the schedule).
    return dx, dw, dwg, dwu, dwd, dwg_s, dwu_s, dwd_s, [None] * ctx.num_schedule, None, None, None, None


torch.library.register_autograd("mok::forward", _backward, setup_context=_setup_context)
