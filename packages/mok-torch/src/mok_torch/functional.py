"""The functional API (docs/design.md §10): schedule, forward, backward, recompute.

Shape letters: docs/design.md §1.

These calls take bf16 activations and weights, check every argument, and run on the
backend `config.backend` resolves to. `mok_torch.moe` wraps them in autograd.
"""

from __future__ import annotations

from typing import Any, Literal, cast, overload

import torch

from . import agreement
from .backends import check_backend_errors, checks_expert_ids_on_device, resolve_backend
from .config import MoKConfig
from .mxfp8 import MXFP8Tensor
from .structs import ForwardContext, Grads, Schedule
from .validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    CheckedCalls,
    call_signature,
    check_expert_ids,
    check_tensor,
    check_weights,
    describe,
)
from .workspace import Workspace, cached_workspaces

BF16 = (torch.bfloat16,)
Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _check_config(cfg: object, ws: object) -> None:
    if not isinstance(cfg, MoKConfig):
        raise TypeError(f"cfg must be a MoKConfig, got {type(cfg).__name__}")
    if not isinstance(ws, Workspace):
        raise TypeError(f"ws must be a Workspace (from get_workspace), got {type(ws).__name__}")
    if cfg.expert_alignment != ws.expert_alignment:
        raise ValueError(
            f"cfg.expert_alignment ({cfg.expert_alignment}) differs from the workspace's "
            f"({ws.expert_alignment}): get the workspace with the same config"
        )


def _check_schedule(sched: object, ws: Workspace) -> Schedule:
    if not isinstance(sched, Schedule):
        raise TypeError(f"sched must be a Schedule (from build_schedule), got {type(sched).__name__}")
    if sched.workspace is not ws:
        raise ValueError("sched was built for another workspace")
    return sched


def _check_mxfp8_routed(ws: Workspace, routed: tuple | list) -> int:
    """MXFP8 routed weights: three MXFP8Tensor with both copies; returns I."""
    El, H = ws.num_local_experts, ws.hidden_size
    if H % 32:
        raise ValueError(f"hidden_size ({H}) must be a multiple of 32 for precision 'mxfp8'")
    if not all(isinstance(w, MXFP8Tensor) for w in routed):
        raise TypeError("routed: pass three MXFP8Tensor (mok.mxfp8_quantize) or three bf16 tensors, not a mix")
    names = ("routed[0] (gate)", "routed[1] (up)", "routed[2] (down)")
    inner = routed[0].shape[1] if len(routed[0].shape) == 3 else -1
    for name, w, want in zip(names, routed, ([El, inner, H], [El, inner, H], [El, H, inner]), strict=True):
        if w.data is None or w.data_t is None:
            raise ValueError(f"{name}: the MXFP8 weights need the normal and the transposed copy")
        if list(w.shape) != want:
            raise ValueError(f"{name} must have shape {want} = [El, I, H] / [El, H, I], got {list(w.shape)}")
        if w.device != ws.device:
            raise ValueError(f"{name} must be on {ws.device}, got {w.device}")
    if inner < 1 or inner % 32:
        raise ValueError(f"routed: the intermediate size I ({inner}) must be a positive multiple of 32 for 'mxfp8'")
    return inner


def _check_layer_args(
    ws: Workspace,
    num_tokens: int,
    x: object,
    router_weights: object | None,
    routed: object,
    shared: object | None,
    precision: str = "bf16",
) -> tuple[int, int | None]:
    """Checks x, router weights and weights; returns (I, Is or None)."""
    T, H, K, El = num_tokens, ws.hidden_size, ws.topk, ws.num_local_experts
    check_tensor("x", x, dtypes=BF16, shape=[("T", T), ("H", H)], device=ws.device)
    if router_weights is not None:
        check_tensor(
            "router_weights", router_weights, dtypes=FLOAT_DTYPES, shape=[("T", T), ("K", K)], device=ws.device
        )
    if not isinstance(routed, (tuple, list)) or len(routed) != 3:
        raise TypeError(
            f"routed must be a tuple (gate [El, I, H], up [El, I, H], down [El, H, I]), got {describe(routed)}"
        )
    if any(isinstance(w, MXFP8Tensor) for w in routed):
        if precision != "mxfp8":
            raise TypeError(f"routed holds MXFP8Tensor weights, but the config's precision is {precision!r}")
        return _check_mxfp8_routed(ws, routed), _check_shared(ws, shared)
    wg = check_tensor(
        "routed[0] (gate)", routed[0], dtypes=BF16, shape=[("El", El), ("I", None), ("H", H)], device=ws.device
    )
    inner = wg.shape[1]
    if inner == 0:
        raise ValueError("routed[0] (gate): the intermediate size I must be >= 1")
    check_weights(
        "routed",
        routed,
        [
            [("El", El), ("I", inner), ("H", H)],
            [("El", El), ("I", inner), ("H", H)],
            [("El", El), ("H", H), ("I", inner)],
        ],
        dtypes=BF16,
        device=ws.device,
    )
    if precision == "mxfp8":
        if H % 32:
            raise ValueError(f"hidden_size ({H}) must be a multiple of 32 for precision 'mxfp8'")
        if inner % 32:
            raise ValueError(f"routed: the intermediate size I ({inner}) must be a multiple of 32 for 'mxfp8'")
    return inner, _check_shared(ws, shared)


def _check_shared(ws: Workspace, shared: object | None) -> int | None:
    """Checks the shared expert's weights (bf16 in every precision); returns Is or None."""
    H = ws.hidden_size
    shared_inner = None
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 3:
            raise TypeError(
                f"shared must be None or a tuple (gate [Is, H], up [Is, H], down [H, Is]), got {describe(shared)}"
            )
        sg = check_tensor("shared[0] (gate)", shared[0], dtypes=BF16, shape=[("Is", None), ("H", H)], device=ws.device)
        shared_inner = sg.shape[0]
        if shared_inner == 0:
            raise ValueError("shared[0] (gate): the shared inner size Is must be >= 1 (pass shared=None for none)")
        check_weights(
            "shared",
            shared,
            [[("Is", shared_inner), ("H", H)], [("Is", shared_inner), ("H", H)], [("H", H), ("Is", shared_inner)]],
            dtypes=BF16,
            device=ws.device,
        )
    return shared_inner


def _agree_weights(ws: Workspace, cfg: MoKConfig, inner: tuple[int, int | None]) -> None:
    """Every rank's weights have the same intermediate sizes (collective once per workspace)."""
    agreement.agree_call(ws, cfg, "", inner)


def check_errors(ws: Workspace | None = None) -> None:
    """Raise the error recorded in `ws` (None: in every workspace of `get_workspace`'s cache,
    which mok.moe and MoELayer use), if any.

    Native GPU calls never wait for the host, so what the device finds (a wait that timed out,
    an expert id outside [0, E) in top_experts) is recorded in the workspace and raised by the
    next call that finds it; this waits for the device and raises at once (each backend's
    `check_errors` hook). The reference backend records nothing: it raises as it goes.
    """
    if ws is None:
        for cached in cached_workspaces():
            check_backend_errors(cached)
        return
    if not isinstance(ws, Workspace):
        raise TypeError(f"ws must be a Workspace or None, got {type(ws).__name__}")
    check_backend_errors(ws)


def build_schedule(ws: Workspace, cfg: MoKConfig, top_experts: torch.Tensor) -> Schedule:
    """The schedule table for this rank's routes `top_experts` [T, K] (global expert ids).

    Collective: every rank of the workspace's group must call it. A user may pass any
    `top_experts` (router replay); ids are checked to lie in [0, E). Any layout is taken
    (`route` returns a strided view of a sort); the table builder reads a contiguous copy.
    """
    te, backend = _checked_routes(ws, cfg, top_experts)
    return backend.build_schedule(ws, cfg, te)


def _checked_routes(ws: Workspace, cfg: MoKConfig, top_experts: object) -> tuple[torch.Tensor, Any]:
    """build_schedule's checks and agreement: the routes, contiguous, and the backend."""
    _check_config(cfg, ws)
    te = check_tensor(
        "top_experts",
        top_experts,
        dtypes=INDEX_DTYPES,
        shape=[("T", None), ("K", ws.topk)],
        device=ws.device,
        contiguous=False,
    ).contiguous()
    if te.shape[0] > ws.max_tokens:
        raise ValueError(
            f"top_experts has {te.shape[0]} tokens, more than the workspace's max_tokens ({ws.max_tokens})"
        )
    backend = resolve_backend(cfg, ws.device)
    if _ids_read_on_host(te, backend):
        _check_ids_on_host(ws, te)
    # Before any buffer is made or row moves: every rank holds the same workspace and config.
    agreement.agree_call(ws, cfg, backend.name)
    return te, backend


def _ids_read_on_host(te: torch.Tensor, backend: Any) -> bool:
    """Whether a call's expert ids are checked on the host: where that costs no wait (CPU tensors),
    and on a GPU whose backend does not check them on the device. The native one does (a bad id is
    recorded for the next call to raise), so that the host never waits for the GPU."""
    return not te.is_cuda or not checks_expert_ids_on_device(backend, te.device)


def _check_ids_on_host(ws: Workspace, te: torch.Tensor) -> None:
    """The ids in [0, E), read on the host (no host read inside a CUDA graph capture:
    docs/core-runtime.md "Schedule")."""
    if not te.is_cuda or not torch.cuda.is_current_stream_capturing():
        check_expert_ids("top_experts", te, ws.num_experts)


def _checked_forward_call(
    cfg: MoKConfig, ws: Workspace, top_experts: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor,
    routed: Weights3, shared: Weights3 | None, signature: tuple | None,
) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """schedule_and_forward's checks and agreement: (the routes, contiguous; the backend). A call
    whose `signature` (validation.call_signature of its routes, x, router weights, routed and shared
    weights, or None) passed on `ws` with this config before skips the metadata checks, which would
    pass again; the workspace's usability and ids read on the host are checked on every call."""
    calls = _checked_calls(ws, "forward")
    found = calls.get(cfg, signature)
    if found is not None:
        backend, host_ids = cast(tuple[Any, bool], found)
        agreement.check_usable(ws)
        te = top_experts.contiguous()
        if host_ids:
            _check_ids_on_host(ws, te)
        return te, backend
    te, backend = _checked_routes(ws, cfg, top_experts)
    _agree_weights(ws, cfg, _check_layer_args(ws, te.shape[0], x, router_weights, routed, shared, cfg.precision))
    calls.add(cfg, signature, (backend, _ids_read_on_host(te, backend)))
    return te, backend


def _checked_calls(ws: Workspace, direction: str) -> CheckedCalls:
    """The calls of one direction ("forward", "backward") that passed their checks on `ws`."""
    calls = ws.state.get(f"checked {direction} calls")
    if calls is None:
        calls = ws.state[f"checked {direction} calls"] = CheckedCalls()
    return calls  # type: ignore[no-any-return]


def schedule_and_forward(
    cfg: MoKConfig,
    ws: Workspace,
    top_experts: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    routed: Weights3,
    shared: Weights3 | None = None,
) -> tuple[Schedule, torch.Tensor, ForwardContext]:
    """`build_schedule` then `forward` in one call: (schedule, y, context), with both calls'
    checks and the same bits. What mok.moe runs outside torch.compile: a backend may issue the
    forward's first kernel before the schedule's last ones (the native backend issues its
    megakernel right after the table, which is all the megakernel reads).

    A call whose arguments have the types, dtypes, shapes, devices and layouts of one that passed
    its checks on `ws` with this config skips the checks that read only those
    (validation.call_signature).
    """
    signature = call_signature(top_experts, x, router_weights, routed, shared)
    return _schedule_and_forward(cfg, ws, top_experts, x, router_weights, routed, shared, signature)


@overload
def _schedule_and_forward(
    cfg: MoKConfig, ws: Workspace, top_experts: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor,
    routed: Weights3, shared: Weights3 | None, signature: tuple | None, *, context: Literal[True] = True,
) -> tuple[Schedule, torch.Tensor, ForwardContext]: ...  # fmt: skip


@overload
def _schedule_and_forward(
    cfg: MoKConfig, ws: Workspace, top_experts: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor,
    routed: Weights3, shared: Weights3 | None, signature: tuple | None, *, context: bool,
) -> tuple[Schedule | None, torch.Tensor, ForwardContext | None]: ...  # fmt: skip


def _schedule_and_forward(
    cfg: MoKConfig, ws: Workspace, top_experts: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor,
    routed: Weights3, shared: Weights3 | None, signature: tuple | None, *, context: bool = True,
) -> tuple[Schedule | None, torch.Tensor, ForwardContext | None]:  # fmt: skip
    """schedule_and_forward with the caller's signature: of these arguments, or of those they were
    made from without a change of any signature's outcome (mok.moe's, before x becomes bf16).
    Without `context` (a forward that no backward follows: mok.moe without autograd) the context
    is None, and a backend that can skips storing what only the backward reads, and may skip
    making the schedule too (None then: the native backend's megakernel at one rank)."""
    te, backend = _checked_forward_call(cfg, ws, top_experts, x, router_weights, routed, shared, signature)
    routed_t, shared_t = tuple(routed), None if shared is None else tuple(shared)
    fused = getattr(backend, "schedule_and_forward", None)
    if fused is not None:
        return fused(cfg, ws, te, x, router_weights, routed_t, shared_t, context=context)  # type: ignore[no-any-return]
    sched = backend.build_schedule(ws, cfg, te)
    y, ctx = backend.forward(cfg, ws, sched, x, router_weights, routed_t, shared_t)
    return sched, y, ctx if context else None


def forward(
    cfg: MoKConfig,
    ws: Workspace,
    sched: Schedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    routed: Weights3,
    shared: Weights3 | None = None,
) -> tuple[torch.Tensor, ForwardContext]:
    """y [T, H] (bf16) and the context backward needs.

    x: [T, H] bf16; router_weights: [T, K] float; routed: (Wg, Wu [El, I, H], Wd [El, H, I])
    bf16; shared: (Wg_s, Wu_s [Is, H], Wd_s [H, Is]) bf16 or None.

    With `precision="mxfp8"`, routed may also be three `MXFP8Tensor` (mok.mxfp8_quantize, both
    copies): the user's prequantized weights; bf16 weights are quantized inside the call.
    H and I must then be multiples of 32; the shared expert stays bf16.
    """
    _check_config(cfg, ws)
    sched = _check_schedule(sched, ws)
    _agree_weights(ws, cfg, _check_layer_args(ws, sched.num_tokens, x, router_weights, routed, shared, cfg.precision))
    backend = resolve_backend(cfg, ws.device)
    return backend.forward(cfg, ws, sched, x, router_weights, tuple(routed), None if shared is None else tuple(shared))


def recompute_forward_context(
    cfg: MoKConfig,
    ws: Workspace,
    sched: Schedule,
    x: torch.Tensor,
    routed: Weights3,
    shared: Weights3 | None = None,
) -> ForwardContext:
    """The context `forward` would return, without computing y (activation checkpointing)."""
    _check_config(cfg, ws)
    sched = _check_schedule(sched, ws)
    _agree_weights(ws, cfg, _check_layer_args(ws, sched.num_tokens, x, None, routed, shared, cfg.precision))
    backend = resolve_backend(cfg, ws.device)
    return backend.recompute_forward_context(
        cfg, ws, sched, x, tuple(routed), None if shared is None else tuple(shared)
    )


def backward(
    cfg: MoKConfig,
    ws: Workspace,
    sched: Schedule,
    ctx: ForwardContext,
    dy: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    routed: Weights3,
    shared: Weights3 | None = None,
    *,
    wgrad_dtype: torch.dtype = torch.bfloat16,
) -> Grads:
    """Gradients of one layer call given dy [T, H] (bf16).

    Weight gradients are accumulated in fp32 and returned in `wgrad_dtype` (bf16 or fp32);
    d_router_weights has the dtype of router_weights. As in schedule_and_forward, a call like one
    that passed its checks skips those that read only its arguments' metadata.
    """
    signature = call_signature(x, router_weights, routed, shared, dy)
    return _backward(cfg, ws, sched, ctx, dy, x, router_weights, routed, shared, wgrad_dtype, signature)


def _backward(
    cfg: MoKConfig, ws: Workspace, sched: Schedule, ctx: ForwardContext, dy: torch.Tensor, x: torch.Tensor,
    router_weights: torch.Tensor, routed: Weights3, shared: Weights3 | None, wgrad_dtype: torch.dtype,
    signature: tuple | None,
) -> Grads:  # fmt: skip
    """backward with the caller's signature: of these arguments (validation.call_signature of x,
    router_weights, routed, shared and dy), or one that decides every metadata check's outcome as
    well (autograd.Layer's: its forward's, tagged, as autograd gives dy the shape, dtype and device
    of the forward's y)."""
    _check_config(cfg, ws)
    sched = _check_schedule(sched, ws)
    # Metadata checks once per signature, as in schedule_and_forward (T is the schedule's).
    key = None if signature is None else (signature, sched.num_tokens)
    calls = _checked_calls(ws, "backward")
    if calls.get(cfg, key) is None:
        _agree_weights(
            ws, cfg, _check_layer_args(ws, sched.num_tokens, x, router_weights, routed, shared, cfg.precision)
        )
        check_tensor("dy", dy, dtypes=BF16, shape=[("T", sched.num_tokens), ("H", ws.hidden_size)], device=ws.device)
        calls.add(cfg, key, True)
    else:
        agreement.check_usable(ws)
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"ctx must be the ForwardContext of forward(), got {type(ctx).__name__}")
    if ctx.schedule is not sched:
        raise ValueError("ctx was made by forward() with another schedule")
    if (ctx.shared_a_TIs is None) != (shared is None):
        raise ValueError("shared must be given to backward() exactly when it was given to forward()")
    if wgrad_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"wgrad_dtype must be torch.bfloat16 or torch.float32, got {wgrad_dtype}")
    backend = resolve_backend(cfg, ws.device)
    if backend.name != ctx.backend:
        raise ValueError(f"ctx was made by backend {ctx.backend!r}, but cfg resolves to {backend.name!r}")
    return backend.backward(
        cfg,
        ws,
        sched,
        ctx,
        dy,
        x,
        router_weights,
        tuple(routed),
        None if shared is None else tuple(shared),
        wgrad_dtype,
    )
