"""The forward megakernel on tensors: `mok_bf16.moe_forward`, with its outputs and task state
(and, on the CPU, the backward's mirror of its host protocol: `moe_backward`).

One persistent launch runs every routed expert tile of a layer call (docs/megakernel.md): the
gate/up tiles gather their x rows from the token rows by the schedule table (and store them in
table order: the routed x the backward reads), the down tiles wait on per-row-tile counters and
store each output row at its route. The cuda backend calls it
between the schedule and the combine; its bits are those of the chain of grouped kernels.

On the CPU the same call is mok-bf16's CPU model of it (one C++ call, the bits of the CPU chain),
at one rank and across ranks (`Ranks`: each table row read from its source rank's token rows and
its output stored into that rank's rows, by address, between the transport's barriers 3 and 4).
The GPU kernel takes the same per-rank arguments (tested on one GPU with several ranks' rows); the
cuda backend's `expert_path` still runs the chain across ranks until that is measured on two GPUs
(docs/megakernel.md "Where it stands").

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from ...structs import Schedule
from ...workspace import Workspace
from .transport import core_entry_points, current_stream_handle

BF16 = torch.bfloat16
# The transport's stage number a timed-out dependency reports (transport.STAGES names it).
STAGE = 9
# A timed launch's accounts per CTA and role (producer, consumer 0, consumer 1), in this order:
# cuda/sm90/moe_forward.cu's Timer.
TIMER_ROLES = ("producer", "consumer 0", "consumer 1")
TIMER_SLOTS = ("ticket", "gate/up", "swiglu", "down", "stage wait", "dependency", "flush", "total", "tasks")


class Ranks(NamedTuple):
    """A call across ranks: where each table row's x comes from and its y goes, by address."""

    row_src_C: int  # the table's row_src_rank_C (int32 [C]): each row's source rank
    x_R: torch.Tensor  # int64 [R] on the device: each rank's token rows (bf16 [max_tokens, H], the transport's x_src)
    rows_R: torch.Tensor  # int64 [R] on the device: each rank's output rows (bf16 [max_tokens * K, H], its `rows`)


class Outputs(NamedTuple):
    """What a launch leaves for the backward: every table row's pre-activations and x."""

    a: torch.Tensor  # [C, I] bf16, zero past the last segment
    b: torch.Tensor  # [C, I] bf16, zero past the last segment
    # [C, H] bf16: x[route // K] of each row, zero for padding and past the last segment; None where
    # the launch stored none (the backward's dW1 then gathers the rows by route from x itself)
    x: torch.Tensor | None


def task_state(ws: Workspace) -> torch.Tensor:
    """The workspace's ticket queue and dependency counters (zero; every launch leaves them zero)."""
    state = ws.state.get("megakernel")
    if state is None:
        import mok_bf16

        nbytes = mok_bf16.moe_forward_state_bytes(ws.capacity, ws.num_local_experts)
        state = ws.state["megakernel"] = torch.zeros(-(-nbytes // 8), dtype=torch.int64, device=ws.device)
    return state


def _scratch_h(ws: Workspace, inner: int) -> torch.Tensor:
    """h [C, I] bf16: written at the gate/up tiles' ends and read by the down tiles of the same launch
    only, so one buffer per workspace serves every call (the stream orders them)."""
    h = ws.state.get("megakernel h")
    if h is None or h.shape[1] != inner:
        h = ws.state["megakernel h"] = torch.empty(ws.capacity, inner, dtype=BF16, device=ws.device)
    return h


def _outputs(C: int, H: int, inner: int, device: torch.device, store_x: bool = True) -> Outputs:
    """A launch's context arrays for C table rows, uninitialised (the launch writes every row); no x
    rows unless store_x."""
    return Outputs(
        torch.empty(C, inner, dtype=BF16, device=device),
        torch.empty(C, inner, dtype=BF16, device=device),
        torch.empty(C, H, dtype=BF16, device=device) if store_x else None,
    )


def moe_forward(
    ws: Workspace,
    row_route_C: int,
    expert_offsets_El1: int,
    x_TH: torch.Tensor,
    routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows_out: torch.Tensor,
    error: torch.Tensor,
    *,
    limit: float | None,
    timeout_ns: int,
    num_sms: int = 0,
    inject_missing_dependency: bool = False,
    timers: torch.Tensor | None = None,
    context: bool = True,
    ranks: Ranks | None = None,
    rows: int | None = None,
) -> Outputs | None:
    """The routed experts of one call: y of every route into rows_out [>= T*K, H] (row t*K + k);
    returned, the pre-activations a, b [C, I] and the x rows [C, H] of every table row (Outputs:
    the context the backward reads, so that it moves no rows). Without `context` (a forward that no
    backward follows) the launch stores none of them and None is returned: y's bits are the same.

    row_route_C and expert_offsets_El1: the addresses of the schedule table's arrays of those names
    (Schedule's fields: the table alone, which the backend issues before the rest of the schedule,
    and whose tensors it makes after this launch); K is the workspace's.
    x_TH bf16 [T, H] contiguous; routed (Wg, Wu [El, I, H], Wd [El, H, I]) bf16 contiguous (as the
    functional API's checks leave them); error the
    transport's int32 [4] error words (a dependency that times out is recorded there).
    timers: a probe's int64 [CTAs * 3 * 9] (zeroed by the kernel's roles as they finish): the
    timed kernel adds up clock64 cycles per CTA and role (TIMER_SLOTS; benchmarks/probes/
    megakernel_timers.py reads them); None runs the untimed kernel.
    ranks: a call across the workspace's ranks; x_TH and rows_out are then not read (each rank's
    rows are `ranks`': on the GPU device tensors of addresses, a peer's mapped segment or this
    device's), and every rank's routes are below max_tokens * K.
    rows (the CPU only): the table rows it runs and the context holds, the capacity's first `rows`
    (the CPU's chain reads the end of the last segment on the host and keeps that many; None: the
    capacity, as the GPU's launch, which reads no device value on the host).
    """
    import mok_bf16

    if timers is not None:
        _check_timers(timers, x_TH.device, num_sms)
    wg, wu, wd = routed
    T, H = x_TH.shape
    El, inner = wg.shape[:2]
    dev = x_TH.device
    cpu = dev.type == "cpu"
    if rows is not None and not (cpu and 0 <= rows <= ws.capacity):
        raise ValueError(f"rows must be in [0, capacity = {ws.capacity}] and given on the CPU only, got {rows}")
    C = ws.capacity if rows is None else rows
    out = _outputs(C, H, inner, dev) if context else None
    a, b, x_rows = (0, 0, 0) if out is None else (0 if t is None else t.data_ptr() for t in out)
    h = _scratch_h(ws, inner)  # (the capacity's rows: C of them are used)
    across: dict[str, int] = {}
    if ranks is not None:  # every rank's token rows: the table's routes reach max_tokens * K
        T = ws.max_tokens
        across = dict(world_size=ws.world_size, row_src=ranks.row_src_C, x_ranks=ranks.x_R.data_ptr(),
                      out_rows_ranks=ranks.rows_R.data_ptr())  # fmt: skip
    mok_bf16.moe_forward(
        dev.type, x_TH.data_ptr(), row_route_C, expert_offsets_El1,
        wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), a, b, h.data_ptr(),
        rows_out.data_ptr(), 0 if cpu else task_state(ws).data_ptr(), error.data_ptr(), C, T, H, inner, El, ws.topk,
        limit=limit, num_sms=num_sms, timeout_ns=timeout_ns, stage=STAGE, rank=ws.rank,
        inject_missing_dependency=inject_missing_dependency, stream=0 if cpu else current_stream_handle(dev),
        timers=0 if timers is None else timers.data_ptr(), out_x=x_rows,
        num_threads=max(1, torch.get_num_threads()), **across,
    )  # fmt: skip
    return out


def moe_backward(
    ws: Workspace,
    sched: Schedule,
    context: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ptrs: dict[str, torch.Tensor],
    view: dict[str, torch.Tensor],
    dy_TH: torch.Tensor,
    w_TK: torch.Tensor,
    *,
    limit: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' backward of one call on the host in one call (`mok_bf16.moe_backward`,
    "cpu": the mirror of the forward's per-rank form): each table row's dy and router weight read
    from its source rank's `dy_src` and `w_src` (at one rank dy_TH and w_TK themselves: bf16 [T, H]
    and fp32 [T*K], contiguous), its dx row and d_w stored into that rank's `rows` and `d_w` at its
    route (a push combine's fields: the caller's barriers order them), the weight gradients of this
    rank's experts from +0. context: the forward's (x, a, b) rows in table order (the capacity's
    first rows the forward ran); sched: the call's Schedule; ptrs / view: the transport's fields by
    rank (int64 [R] addresses) and this rank's own. Returns the fp32 weight gradients (dWg, dWu
    [El, I, H], dWd [El, H, I])."""
    import mok_bf16

    x, a, b = context
    wg, wu, wd = (w.contiguous() for w in routed)
    El, inner, H = wg.shape
    acc = [torch.empty(El, inner, H), torch.empty(El, inner, H), torch.empty(El, H, inner)]
    R = ws.world_size
    T = ws.max_tokens if R > 1 else sched.num_tokens
    mok_bf16.moe_backward(
        "cpu", x.data_ptr(), a.data_ptr(), b.data_ptr(), sched.row_route_C.data_ptr(),
        sched.expert_offsets_El1.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(),
        dy_TH.data_ptr(), w_TK.data_ptr(), view["rows"].data_ptr(), view["d_w"].data_ptr(),
        *(t.data_ptr() for t in acc), 0, 0, 0, False, a.shape[0], T, H, inner, El, ws.topk, limit=limit,
        world_size=R, row_src=sched.row_src_rank_C.data_ptr(), dy_ranks=ptrs["dy_src"].data_ptr(),
        weights_ranks=ptrs["w_src"].data_ptr(), out_dx_rows_ranks=ptrs["rows"].data_ptr(),
        out_d_router_ranks=ptrs["d_w"].data_ptr(), num_threads=max(1, torch.get_num_threads()),
    )  # fmt: skip
    return acc[0], acc[1], acc[2]


def forward_call(
    ws: Workspace,
    table: list[int],
    top_experts_TK: torch.Tensor,
    x_TH: torch.Tensor,
    router_weights_TK: torch.Tensor,
    routed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    error: torch.Tensor,
    scratch: int,
    *,
    limit: float | None,
    timeout_ns: int,
    context: bool,
    mirror: int,
    stream: int,
    store_x: bool = True,
) -> tuple[Outputs | None, torch.Tensor]:
    """One rank's forward in one extension call (mok_bf16.moe_forward_call): the schedule table from
    the routes in place, moe_forward on it (its route rows into `rows`, the transport's), and the
    combine of those rows weighted by the router weights; (the context's Outputs or None, y bf16
    [T, H]). The bits of the three calls one after another (mok_core.build_table, moe_forward,
    mok_core.combine), and one crossing from Python instead of three, with no argument passed
    by name: the host before and after the megakernel (docs/megakernel.md, "The host").

    table: the addresses of the table's arrays in mok-core's order (backends.native._table_arrays);
    top_experts_TK int32 or int64 [T, K] contiguous; x_TH bf16 [T, H], routed bf16 contiguous and
    router_weights_TK [T, K] as moe_forward and the combine take them; error the transport's words;
    scratch the workspace's schedule scratch (0 on the CPU); mirror the transport's ErrorMirror's device
    address, to which the combine publishes the error words (0: none). On the CPU only without `context`
    (there the context's rows are the table's in use, read on the host before they are allocated:
    moe_forward's `rows`). store_x False: the context keeps no x rows (Outputs.x None), the megakernel
    stores none."""
    import mok_bf16

    wg, wu, wd = routed
    T, H = x_TH.shape
    El, inner = wg.shape[:2]
    dev = x_TH.device
    cpu = dev.type == "cpu"
    C = ws.capacity
    out = _outputs(C, H, inner, dev, store_x) if context else None
    a, b, x_rows = (0, 0, 0) if out is None else (0 if t is None else t.data_ptr() for t in out)
    y = torch.empty(T, H, dtype=BF16, device=dev)
    w = router_weights_TK.float().reshape(-1).contiguous()
    mok_bf16.moe_forward_call(
        core_entry_points(), dev.type, top_experts_TK.data_ptr(), top_experts_TK.dtype == torch.int64, T,
        ws.max_tokens, ws.topk, ws.expert_alignment, C, table[2], table[3], table[4], table[5], table[0], table[1],
        table[6], table[7], scratch, x_TH.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), a, b, x_rows,
        _scratch_h(ws, inner).data_ptr(), rows.data_ptr(), 0 if cpu else task_state(ws).data_ptr(), error.data_ptr(),
        H, inner, El, limit, timeout_ns, STAGE, max(1, torch.get_num_threads()), y.data_ptr(), w.data_ptr(), mirror,
        stream,
    )  # fmt: skip
    return out, y


def _check_timers(timers: torch.Tensor, device: torch.device, num_sms: int) -> None:
    """A timed launch writes [CTAs][roles][slots] int64 accounts: the tensor must hold them all."""
    if not isinstance(timers, torch.Tensor) or timers.dtype != torch.int64:
        raise TypeError(f"timers must be an int64 tensor, got {getattr(timers, 'dtype', type(timers).__name__)}")
    if timers.device != device or not timers.is_contiguous():
        raise ValueError(f"timers must be a contiguous tensor on {device}, got {timers.device}")
    ctas = num_sms if num_sms > 0 else torch.cuda.get_device_properties(device).multi_processor_count
    need = ctas * len(TIMER_ROLES) * len(TIMER_SLOTS)
    if timers.numel() < need:
        shape = f"CTAs x {len(TIMER_ROLES)} x {len(TIMER_SLOTS)} = {need}"
        raise ValueError(f"timers must hold {shape} int64, got {timers.numel()}")


def available(device: torch.device) -> bool:
    """Whether the installed mok-bf16 has the megakernel and it runs on `device` (sm_90, or the
    CPU's model of it)."""
    if device.type == "cpu":
        return _available_on(-1)
    if device.type != "cuda":
        return False
    return _available_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _available_on(index: int) -> bool:  # asked on every call: answered once per device (-1: the CPU)
    try:
        import mok_bf16
    except ImportError:
        return False
    build: Any = mok_bf16.build_info()
    if not hasattr(mok_bf16, "moe_forward") or ("cpu" if index < 0 else "cuda") not in build["backends"]:
        return False
    return index < 0 or torch.cuda.get_device_capability(index) == (9, 0)
