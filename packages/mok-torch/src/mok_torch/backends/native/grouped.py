"""mok-bf16's grouped expert forward and backward on tensors: the experts over segments of
consecutive rows.

`grouped_forward` and `grouped_backward` check their tensors, allocate the outputs (and the
backward's scratch) and call `launch_forward` / `launch_backward`, which pass them to
`mok_bf16.grouped_forward` / `grouped_backward` on the current stream (the native backend calls
the launches directly with tensors it made itself). On CUDA it runs the tensor-core GEMMs
(sm_90a wgmma, `packages/mok-bf16/cuda/sm90/grouped_gemm.cuh`): each element one fp32 sum in a
fixed order, so a row's bits depend only on that row and its expert's weights (not the
reference's sequential sum: docs/determinism.md "The GPU GEMMs"). On the CPU it runs the
reference arithmetic.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ...validation import check_tensor
from .transport import core_entry_points, current_stream_handle

BF16 = torch.bfloat16


class GroupedForward(NamedTuple):
    a: torch.Tensor  # [M, I] bf16: x @ Wg^T
    b: torch.Tensor  # [M, I] bf16: x @ Wu^T
    h: torch.Tensor | None  # [M, I] bf16: silu(a_c) * b_c, None when not asked for
    y: torch.Tensor | None  # [M, H] bf16: h @ Wd^T, None when not asked for


def _check_rows_and_weights(
    x_MH: torch.Tensor,
    offsets_El1: torch.Tensor,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EHI: torch.Tensor | None,
) -> tuple[torch.device, int, int, int, int]:
    """(device, M, H, El, I) of the rows, segment offsets and expert weights, all checked."""
    x_MH = check_tensor("x", x_MH, dtypes=(BF16,), shape=[("M", None), ("H", None)])
    dev = x_MH.device
    M, H = x_MH.shape
    check_tensor("w_gate", w_gate_EIH, dtypes=(BF16,), shape=[("El", None), ("I", None), ("H", H)], device=dev)
    El, I = w_gate_EIH.shape[:2]
    check_tensor("offsets", offsets_El1, dtypes=(torch.int64,), shape=[("El+1", El + 1)], device=dev)
    check_tensor("w_up", w_up_EIH, dtypes=(BF16,), shape=[("El", El), ("I", I), ("H", H)], device=dev)
    if w_down_EHI is not None:
        check_tensor("w_down", w_down_EHI, dtypes=(BF16,), shape=[("El", El), ("H", H), ("I", I)], device=dev)
    return dev, M, H, El, I


def grouped_forward(
    x_MH: torch.Tensor,
    offsets_El1: torch.Tensor,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EHI: torch.Tensor | None,
    limit: float | None = None,
    num_sms: int = 0,
    out: GroupedForward | None = None,
    with_h: bool = True,
    zero_outside: bool | None = None,
) -> GroupedForward:
    """The SwiGLU experts on rows [offsets[e], offsets[e+1]) of x for each local expert e.

    offsets: int64 [El + 1], non-decreasing within [0, M] (on CUDA they stay on the device and
    are clamped there, an end below its start making that segment empty; on the CPU a bad one
    raises ValueError). Rows outside every segment are
    left as `out` has them (zeros in fresh outputs), or zeroed by the call with zero_outside=True
    (None: zeroed in fresh outputs only). w_down None: a, b and h only; with_h=False as well: a and
    b only (h is None).
    """
    dev, M, H, _, I = _check_rows_and_weights(x_MH, offsets_El1, w_gate_EIH, w_up_EIH, w_down_EHI)
    if not with_h and w_down_EHI is not None:
        raise ValueError("with_h=False needs w_down=None: the down projection reads h")
    if not isinstance(num_sms, int) or num_sms < 0:
        raise ValueError(f"num_sms must be an int >= 0 (0: every SM), got {num_sms!r}")
    if zero_outside is not None and not isinstance(zero_outside, bool):
        raise TypeError(f"zero_outside must be a bool or None, got {type(zero_outside).__name__}")
    # Fresh outputs have their rows outside the segments zeroed by the call (given ones on request).
    zero = out is None if zero_outside is None else zero_outside
    if out is None:
        out = GroupedForward(
            torch.empty(M, I, dtype=BF16, device=dev),
            torch.empty(M, I, dtype=BF16, device=dev),
            torch.empty(M, I, dtype=BF16, device=dev) if with_h else None,
            None if w_down_EHI is None else torch.empty(M, H, dtype=BF16, device=dev),
        )
    else:  # given outputs are checked (fresh ones are right by construction)
        rows_I = [("M", M), ("I", I)]
        check_tensor("out.a", out.a, dtypes=(BF16,), shape=rows_I, device=dev)
        check_tensor("out.b", out.b, dtypes=(BF16,), shape=rows_I, device=dev)
        if with_h:
            if out.h is None:
                raise ValueError("out.h must be a tensor unless with_h=False")
            check_tensor("out.h", out.h, dtypes=(BF16,), shape=rows_I, device=dev)
        if w_down_EHI is not None:
            if out.y is None:
                raise ValueError("out.y must be a tensor when w_down is given")
            check_tensor("out.y", out.y, dtypes=(BF16,), shape=[("M", M), ("H", H)], device=dev)
    on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with on_device:
        launch_forward(x_MH, offsets_El1, w_gate_EIH, w_up_EIH, w_down_EHI, out, limit=limit, num_sms=num_sms,
                       with_h=with_h, zero_outside=zero)  # fmt: skip
    return out


def launch_forward(
    x_MH: torch.Tensor,
    offsets_El1: torch.Tensor,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EHI: torch.Tensor | None,
    out: GroupedForward,
    *,
    limit: float | None,
    num_sms: int = 0,
    with_h: bool = True,
    zero_outside: bool,
) -> None:
    """mok_bf16.grouped_forward into `out` on the current device, without grouped_forward's checks
    or device guard: for tensors made to shape by their caller on the device it made current (the
    native backend's own: the GEMMs' Python checks cost ~0.1 ms of host time before the launch in a
    cold call). mok_bf16 still checks the addresses and sizes."""
    import mok_bf16

    M, H = x_MH.shape
    El, I = w_gate_EIH.shape[:2]
    dev = x_MH.device
    mok_bf16.grouped_forward(
        dev.type,
        x_MH.data_ptr(),
        offsets_El1.data_ptr(),
        w_gate_EIH.data_ptr(),
        w_up_EIH.data_ptr(),
        0 if w_down_EHI is None else w_down_EHI.data_ptr(),
        out.a.data_ptr(),
        out.b.data_ptr(),
        out.h.data_ptr() if with_h and out.h is not None else 0,
        0 if out.y is None or w_down_EHI is None else out.y.data_ptr(),
        M,
        H,
        I,
        El,
        limit=limit,
        num_sms=num_sms,
        num_threads=torch.get_num_threads() if dev.type == "cpu" else 1,
        stream=current_stream_handle(dev) if dev.type == "cuda" else 0,
        zero_outside=zero_outside,
    )


class GroupedBackward(NamedTuple):
    dx: torch.Tensor  # [M, H] bf16: [d_a, d_b] @ [Wg; Wu]
    d_w: torch.Tensor  # [M] fp32: <g, h>, g = dy @ Wd (unweighted)


class GroupedScratch(NamedTuple):
    """What the CUDA backward's kernels pass each other (pass one in to read it back). g is
    required where I > mok_bf16.G_SWIGLU_MAX_INNER; at or below it the SwiGLU backward runs in the
    g GEMM's epilogue, which needs no g array, and g is written only where given (a test passes
    one to read g back)."""

    g: torch.Tensor | None  # [M, I] fp32: dy @ Wd, unweighted
    hw: torch.Tensor  # [M, I] bf16: bf16(w h), h = silu(a_c) * b_c (h itself for unweighted rows)
    d_ab: torch.Tensor  # [M, 2I] bf16: d_a then d_b


Wgrads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _rows_by_route(
    name: str,
    tokens: torch.Tensor,
    weight_route: torch.Tensor | None,
    num_routes: int,
    H: int,
    dev: torch.device,
    route_valid: torch.Tensor | None,
    route_at: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token rows [T, H] read by each table row's route (dy_tokens, x_tokens), checked; with, off
    CUDA, those rows in table order (zeros for a route outside [0, T*K)), else None."""
    if weight_route is None:
        raise ValueError(f"{name} needs weight_route (each row's route)")
    tokens = check_tensor(name, tokens, dtypes=(BF16,), shape=[("T", None), ("H", H)], device=dev)
    T = tokens.shape[0]
    if T == 0 or num_routes % T != 0:
        raise ValueError(f"{name}: router_weights must hold T*K routes for T = {T} tokens, got {num_routes}")
    if dev.type == "cuda":
        return tokens, None
    assert route_valid is not None and route_at is not None
    zero = torch.zeros((), dtype=BF16)
    return tokens, torch.where(route_valid[:, None], tokens[route_at // (num_routes // T)], zero)


def grouped_backward(
    x_MH: torch.Tensor,
    offsets_El1: torch.Tensor,
    a_MI: torch.Tensor,
    b_MI: torch.Tensor,
    dy_MH: torch.Tensor,
    router_weights_M: torch.Tensor | None,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    acc: Wgrads | None,
    limit: float | None = None,
    num_sms: int = 0,
    out: GroupedBackward | None = None,
    scratch: GroupedScratch | None = None,
    *,
    carry_in: bool = True,
    wgrad_out: Wgrads | None = None,
    weight_route: torch.Tensor | None = None,
    dy_tokens: torch.Tensor | None = None,
    dwd_gather: int = -1,
    x_tokens: torch.Tensor | None = None,
    dw1_mode: int = 0,
) -> GroupedBackward:
    """The SwiGLU experts' backward on rows [offsets[e], offsets[e+1]) for each local expert e.

    Returns dx and d_w of those rows (other rows as `out` has them: zeros in fresh outputs).
    `out.dx` may be `dy_MH` itself: each row of dy is read before its dx is written (on CUDA the
    weight gradient dWd, dy's last reader, runs before dx's GEMM).
    The weight gradients dWg = C + sum d_a^T x, dWu = C + sum d_b^T x and dWd (the CPU: C + sum
    bf16(w dy)^T h, the reference's; CUDA: C + sum dy^T bf16(w h), the weight on h's side, which
    the g GEMM's SwiGLU epilogue writes in h's place) start from C = the fp32 accumulators `acc` when carry_in (else
    +0) and go to `acc` (fp32, in place) and/or `wgrad_out` (bf16, rounded once): the last of
    several calls can hand out bf16 gradients directly. router_weights None: all ones (the shared
    expert). On CUDA the weight gradients take each expert's rows in 64-row blocks from its
    segment start, so calls split at multiples of 64 rows from every segment start give the bits
    of one call (docs/determinism.md "The GPU GEMMs"). `scratch`: the CUDA kernels' intermediate
    arrays (allocated when None; unused on the CPU); its g is written only where it is given.

    `weight_route` (int32 [M], each row's route; -1 a padding row): router_weights_M is then the
    routes' weights [T*K] and row r's weight router_weights[weight_route[r]] (0 for a route
    outside [0, T*K)), read by route on CUDA (no copy in table order), copied into table order
    on the CPU: the bits of the call with the weights in table order.

    `dy_tokens` (bf16 [T, H] contiguous, with weight_route; T*K routes: router_weights [T*K]): dy's
    rows are then read by route, row r's dy = dy_tokens[weight_route[r] // K] (zeros for a route
    outside [0, T*K)), and dy_MH is the call's scratch: on CUDA the g GEMM gathers the rows itself
    (no pass moves rows), and so does the weight gradient dWd where `dwd_gather` says so (-1: where
    I <= 256 and the device's memory bandwidth is below 4 TB/s, 0: never, 1: always); otherwise the
    g GEMM stores them into dy_MH in table order for dWd. The bits are the same either way. dy_MH
    is never read (out.dx may be it); on the CPU the rows are copied into dy_MH first.

    `dw1_mode` (CUDA; the CPU computes dWg, dWu from x_MH as the reference does): how dWg and dWu
    are computed, the same bits in every mode: 0 as [d_a, d_b]^T x ([2I, H] tiles); 1 as
    x^T [d_a, d_b] ([H, 2I] tiles stored transposed, x then being the operand dWd's dy is); 2 as 1
    with x's rows gathered by dW1 itself from `x_tokens` (bf16 [T, H], with weight_route and T*K
    routes: row r's x is x_tokens[weight_route[r] // K], zeros for a route outside [0, T*K)), x_MH
    then not read.
    """
    dev, M, H, El, I = _check_rows_and_weights(x_MH, offsets_El1, w_gate_EIH, w_up_EIH, w_down_EHI)
    rows_I = [("M", M), ("I", I)]
    check_tensor("a", a_MI, dtypes=(BF16,), shape=rows_I, device=dev)
    check_tensor("b", b_MI, dtypes=(BF16,), shape=rows_I, device=dev)
    check_tensor("dy", dy_MH, dtypes=(BF16,), shape=[("M", M), ("H", H)], device=dev)
    num_routes = 0
    route_valid = route_at = None  # on the CPU: which rows have a route in [0, T*K), and it (else 0)
    if weight_route is not None:
        check_tensor("weight_route", weight_route, dtypes=(torch.int32,), shape=[("M", M)], device=dev)
        if router_weights_M is None:
            raise ValueError("weight_route needs router_weights (the routes' weights [T*K])")
        check_tensor("router_weights", router_weights_M, dtypes=(torch.float32,), shape=[("T*K", None)], device=dev)
        num_routes = router_weights_M.shape[0]
        if dev.type != "cuda":  # as the kernel: a route outside [0, T*K) weighs 0
            idx = weight_route.long()
            route_valid = (idx >= 0) & (idx < num_routes)
            route_at = torch.where(route_valid, idx, 0)
            router_weights_M = torch.where(route_valid, router_weights_M[route_at], 0.0).contiguous()
    elif router_weights_M is not None:
        check_tensor("router_weights", router_weights_M, dtypes=(torch.float32,), shape=[("M", M)], device=dev)
    if dy_tokens is not None:
        dy_tokens, table = _rows_by_route(
            "dy_tokens", dy_tokens, weight_route, num_routes, H, dev, route_valid, route_at
        )
        if table is not None:  # as the kernels: a route outside [0, T*K) reads zeros
            dy_MH.copy_(table)
    if dw1_mode not in (0, 1, 2) or isinstance(dw1_mode, bool):
        raise ValueError(f"dw1_mode must be 0, 1 or 2, got {dw1_mode!r}")
    if x_tokens is not None:
        if dw1_mode != 2:
            raise ValueError("x_tokens is read only with dw1_mode=2 (x gathered by route)")
        x_tokens, table = _rows_by_route("x_tokens", x_tokens, weight_route, num_routes, H, dev, route_valid, route_at)
        T = x_tokens.shape[0]
        if dy_tokens is not None and dy_tokens.shape[0] != T:
            raise ValueError(f"x_tokens and dy_tokens must have the same tokens, got {T} and {dy_tokens.shape[0]}")
        if table is not None:  # the rows the kernel would gather, in a table-ordered array of their own
            x_MH = table
    elif dw1_mode == 2:
        raise ValueError("dw1_mode=2 needs x_tokens (the token rows x's rows are gathered from)")
    if acc is None and wgrad_out is None:
        raise ValueError("acc or wgrad_out must be given: where the weight gradients go")
    if carry_in and acc is None:
        raise ValueError("carry_in=True needs acc (the fp32 accumulators to start from)")
    shapes = ([("El", El), ("I", I), ("H", H)], [("El", El), ("I", I), ("H", H)], [("El", El), ("H", H), ("I", I)])
    for group, dtype, given in (("acc", torch.float32, acc), ("wgrad_out", BF16, wgrad_out)):
        if given is None:
            continue
        if not isinstance(given, tuple) or len(given) != 3:
            raise TypeError(f"{group} must be a tuple (dWg, dWu, dWd) of tensors")
        for name, t, shape in zip(("gate", "up", "down"), given, shapes, strict=True):
            check_tensor(f"{group}.{name}", t, dtypes=(dtype,), shape=shape, device=dev)
    if not isinstance(num_sms, int) or num_sms < 0:
        raise ValueError(f"num_sms must be an int >= 0 (0: every SM), got {num_sms!r}")
    if dwd_gather not in (-1, 0, 1) or isinstance(dwd_gather, bool):
        raise ValueError(f"dwd_gather must be -1 (by the device), 0 or 1, got {dwd_gather!r}")
    fresh = out is None  # fresh outputs: their rows outside the segments zeroed by the call
    if out is None:
        out = GroupedBackward(
            torch.empty(M, H, dtype=BF16, device=dev), torch.empty(M, dtype=torch.float32, device=dev)
        )
    else:  # given outputs are checked (fresh ones are right by construction)
        check_tensor("out.dx", out.dx, dtypes=(BF16,), shape=[("M", M), ("H", H)], device=dev)
        check_tensor("out.d_w", out.d_w, dtypes=(torch.float32,), shape=[("M", M)], device=dev)
    cuda = dev.type == "cuda"
    if cuda and M == 0:
        # No kernel runs without rows: the weight gradients are C (carried in) or +0.
        for i in range(3):
            if carry_in:
                assert acc is not None
                if wgrad_out is not None:
                    wgrad_out[i].copy_(acc[i])
            else:
                if acc is not None:
                    acc[i].zero_()
                if wgrad_out is not None:
                    wgrad_out[i].zero_()
        return out
    if cuda and scratch is None:
        scratch = backward_scratch(M, I, dev)
    elif cuda and scratch is not None:
        if scratch.g is not None or I > g_swiglu_max_inner():
            check_tensor("scratch.g", scratch.g, dtypes=(torch.float32,), shape=rows_I, device=dev)
        check_tensor("scratch.hw", scratch.hw, dtypes=(BF16,), shape=rows_I, device=dev)
        check_tensor("scratch.d_ab", scratch.d_ab, dtypes=(BF16,), shape=[("M", M), ("2I", 2 * I)], device=dev)
    on_device = torch.cuda.device(dev) if cuda else contextlib.nullcontext()
    with on_device:
        launch_backward(x_MH, offsets_El1, a_MI, b_MI, dy_MH, router_weights_M, w_gate_EIH, w_up_EIH, w_down_EHI,
                        out, scratch if cuda else None, acc, wgrad_out, limit=limit, num_sms=num_sms,
                        carry_in=carry_in, zero_outside=fresh, weight_route=weight_route if cuda else None,
                        dy_tokens=dy_tokens if cuda else None, dwd_gather=dwd_gather,
                        x_tokens=x_tokens if cuda else None, dw1_mode=dw1_mode if cuda else 0)  # fmt: skip
    return out


def g_swiglu_max_inner() -> int:
    """The widest I whose CUDA backward needs no g array (mok_bf16.G_SWIGLU_MAX_INNER)."""
    import mok_bf16

    return int(mok_bf16.G_SWIGLU_MAX_INNER)


def backward_scratch(M: int, I: int, device: torch.device) -> GroupedScratch:
    """Fresh scratch arrays for the CUDA backward's kernels over M rows (no g where the fused g
    kernel runs: I <= mok_bf16.G_SWIGLU_MAX_INNER)."""
    return GroupedScratch(
        torch.empty(M, I, dtype=torch.float32, device=device) if I > g_swiglu_max_inner() else None,
        torch.empty(M, I, dtype=BF16, device=device),
        torch.empty(M, 2 * I, dtype=BF16, device=device),
    )


def launch_backward(
    x_MH: torch.Tensor,
    offsets_El1: torch.Tensor,
    a_MI: torch.Tensor,
    b_MI: torch.Tensor,
    dy_MH: torch.Tensor,
    router_weights: torch.Tensor | None,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    out: GroupedBackward,
    scratch: GroupedScratch | None,
    acc: Wgrads | None,
    wgrad_out: Wgrads | None,
    *,
    limit: float | None,
    num_sms: int = 0,
    carry_in: bool,
    zero_outside: bool,
    weight_route: torch.Tensor | None = None,
    dy_tokens: torch.Tensor | None = None,
    dwd_gather: int = -1,
    x_tokens: torch.Tensor | None = None,
    dw1_mode: int = 0,
) -> None:
    """mok_bf16.grouped_backward into `out`, `acc` and `wgrad_out` on the current device, without
    grouped_backward's checks, allocations or device guard: for tensors made to shape by their
    caller on the device it made current (the native backend's own: the wrapper's checks cost
    ~170 us of host before the first launch, NOTES.md session 30). At least one row (M > 0);
    `scratch` given on CUDA; weight_route and dy_tokens (CUDA only: the kernels read through the
    routes), dwd_gather, x_tokens and dw1_mode as grouped_backward takes them. mok_bf16 still checks
    the addresses and sizes."""
    import mok_bf16

    M, H = x_MH.shape
    El, I = w_gate_EIH.shape[:2]
    dev = x_MH.device
    cuda = dev.type == "cuda"
    num_routes = 0 if weight_route is None or router_weights is None else router_weights.shape[0]
    tokens = dy_tokens if dy_tokens is not None else x_tokens
    topk = 1 if tokens is None or tokens.shape[0] == 0 else num_routes // tokens.shape[0]
    g_ptr, hw_ptr, d_ab_ptr = (0, 0, 0) if scratch is None else (0 if t is None else t.data_ptr() for t in scratch)
    acc_ptrs = (0, 0, 0) if acc is None else tuple(t.data_ptr() for t in acc)
    out_ptrs = (0, 0, 0) if wgrad_out is None else tuple(t.data_ptr() for t in wgrad_out)
    mok_bf16.grouped_backward(
        dev.type,
        x_MH.data_ptr(),
        offsets_El1.data_ptr(),
        a_MI.data_ptr(),
        b_MI.data_ptr(),
        dy_MH.data_ptr(),
        0 if router_weights is None else router_weights.data_ptr(),
        w_gate_EIH.data_ptr(),
        w_up_EIH.data_ptr(),
        w_down_EHI.data_ptr(),
        out.dx.data_ptr(),
        out.d_w.data_ptr(),
        acc_ptrs[0],
        acc_ptrs[1],
        acc_ptrs[2],
        out_ptrs[0],
        out_ptrs[1],
        out_ptrs[2],
        carry_in,
        g_ptr,
        hw_ptr,
        d_ab_ptr,
        M,
        H,
        I,
        El,
        limit=limit,
        num_sms=num_sms,
        num_threads=torch.get_num_threads() if not cuda else 1,
        stream=current_stream_handle(dev) if cuda else 0,
        zero_outside=zero_outside,
        weight_route=0 if weight_route is None else weight_route.data_ptr(),
        num_routes=num_routes,
        dy_tokens=0 if dy_tokens is None else dy_tokens.data_ptr(),
        topk=topk,
        dwd_gather=dwd_gather,
        x_tokens=0 if x_tokens is None else x_tokens.data_ptr(),
        dw1_mode=dw1_mode,
    )


def backward_call(
    offsets32_El1: torch.Tensor,
    row_route_C: torch.Tensor,
    route_row_TK: torch.Tensor,
    x_CH: torch.Tensor | None,
    a_CI: torch.Tensor,
    b_CI: torch.Tensor,
    dy_TH: torch.Tensor,
    router_weights_TK: torch.Tensor,
    weights: Wgrads,
    wgrads: Wgrads,
    base_TH: torch.Tensor | None,
    *,
    x_TH: torch.Tensor | None = None,
    limit: float | None,
    error: int = 0,
    mirror: int = 0,
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's direct backward in one extension call (mok_bf16.moe_backward_call, CUDA only):
    the table's offsets widened to int64, launch_backward's kernels with dy and the router weights
    read by each row's route (dy_tokens, weight_route) and d_w stored by route, then mok-core's
    combine of the dx rows through the routes' rows onto `base_TH` (the shared expert's dx, or
    None); (dx bf16 [T, H], d_router fp32 [T, K]). The bits of launch_backward then the combine
    and d_w gathered by route, with one crossing from Python and no Python-level kernel launch
    (docs/megakernel.md, "The host").

    Every tensor made to shape by the caller on the current device: the table's arrays
    (offsets32_El1 int32 [El + 1], row_route_C int32 [C], route_row_TK int32 [T, K]), the context's
    rows (x_CH, a_CI, b_CI bf16, C rows), dy_TH bf16 [T, H] and router_weights_TK fp32 [T, K]
    contiguous, the routed weights bf16 contiguous, and `wgrads` the weight gradients written
    whole (bf16, or fp32 for fp32 parameters). T >= 1. error and mirror: the transport's error
    words' address and its ErrorMirror's device address, to which the combine publishes the words
    (0 and 0: none). x_CH None: dW1 gathers x's rows by route from x_TH (bf16 [T, H] contiguous,
    the forward's token rows; grouped_backward's dw1_mode 2), the forward having stored none."""
    import mok_bf16

    C, H = a_CI.shape[0], dy_TH.shape[1]
    if (x_CH is None) == (x_TH is None):
        raise ValueError("backward_call takes x's rows in table order (x_CH) or the token rows (x_TH), one of them")
    T, K = router_weights_TK.shape
    wg, wu, wd = weights
    El, inner = wg.shape[:2]
    dev = dy_TH.device
    # One scratch allocation: dy's rows in table order (then dx's), g (fp32; none where the SwiGLU
    # backward runs in the g GEMM's epilogue, I <= G_SWIGLU_MAX_INNER), bf16(w h), [d_a, d_b] and
    # the int64 offsets; every part 16-byte aligned (H and I are multiples of 64).
    g_bytes = C * inner * 4 if inner > mok_bf16.G_SWIGLU_MAX_INNER else 0
    parts = (C * H * 2, g_bytes, C * inner * 2, C * inner * 4, 8 * (El + 1))
    scratch = torch.empty(sum(parts), dtype=torch.uint8, device=dev)
    at = [scratch.data_ptr()]
    for n in parts[:-1]:
        at.append(at[-1] + n)
    dys, g, hw, d_ab, offsets64 = at
    g = g if g_bytes else 0
    d_router = torch.empty(T, K, dtype=torch.float32, device=dev)
    dx = torch.empty(T, H, dtype=BF16, device=dev)
    fp32 = wgrads[0].dtype == torch.float32
    acc = tuple(t.data_ptr() for t in wgrads) if fp32 else (0, 0, 0)
    out = (0, 0, 0) if fp32 else tuple(t.data_ptr() for t in wgrads)
    mok_bf16.moe_backward_call(
        core_entry_points(), "cuda", offsets32_El1.data_ptr(), offsets64, 0 if x_CH is None else x_CH.data_ptr(),
        a_CI.data_ptr(), b_CI.data_ptr(), dys, router_weights_TK.data_ptr(), row_route_C.data_ptr(), dy_TH.data_ptr(),
        0 if x_TH is None else x_TH.data_ptr(), T, K,
        wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), d_router.data_ptr(), *acc, *out, g, hw, d_ab, C, H, inner, El,
        limit, dx.data_ptr(), 0 if base_TH is None else base_TH.data_ptr(), route_row_TK.data_ptr(), error, mirror,
        stream,
    )  # fmt: skip
    return dx, d_router
