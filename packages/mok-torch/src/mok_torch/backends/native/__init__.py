"""The native backends, `cpu` and `cuda`: mok-core's runtime with mok-bf16's expert math.

mok-core builds the schedule table on the device, moves rows through shared memory (POSIX
shared memory between the processes of one machine, or symmetric memory between GPUs) with
epoch barriers that time out, and runs the fixed-order epilogues. Which implementation runs the
routed experts is decided in one place, `expert_path` (logged at debug level on the "mok"
logger, listed by `mok info`):

- "megakernel" (cuda, BF16, one rank, sm_90, H and I multiples of 64, H below
  MEGAKERNEL_MAX_HIDDEN, an expert alignment that is a multiple of 64, no backward replay): the
  forward's routed experts in one persistent launch
  (`megakernel.py`, docs/megakernel.md), x rows gathered by the schedule table inside the GEMM's
  operand loads and each output row stored at its route; the combine follows. Its bits are those
  of "tensor-cores". On the CPU (BF16 with mok-bf16, no backward replay; across ranks a pull
  dispatch and a push combine) the same call runs on the host (`mok_bf16.moe_forward("cpu")`,
  every rank's x read from its x_src and each y stored into its source rank's rows by address,
  between barriers 3 and 4), with the bits of "cpu-kernels"; its backward is the mirror
  (`mok_bf16.moe_backward("cpu")`: each row's dy and weight read from its source rank, its dx and
  d_w pushed to its route there) where the combine pushes, else the "cpu-kernels" chain.
- "tensor-cores" (cuda, BF16, sm_90, H and I multiples of 64): mok-bf16's grouped GEMMs
  (`grouped.py`) between the transport's pulls and pushes, a whole macrobatch per call:
  deterministic and invariant as the contract says, but not bitwise the reference
  (docs/determinism.md "The GPU GEMMs"). The backward runs them too when the expert alignment is
  a multiple of 64 (their weight gradients take 64-row blocks from each segment start).
- "fp8-cores" (cuda, MXFP8, sm_90, H and I multiples of 64): mok-mxfp8's FP8 kernels
  (`mxfp8_grouped.py`), forward and backward.
- "cpu-kernels" (cpu): mok-bf16's / mok-mxfp8's compiled entry points, bitwise the reference.
- "reference": the reference backend's PyTorch arithmetic (bitwise the reference; slow).

On the GPU nothing reads a device value on the host: the ring walks every row of the table's
capacity in static macrobatches (minibatches on the reference paths; rows past the last segment
are empty and skipped by the transport), the kernels read the segment offsets on the device, and
a whole forward + backward can be captured in one CUDA graph. On the CPU the host reads the
segment offsets; mok-bf16 gets flat rows, each with its local expert (-1 for padding rows,
which it skips), and the PyTorch fallback works on expert blocks, as the reference does.

MXFP8 (`precision="mxfp8"`): x and dy are quantized on their source rank and travel as MXFP8
rows (H E4M3 bytes then H/32 scales, in the first bytes of the bf16-sized source rows); the
shared expert stays bf16, on mok-bf16's kernels where the BF16 mode would run it there (else in
the reference's arithmetic).

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import torch

from ...config import MoKConfig, resolve_batching
from ...mxfp8 import MXFP8Tensor, mxfp8_quantize, pack_rows, unpack_rows
from ...spec.experts import (
    BF16,
    ExpertWeights,
    Grouped,
    PerRow,
    accumulate_wgrads,
    down,
    expert_weights,
    gate_up,
    routed_wgrads,
    row_backward,
    shared_backward,
    shared_forward,
    swiglu,
)
from ...spec.ring import Block, RingPlan, plan_ring, replays_in_backward
from ...structs import PENDING_SEND_SIDE, SEND_SIDE, ForwardContext, Grads, LazySendSide, Schedule
from ...workspace import Workspace
from . import megakernel
from .grouped import (
    GroupedBackward,
    GroupedForward,
    backward_call,
    backward_scratch,
    grouped_backward,
    grouped_forward,
    launch_backward,
    launch_forward,
)
from .mxfp8_grouped import (
    MxGroupedForward,
    hq_row_bytes,
    mxfp8_grouped_forward,
    mxfp8_grouped_gemm,
    mxfp8_grouped_wgrad,
    mxfp8_swiglu_backward,
)
from .transport import Transport, current_stream_handle

Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
SharedContext = tuple[torch.Tensor | None, torch.Tensor | None]  # the shared expert's a, b (None: none)
log = logging.getLogger("mok")


def _entry_points(module: str, device_type: str) -> Any | None:
    """The compiled package `module` when it has the expert entry points for `device_type`."""
    if device_type != "cpu":  # the per-row entry points are CPU only (the GPU forward: grouped.py)
        return None
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    return mod if hasattr(mod, "swiglu_forward") and hasattr(mod, "swiglu_backward") else None


@functools.cache
def _expert_kernels(device_type: str) -> Any | None:
    """mok_bf16's expert entry points for `device_type`, or None."""
    return _entry_points("mok_bf16", device_type)


@functools.cache
def _mxfp8_kernels(device_type: str) -> Any | None:
    """mok_mxfp8's MXFP8 expert entry points for `device_type`, or None."""
    return _entry_points("mok_mxfp8", device_type)


@functools.cache
def _gpu_grouped(device_index: int) -> bool:
    """Whether mok-bf16's sm_90a grouped forward runs on this CUDA device."""
    try:
        import mok_bf16
    except ImportError:
        return False
    if not hasattr(mok_bf16, "grouped_forward") or "cuda" not in mok_bf16.build_info()["backends"]:
        return False
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def gpu_forward_kernels(cfg: MoKConfig, device: torch.device, hidden: int, inner: int, experts: int) -> bool:
    """Whether the native backend's forward GEMMs run mok-bf16's tensor-core kernels here."""
    return cfg.precision == "bf16" and _gpu_bf16_kernels(device, hidden, inner, experts)


def gpu_shared_kernels(device: torch.device, hidden: int, inner: int) -> bool:
    """Whether the shared expert runs on mok-bf16's tensor-core kernels here: it is bf16 in every
    precision (in MXFP8 mode too), so only the device and the shape decide."""
    return _gpu_bf16_kernels(device, hidden, inner, 1)


def _gpu_bf16_kernels(device: torch.device, hidden: int, inner: int, experts: int) -> bool:
    return (
        device.type == "cuda"
        and hidden % 64 == 0
        and inner % 64 == 0
        and 1 <= experts <= 1024
        and _gpu_grouped(device.index if device.index is not None else torch.cuda.current_device())
    )


@functools.cache
def _gpu_mxfp8_grouped(device_index: int) -> bool:
    """Whether mok-mxfp8's sm_90a FP8 grouped forward runs on this CUDA device."""
    try:
        import mok_mxfp8
    except ImportError:
        return False
    if not hasattr(mok_mxfp8, "grouped_forward") or "cuda" not in mok_mxfp8.build_info()["backends"]:
        return False
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def gpu_mxfp8_forward_kernels(cfg: MoKConfig, device: torch.device, hidden: int, inner: int, experts: int) -> bool:
    """Whether the native backend's MXFP8 forward GEMMs run mok-mxfp8's FP8 tensor-core kernels here."""
    return (
        device.type == "cuda"
        and cfg.precision == "mxfp8"
        and hidden % 64 == 0
        and inner % 64 == 0
        and 1 <= experts <= 1024
        and _gpu_mxfp8_grouped(device.index if device.index is not None else torch.cuda.current_device())
    )


def _mx_row_bytes(C: int) -> int:
    """Bytes of an MXFP8 row of C values for the FP8 kernels: C + C/32 rounded up to 16 (the copy
    engine reads 16-byte aligned rows), as h_q's rows."""
    return hq_row_bytes(C)


def _mx_weights(routed: Any) -> list[MXFP8Tensor]:
    """The routed weights as the FP8 forward reads them: the user's MXFP8Tensors, or bf16 ones
    quantized here per call (the normal copy only: the forward reads no other)."""
    return [w if isinstance(w, MXFP8Tensor) else mxfp8_quantize(w, transposed=False) for w in routed]


def gpu_backward_kernels(cfg: MoKConfig) -> bool:
    """Whether the backward runs mok-bf16's GPU kernels where the forward's GEMMs run on the GPU:
    when every segment start and macrobatch boundary is a multiple of the weight gradients' 64-row
    blocks (config checks make mini- and macrobatches multiples of the alignment)."""
    return cfg.expert_alignment % 64 == 0


class ExpertPath(NamedTuple):
    """The implementations of a call's routed experts (the module docstring lists them)."""

    forward: str  # "megakernel", "tensor-cores", "fp8-cores", "cpu-kernels" or "reference"
    backward: str  # "megakernel" (the CPU: moe_backward), "tensor-cores", "fp8-cores", "cpu-kernels" or "reference"


def static_ring_plan(cfg: MoKConfig, ws: Workspace, inner: int) -> RingPlan:
    """The GPU's ring walk: every row of the capacity, whatever the routing (no host read; the
    segment offsets stay on the device, padding rows are zero)."""
    minibatch, macrobatch = resolve_batching(cfg, ws.hidden_size, inner, ws.num_sms)
    return RingPlan(num_rows=ws.capacity, macrobatch=macrobatch or ws.capacity, minibatch=minibatch, offsets=None)


# The megakernel's forward runs where it was measured faster than the chain of grouped kernels
# (H200, session 15, `benchmarks/results/profiles/2026-12-02_nvidia-h200_layer-time-13.txt`): at
# H = 1536 and 2048 (sonic-7b, qwen3-30b-a3b: 1.49 / 1.54 ms in a CUDA graph against 2.17 / 1.69),
# not at H = 7168 (deepseek-v3-e32: 11.6 against 10.7 ms), where its gate/up tiles' row gather over
# 112 k-blocks costs more than the chain's pull of x (docs/megakernel.md "Next").
MEGAKERNEL_MAX_HIDDEN = 4096  # exclusive
# The backward's g GEMM gathers dy's rows itself (dWd too where I <= 256 on memory below 4 TB/s; else
# dWd reads a table-ordered copy the g GEMM stores)
# below the same H: at H = 2048 that was measured faster than a pull of the rows into table order
# and the copy engine's loads (the pull 133 us against +53 us in the GEMM at qwen3-30b-a3b,
# session 16), at H = 7168 slower (the gathered GEMM +1.27 ms against a 0.47 ms pull).
GATHER_DY_MAX_HIDDEN = MEGAKERNEL_MAX_HIDDEN  # exclusive
# In the one-call backward the weight gradient dW1 can gather x's rows by route from the layer's
# input (grouped_backward's dw1_mode 2), so that the forward's megakernel stores no routed x (C x H
# bf16: its bytes and the context's memory), where I is at most this. Measured on an H100 at
# sonic-7b (NOTES.md, session 44): the forward 1.45 -> 1.33 ms back to back and the peak 2411 -> 1787
# MiB, but dW1 as x^T [d_a, d_b] with its transposed element-wise stores 463 -> 745 us, so a
# forward + backward 3.61 -> 3.77 ms. Off (0) until dW1's transposed epilogue keeps pace.
GATHER_X_MAX_INNER = 0  # inclusive


def expert_path(cfg: MoKConfig, ws: Workspace, inner: int) -> ExpertPath:
    """What runs the routed experts of a call with `cfg` on `ws` (routed inner size `inner`): the one
    place the native backends decide it (once per workspace, config and I: the last one is kept)."""
    last = ws.state.get("expert path")
    if last is not None and last[0] is cfg and last[1] == inner:
        return last[2]  # type: ignore[no-any-return]
    path = _expert_path(cfg, ws, inner)
    ws.state["expert path"] = (cfg, inner, path)
    return path


def _expert_path(cfg: MoKConfig, ws: Workspace, inner: int) -> ExpertPath:
    H, El, dev = ws.hidden_size, ws.num_local_experts, ws.device
    if dev.type == "cpu":
        compiled = _mxfp8_kernels("cpu") if cfg.precision == "mxfp8" else _expert_kernels("cpu")
        path = "cpu-kernels" if compiled is not None else "reference"
        if not _cpu_megakernel(cfg, ws, path):
            return ExpertPath(path, path)
        # The backward is the forward call's mirror (mok_bf16.moe_backward) where the combine pushes
        # (its dx and d_w go into the source ranks' `rows` and `d_w`); else the chain.
        return ExpertPath("megakernel", "megakernel" if cfg.combine == "push" else path)
    if gpu_mxfp8_forward_kernels(cfg, dev, H, inner, El):
        return ExpertPath("fp8-cores", "fp8-cores")
    if not gpu_forward_kernels(cfg, dev, H, inner, El):
        return ExpertPath("reference", "reference")
    backward = "tensor-cores" if gpu_backward_kernels(cfg) else "reference"
    # Across ranks the kernel takes the per-rank arguments (each row read from its source's x_src
    # and stored into its `rows` by peer address, tested on one GPU); it stays off until measured on
    # two GPUs, as its gate/up tiles would read a peer's x row over NVLink once per column tile.
    fused = (
        cfg.megakernel
        and ws.world_size == 1
        and H < MEGAKERNEL_MAX_HIDDEN
        and backward == "tensor-cores"
        and not replays_in_backward(cfg, ws)
        and megakernel.available(dev)
    )
    return ExpertPath("megakernel" if fused else "tensor-cores", backward)


def _cpu_megakernel(cfg: MoKConfig, ws: Workspace, path: str) -> bool:
    """Whether the CPU's forward runs mok_bf16.moe_forward (the megakernel's call and host protocol,
    the bits of "cpu-kernels"): BF16 on the compiled kernels, the backward reading the whole
    context (no replay), and across ranks a pull dispatch and a push combine (each row read from
    its source rank's x_src and stored into its `rows`: the form without moves)."""
    across = ws.world_size == 1 or (cfg.dispatch == "pull" and cfg.combine == "push")
    return (
        cfg.megakernel and cfg.precision == "bf16" and path == "cpu-kernels" and across
        and not replays_in_backward(cfg, ws) and megakernel.available(ws.device)
    )  # fmt: skip


def scatters_token_rows(cfg: MoKConfig, ws: Workspace, inner: int, path: ExpertPath | None = None) -> bool:
    """Whether a call on the chain of GPU kernels puts its token rows (the forward's x; the
    backward's dy where the g GEMM does not gather it) into table order with
    Transport.scatter_local: at one rank, on the BF16 tensor-core path, in one macrobatch. Each
    token row is then read once for its K routes; a pull of the table reads it once per route and,
    before that, copies it into the transport's x_src / dy_src (deepseek-v3-e32 on the H200: 55 us
    of copy and a 460 us pull, NOTES.md session 21). `path`: the call's expert_path, if known."""
    if ws.world_size != 1 or (path or expert_path(cfg, ws, inner)).forward != "tensor-cores":
        return False
    plan = static_ring_plan(cfg, ws, inner)
    return plan.macrobatch >= plan.num_rows


def describe_expert_paths(device: torch.device) -> dict[str, str]:
    """For `mok info`: the path a call takes on `device`, per precision, with the default config at
    one rank and H, I multiples of 64 (other shapes, EP sizes and configs: `expert_path`)."""
    from ...workspace import create_workspace

    out = {}
    for precision in ("bf16", "mxfp8"):
        cfg = MoKConfig(precision=precision)
        ws = create_workspace(cfg, None, device=device, max_tokens=128, hidden_size=128, topk=1, num_experts=1)
        path = expert_path(cfg, ws, 128)
        out[precision] = f"forward {path.forward}, backward {path.backward}"
    return out


def _log_path(cfg: MoKConfig, ws: Workspace, path: ExpertPath, what: str) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "mok %s (%s, EP %d, %s): routed experts on %s", what, cfg.precision, ws.world_size, ws.device,
            path.forward if what == "forward" else path.backward,
        )  # fmt: skip


def _wgrad_tensors(El: int, H: int, inner: int, dtype: torch.dtype, device: torch.device) -> Weights3:
    """(dWg, dWu, dWd) arrays, uninitialised: the GPU backward writes every element."""
    return (
        torch.empty(El, inner, H, dtype=dtype, device=device),
        torch.empty(El, inner, H, dtype=dtype, device=device),
        torch.empty(El, H, inner, dtype=dtype, device=device),
    )


def _row_experts(sched: Schedule, rows: int) -> torch.Tensor:
    """The local expert of each of the first `rows` table rows, -1 for padding rows (int64)."""
    index = torch.arange(rows, device=sched.row_src_rank_C.device, dtype=torch.int32)
    experts = torch.searchsorted(sched.expert_offsets_El1[1:].contiguous(), index, right=True)
    return torch.where(sched.row_src_rank_C[:rows] >= 0, experts, -1).to(torch.int64)


def _int32_routes(top_experts_TK: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The routes as int32, contiguous (into `out` if given), an int64 id past int32 read as the
    nearest int32 (an id of no expert, as the one-rank table reads it: mok-core's RouteSource),
    never wrapped onto a valid one."""
    if top_experts_TK.dtype == torch.int64:
        top_experts_TK = top_experts_TK.clamp(-(2**31), 2**31 - 1)
    if out is not None:
        return out.copy_(top_experts_TK)
    return top_experts_TK.to(torch.int32).contiguous()


def _scatter_table(sched: Schedule) -> tuple[int, int, torch.Tensor]:
    """What _scattered_experts reads of a schedule: route_row_TK's and row_src_rank_C's addresses
    and the offsets (schedule_and_forward hands it the table's before the Schedule exists)."""
    return sched.route_row_TK.data_ptr(), sched.row_src_rank_C.data_ptr(), sched.expert_offsets_El1


def _bf16_rows(t_TH: torch.Tensor) -> torch.Tensor:
    """Token rows as the row movers read them: bf16, each row contiguous (what a copy into the
    transport's x_src / dy_src makes of them)."""
    if t_TH.dtype == BF16 and t_TH.is_contiguous():  # the usual case, without two dispatcher calls
        return t_TH
    return t_TH.to(BF16).contiguous()


def _ptr(t: torch.Tensor | None) -> int:
    """A tensor's address for mok_bf16 (0 for None): rows must be dense, as the entry points read them."""
    if t is None:
        return 0
    assert t.is_contiguous(), "mok_bf16 reads dense row-major arrays"
    return t.data_ptr()


class _Experts:
    """mok_bf16's expert entry points for one set of weights, on flat rows.

    Weights [El, I, H], [El, I, H], [El, H, I] bf16 (the shared expert as El = 1); each row
    comes with its local expert, -1 for a padding row (zero outputs, nothing accumulated).
    """

    def __init__(self, bf16: Any, weights: Weights3, limit: float | None) -> None:
        self.entry, self.limit = bf16, limit  # the module with the entry points
        self._keep = [w.contiguous() for w in weights]
        self.wg, self.wu, self.wd = (_ptr(w) for w in self._keep)
        self.El, self.I, self.H = self._keep[0].shape
        self.threads = torch.get_num_threads()

    def forward(
        self, experts_M: torch.Tensor, x_MH: torch.Tensor, a_MI: torch.Tensor, b_MI: torch.Tensor,
        y_MH: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """a, b (and y unless None) of the rows, written into the given tensors."""
        self.entry.swiglu_forward(
            "cpu", _ptr(x_MH), _ptr(experts_M), self.wg, self.wu, self.wd,
            _ptr(a_MI), _ptr(b_MI), _ptr(y_MH), x_MH.shape[0], self.H, self.I, self.El, self.limit, self.threads,
        )  # fmt: skip

    def backward(
        self, experts_M: torch.Tensor, x_MH: torch.Tensor, a_MI: torch.Tensor, b_MI: torch.Tensor,
        dy_MH: torch.Tensor, w_M: torch.Tensor | None, dx_MH: torch.Tensor, d_w_M: torch.Tensor,
        d_gate_up_E2IH: torch.Tensor, d_down_EHI: torch.Tensor,
    ) -> None:  # fmt: skip
        """dx and d_w of the rows (w None: unweighted), into the given tensors; the weight
        gradients added in place, each expert's rows in order."""
        self.entry.swiglu_backward(
            "cpu", _ptr(x_MH), _ptr(a_MI), _ptr(b_MI), _ptr(dy_MH), _ptr(w_M), _ptr(experts_M), self.wg,
            self.wu, self.wd, _ptr(dx_MH), _ptr(d_w_M), _ptr(d_gate_up_E2IH), _ptr(d_down_EHI),
            x_MH.shape[0], self.H, self.I, self.El, self.limit, self.threads,
        )  # fmt: skip


class _MxExperts(_Experts):
    """mok_mxfp8's expert entry points: the same calls as _Experts, with x and dy as MXFP8 rows
    and the weights quantized both ways (the user's MXFP8Tensor, or bf16 quantized here)."""

    def __init__(self, mx: Any, weights: tuple, limit: float | None) -> None:
        self.entry, self.limit = mx, limit  # the entry points have the same names and order
        q = [w if isinstance(w, MXFP8Tensor) else mxfp8_quantize(w) for w in weights]
        quads: list[tuple[int, ...]] = []
        self._keep = []
        for w in q:
            parts = [
                t.view(torch.uint8).contiguous() for t in (w.data, w.scales, w.data_t, w.scales_t) if t is not None
            ]
            assert len(parts) == 4, "MXFP8 weights need both copies (checked by the functional API)"
            self._keep += parts
            quads.append(tuple(t.data_ptr() for t in parts))
        self.wg, self.wu, self.wd = quads  # type: ignore[assignment]
        self.El, self.I, self.H = q[0].shape
        self.threads = torch.get_num_threads()


def _on(ws: Workspace) -> Any:
    """The workspace's device made current: mok-core launches on the current device (no switch
    when it already is)."""
    if ws.device.type != "cuda" or torch.cuda.current_device() == ws.device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(ws.device)


class _Table(NamedTuple):
    """The expert side of a schedule, as its table launch leaves it (Schedule's fields of these
    names; route_row: at one rank each route's row, which the table writes there itself, else None;
    routes: at one rank the routes as the table read them, int32 [T, K], else None)."""

    row_src: torch.Tensor
    row_route: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor
    recv: torch.Tensor
    tokens: torch.Tensor
    route_row: torch.Tensor | None
    routes: torch.Tensor | None


class _IssuedTable(NamedTuple):
    """A table whose launch is issued: what the experts' launches read (the addresses of three
    arrays, the offsets as a tensor), and its tensors from `tensors()` (views of one buffer are
    made only then: after the launches that need just these)."""

    row_route: int  # row_route_C's address
    row_src: int  # row_src_rank_C's
    route_row: int  # at one rank the route rows' (route_row_TK), else 0
    offsets: torch.Tensor  # expert_offsets_El1
    tensors: Callable[[], _Table]


def _table_arrays(
    ws: Workspace, T: int, K: int, *, one_buffer: bool
) -> tuple[list[int], torch.Tensor, Callable[[], _Table]]:
    """The arrays a table launch writes, uninitialised: their addresses in mok-core's order (recv,
    tokens, row_src, row_route, offsets, counts, and at one rank the route rows and the routes'
    int32 copy), the offsets as a tensor (what the experts' launch reads first), and the call that
    makes the _Table of their tensors. With `one_buffer` they are views of one allocation, made
    only by that call (mok.moe's eager call, whose schedule never leaves the layer; a custom op
    would have to clone such views)."""
    R, El, C = ws.world_size, ws.num_local_experts, ws.capacity
    local = R == 1
    # int32 words: recv and tokens (int64 [R] each, first: 8-byte offsets), row_src, row_route,
    # offsets, counts, and at one rank the route rows and the routes' int32 copy.
    sizes = [2 * R, 2 * R, C, C, El + 1, El] + ([T * K, T * K] if local else [])
    if one_buffer:
        buf = torch.empty(sum(sizes), dtype=torch.int32, device=ws.device)
        addr, at = [], buf.data_ptr()
        for n in sizes:
            addr.append(at)
            at += 4 * n
        offsets = buf[sum(sizes[:4]) : sum(sizes[:5])]  # the experts' launch reads it first

        def tensors() -> _Table:
            parts = torch.split_with_sizes(buf, sizes)  # (Tensor.split's wrapper: ~10 us more)
            route_row, routes = (parts[6], parts[7].view(T, K)) if local else (None, None)
            recv, tokens = parts[0].view(torch.int64), parts[1].view(torch.int64)
            return _Table(parts[2], parts[3], parts[4], parts[5], recv, tokens, route_row, routes)

        return addr, offsets, tensors
    new = lambda n, dt=torch.int32: torch.empty(n, dtype=dt, device=ws.device)  # noqa: E731
    table = _Table(new(C), new(C), new(El + 1), new(El), new(R, torch.int64), new(R, torch.int64),
                   new(T * K) if local else None, new(T * K).view(T, K) if local else None)  # fmt: skip
    parts = [table.recv, table.tokens, *table[:4]]
    if local:
        assert table.route_row is not None and table.routes is not None
        parts += [table.route_row, table.routes]
    return [t.data_ptr() for t in parts], table.offsets, lambda: table


class _Rows:
    """Expert math on table rows [lo, hi) held as flat tensors [hi - lo, ...]."""

    def __init__(self, sched: Schedule, lo: int, hi: int, offsets: tuple[int, ...] | None, w: ExpertWeights) -> None:
        self.lo, self.hi = lo, hi
        if offsets is not None:  # CPU: expert blocks planned on the host
            self.block: Block | None = Block(offsets, lo, hi, sched.row_src_rank_C.device)
            self.w = w.select(self.block.first, self.block.last)
            self.layout: Grouped | PerRow = Grouped()
        else:  # GPU: each row with its expert, no host read
            self.block = None
            El = sched.expert_counts_El.shape[0]
            rows = torch.arange(lo, hi, device=sched.row_src_rank_C.device, dtype=torch.int32)
            experts = torch.searchsorted(sched.expert_offsets_El1[1:].contiguous(), rows, right=True)
            self.w = w
            self.layout = PerRow(experts.clamp(max=El - 1).to(torch.int64))

    def grid(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.block is None else self.block.gather(flat, self.lo)

    def flat(self, grid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.block is None:
            return grid
        out = torch.zeros_like(like)
        self.block.scatter(grid, out, self.lo)
        return out

    def acc(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.block is None else t[self.block.first : self.block.last]


class NativeBackend:
    def __init__(self, device_type: str) -> None:
        self.name = device_type
        self.device_type = device_type

    @property
    def expert_kernels(self) -> Any | None:
        """mok_bf16 when the experts run its compiled entry points, None when they run in PyTorch."""
        return _expert_kernels(self.device_type)

    @property
    def reference_experts(self) -> bool:
        """Whether the experts run the reference's PyTorch loops (slow: the bench skips big shapes)."""
        return self.expert_kernels is None

    # ------------------------------------------------------------------ availability

    def unavailable_reason(self, precision: str, device: torch.device) -> str | None:
        from .. import compiled_packages

        if device.type != self.device_type:
            return f"the {self.name!r} backend runs on {self.device_type} tensors, not {device.type}"
        core = compiled_packages().get("core")
        if core is None:
            return "mok-core is not installed (pip install mok-torch[bf16])"
        if self.device_type not in core.get("devices", []):
            return f"the installed mok-core was built without {self.device_type.upper()} support"
        import mok_core

        missing = [
            f
            for f in ("build_table", "build_send_side", "combine", "pull_rows", "push_rows", "barrier")
            if not hasattr(mok_core, f)
        ]
        if missing:
            return f"the installed mok-core {core.get('version')} lacks the runtime ({', '.join(missing)})"
        return None

    # ------------------------------------------------------------------ plumbing

    def _transport(self, ws: Workspace, cfg: MoKConfig) -> Transport:
        tr = ws.state.get("native")
        if tr is None:
            tr = ws.state["native"] = Transport(ws, cfg.timeout_s)
        tr.timeout_ns = cfg.timeout_ns
        tr.calls += 1  # a call of the group's sequence: every rank in step counts alike
        tr.begin_call()
        self._check_errors(tr)
        if cfg.dispatch == "push":
            tr.ensure("dispatch")
        if cfg.combine == "pull":
            tr.ensure("combine")
        return tr

    def checks_expert_ids_on_device(self, device: torch.device) -> bool:
        """On a GPU the schedule kernel checks the expert ids (mok-core's build_table with the
        error words): the route of a bad id is left out and the next call raises the ValueError."""
        return device.type == "cuda" and self.device_type == "cuda"

    def check_errors(self, ws: Workspace) -> None:
        """The hook of `mok.check_errors`: wait for this device's work on `ws`, then raise what its
        transport's error words record."""
        tr = ws.state.get("native")
        if tr is None or ws.device.type != self.device_type:
            return
        if tr.dev == "cuda":
            torch.cuda.synchronize(ws.device)
        tr.raise_error(tr.error.tolist())

    def _check_errors(self, tr: Transport) -> None:
        """Raise a transport error a previous GPU call recorded and published (the host's mirror
        of the error words, read without waiting while it shows none)."""
        words = tr.published_error()
        if words is not None:
            tr.raise_error(words)

    @staticmethod
    def _after_call(tr: Transport) -> None:
        tr.publish_error()

    def _routed_experts(self, cfg: MoKConfig, routed: tuple) -> _Experts | None:
        """The compiled routed experts for cfg's precision on this device, or None (PyTorch)."""
        if cfg.precision == "mxfp8":
            mx = _mxfp8_kernels(self.device_type)
            return None if mx is None else _MxExperts(mx, routed, cfg.swiglu_limit)
        kernels = self.expert_kernels
        return None if kernels is None else _Experts(kernels, routed, cfg.swiglu_limit)

    @staticmethod
    def _write_rows(cfg: MoKConfig, tr: Transport, field: str, rows_TH: torch.Tensor) -> None:
        """x or dy into this rank's `field` for the expert ranks to pull: bf16 rows, or MXFP8
        rows (H + H/32 bytes, quantized before they travel) in the first bytes of each row."""
        T = rows_TH.shape[0]
        if cfg.precision == "mxfp8":
            packed = pack_rows(rows_TH)
            tr.view[field].view(torch.uint8)[:T, : packed.shape[1]].copy_(packed)
        else:
            tr.view[field][:T].copy_(rows_TH)

    @staticmethod
    def _pulled_rows(cfg: MoKConfig, n: int, H: int, device: torch.device) -> torch.Tensor:
        """A buffer for n pulled x or dy rows, in the form they travel (uninitialised: a pull writes
        every row, zeros for padding rows, and a push dispatch's rows are copied in whole)."""
        if cfg.precision == "mxfp8":
            return torch.empty(n, H + H // 32, dtype=torch.uint8, device=device)
        return torch.empty(n, H, dtype=BF16, device=device)

    # Moving rows in the direction the config says (MoKConfig.dispatch / .combine):
    #   inputs   _send_inputs (source side, before the barrier), then _receive per row range
    #   outputs  _give per row range, then _collect (source side, after the barrier)

    def _movers(self, cfg: MoKConfig, ws: Workspace, backward: bool = False) -> int:
        """Workers of a row move: every SM on the GPU (the copies run alone between the kernels),
        the configured communication workers on the CPU."""
        if ws.device.type == "cuda":
            return ws.num_sms
        return cfg.bwd_num_comm_sms if backward else cfg.fwd_num_comm_sms

    def _send_inputs(
        self, cfg: MoKConfig, ws: Workspace, tr: Transport, sched: Schedule, *, x: torch.Tensor | None = None,
        dy: torch.Tensor | None = None, w: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """This rank's x / dy rows and router weights w (fp32 [T*K]) where the expert ranks take
        them: into its own *_src fields (pull), or into the expert ranks' tables (push, whose
        padding rows this rank zeroes in its own table)."""
        K = sched.topk
        if cfg.dispatch == "pull":
            if x is not None:
                self._write_rows(cfg, tr, "x_src", x)
            if dy is not None:
                self._write_rows(cfg, tr, "dy_src", dy)
            if w is not None:
                tr.view["w_src"][: w.shape[0]].copy_(w)
            return
        dest, nw = (sched.route_rank_TK, sched.route_row_TK), self._movers(cfg, ws, backward=dy is not None)
        for field, rows in (("x_recv", x), ("dy_recv", dy)):
            if rows is not None:
                travel = pack_rows(rows) if cfg.precision == "mxfp8" else rows.contiguous()
                tr.push(travel, field, dest, nw, src_divisor=K)
                tr.zero_padding(field, sched.row_src_rank_C, nw)
        if w is not None:
            tr.push(w, "w_recv", dest, nw)
            tr.zero_padding("w_recv", sched.row_src_rank_C, nw)

    def _received(self, cfg: MoKConfig, tr: Transport, field: str, lo: int, hi: int) -> torch.Tensor:
        """Table rows [lo, hi) of a pushed input field, in the form they travel (a view)."""
        rows = tr.view[field][lo:hi]
        if cfg.precision == "mxfp8" and field != "w_recv":
            H = rows.shape[1]
            return rows.view(torch.uint8)[:, : H + H // 32]
        return rows

    def _receive(
        self, cfg: MoKConfig, tr: Transport, sched: Schedule, field: str, out: torch.Tensor, lo: int,
        route_divisor: int, nw: int,
    ) -> torch.Tensor:  # fmt: skip
        """Table rows [lo, lo + len(out)) of input `field` ("x", "dy" or "w") into `out`: pulled
        from the source ranks, or copied from what they pushed."""
        hi = lo + out.shape[0]
        if cfg.dispatch == "pull":
            tr.pull(out, f"{field}_src", (sched.row_src_rank_C[lo:hi], sched.row_route_C[lo:hi]), route_divisor, nw)
        else:
            out.copy_(self._received(cfg, tr, f"{field}_recv", lo, hi))
        return out

    def _output_rows(self, cfg: MoKConfig, tr: Transport, field: str, lo: int, hi: int) -> torch.Tensor | None:
        """Where a pull combine's output rows [lo, hi) go ("y_send", "dw_send"); None for a push."""
        return tr.view[field][lo:hi] if cfg.combine == "pull" else None

    def _give(
        self, cfg: MoKConfig, tr: Transport, sched: Schedule, rows: torch.Tensor, push_field: str, send_field: str,
        lo: int, nw: int,
    ) -> None:  # fmt: skip
        """Output rows of table rows [lo, lo + len(rows)) toward their routes: pushed into the
        source ranks' `push_field`, or left in this rank's `send_field` for them to pull (a
        no-op when `rows` already is that view)."""
        hi = lo + rows.shape[0]
        if cfg.combine == "push":
            tr.push(rows, push_field, (sched.row_src_rank_C[lo:hi], sched.row_route_C[lo:hi]), nw)
            return
        out = tr.view[send_field][lo:hi]
        if out.data_ptr() != rows.data_ptr():
            out.copy_(rows)

    def _collect(self, cfg: MoKConfig, ws: Workspace, tr: Transport, sched: Schedule, *, d_w: bool) -> None:
        """After the barrier that follows the outputs: a pull combine reads this rank's routes'
        rows (and router-weight gradients) from the expert ranks into `rows` (and `d_w`)."""
        if cfg.combine == "push":
            return
        TK, nw = sched.num_tokens * sched.topk, self._movers(cfg, ws, backward=d_w)
        dest = (sched.route_rank_TK, sched.route_row_TK)
        tr.pull(tr.view["rows"][:TK], "y_send", dest, 1, nw)
        if d_w:
            tr.pull(tr.view["d_w"][:TK], "dw_send", dest, 1, nw)

    @staticmethod
    def _values(cfg: MoKConfig, rows: torch.Tensor, H: int) -> torch.Tensor:
        """The GEMM operand view of pulled rows (MXFP8 rows as their float32 values)."""
        return unpack_rows(rows, H) if cfg.precision == "mxfp8" else rows

    def _rows_plan(self, cfg: MoKConfig, ws: Workspace, sched: Schedule, inner: int) -> RingPlan:
        """The ring's walk over the rows (spec.ring): on the CPU the rows in use (offsets read on
        the host), on the GPU static_ring_plan."""
        if self.device_type == "cpu":
            return plan_ring(cfg, ws, sched, inner)
        return static_ring_plan(cfg, ws, inner)

    # ------------------------------------------------------------------ entry points

    def build_schedule(self, ws: Workspace, cfg: MoKConfig, top_experts_TK: torch.Tensor) -> Schedule:
        with _on(ws):
            return self._build_schedule(ws, cfg, top_experts_TK)

    def forward(self, cfg: MoKConfig, ws: Workspace, *args: Any) -> tuple[torch.Tensor, ForwardContext]:
        with _on(ws):
            return self._forward(cfg, ws, *args)

    def schedule_and_forward(
        self, cfg: MoKConfig, ws: Workspace, top_experts_TK: torch.Tensor, x_TH: torch.Tensor,
        router_weights_TK: torch.Tensor, routed: Weights3, shared: Weights3 | None, *, context: bool = True,
    ) -> tuple[Schedule | None, torch.Tensor, ForwardContext | None]:  # fmt: skip
        """build_schedule then forward, the same bits, with the routed experts issued as soon as
        the schedule's table is: right after it, and the Schedule's tensors after them, on the
        megakernel's path and at one rank on the chain when its token rows are scattered and the
        combine is a push (_scattered_experts). The device then starts the experts that much
        earlier in a call from an idle GPU. At one rank the send side is issued at its first read
        (structs.LazySendSide), which mok.moe's forward, its direct backward and a forward that no
        backward follows never make. Without `context` (a forward that no backward follows) the
        context is None, and the megakernel stores no x rows, a or b; at one rank on the
        megakernel's path nothing then reads the schedule either, and none is made (the
        schedule returned is None: the table's launch, the megakernel and the combine are all
        the call issues)."""
        with _on(ws):
            path = expert_path(cfg, ws, routed[2].shape[2])
            tr = self._transport(ws, cfg)
            scatter = scatters_token_rows(cfg, ws, routed[2].shape[2], path)  # only at one rank
            defer = ws.world_size == 1  # the send side at its first read: nothing before the experts reads it
            # (across ranks the megakernel waits for every rank's x: _forward_on, after the send side)
            if defer and path.forward == "megakernel" and shared is None and (ws.device.type == "cuda" or not context):
                # The table, the megakernel and the combine in one extension call (megakernel.forward_call).
                _log_path(cfg, ws, path, "forward")
                T, K = top_experts_TK.shape
                addr, _, tensors = _table_arrays(ws, T, K, one_buffer=True)
                store_x = not (context and T > 0 and self._gathers_x(cfg, ws, routed[2].shape[2]))
                outputs, y = megakernel.forward_call(
                    ws, addr, top_experts_TK, x_TH, router_weights_TK, routed, tr.view["rows"], tr.error,
                    self._schedule_scratch(ws), limit=cfg.swiglu_limit, timeout_ns=tr.timeout_ns, context=context,
                    mirror=tr.mirror_address, stream=tr._stream(), store_x=store_x,
                )  # fmt: skip
                # (its combine published the error words: no _after_call)
                if outputs is None:  # a forward that no backward follows: nothing reads the schedule
                    return None, y, None
                sched = self._source_side(ws, tr, top_experts_TK, tensors(), defer=defer)
                return sched, y, self._context(sched, outputs, (None, None))
            if defer and (path.forward == "megakernel" or (scatter and cfg.combine == "push")):
                _log_path(cfg, ws, path, "forward")
                table = self._table(ws, tr, top_experts_TK, one_buffer=True)
                y_rows = None  # the megakernel's: each route's row in the transport's rows, route order
                out: megakernel.Outputs | None
                if path.forward == "megakernel":
                    out = self._megakernel_launch(cfg, ws, tr, table.row_route, table.offsets, x_TH, routed,
                                                  context=context)  # fmt: skip
                    if not context:  # the combine reads the rows in route order: no schedule is read
                        y = self._forward_rest(cfg, ws, None, tr, x_TH, router_weights_TK, shared, None)[0]
                        return None, y, None
                else:  # the GEMMs': in table order
                    y_rows = torch.empty(ws.capacity, ws.hidden_size, dtype=BF16, device=ws.device)
                    out = self._scattered_experts(cfg, ws, tr, table.route_row, table.row_src, table.offsets, x_TH,
                                                  routed, y_rows)  # fmt: skip
                sched = self._source_side(ws, tr, top_experts_TK, table.tensors(), defer=defer)
                y, shared_ab = self._forward_rest(cfg, ws, sched, tr, x_TH, router_weights_TK, shared, y_rows)
                return sched, y, self._context(sched, out, shared_ab) if out is not None and context else None
            arrays = self._table(ws, tr, top_experts_TK, one_buffer=True).tensors()
            sched = self._source_side(ws, tr, top_experts_TK, arrays, defer=defer)
            y, ctx = self._forward_on(cfg, ws, tr, path, sched, x_TH, router_weights_TK, routed, shared)
            return sched, y, ctx if context else None

    def recompute_forward_context(self, cfg: MoKConfig, ws: Workspace, *args: Any) -> ForwardContext:
        with _on(ws):
            return self._recompute_forward_context(cfg, ws, *args)

    def backward(self, cfg: MoKConfig, ws: Workspace, *args: Any) -> Grads:
        with _on(ws):
            return self._backward(cfg, ws, *args)

    # ------------------------------------------------------------------ schedule

    @staticmethod
    def _schedule_scratch(ws: Workspace) -> int:
        """Address of the workspace's scratch for the multi-CTA schedule build (0 on the CPU)."""
        if ws.device.type != "cuda":
            return 0
        scratch = ws.state.get("schedule_scratch")
        if scratch is None:
            import mok_core

            nbytes = mok_core.schedule_scratch_bytes(ws.world_size, ws.max_tokens, ws.topk, ws.num_local_experts)
            scratch = ws.state["schedule_scratch"] = torch.empty(max(nbytes, 4), dtype=torch.uint8, device=ws.device)
        return scratch.data_ptr()

    def _build_schedule(self, ws: Workspace, cfg: MoKConfig, top_experts_TK: torch.Tensor) -> Schedule:
        tr = self._transport(ws, cfg)
        sched = self._source_side(ws, tr, top_experts_TK, self._table(ws, tr, top_experts_TK).tensors())
        self._after_call(tr)
        return sched

    def _table(
        self, ws: Workspace, tr: Transport, top_experts_TK: torch.Tensor, *, one_buffer: bool = False
    ) -> _IssuedTable:
        """Issue the schedule table, the expert side: what the experts' kernels read. At one rank the
        table reads the routes where they are (int32 or int64) and writes each route's row into an
        array of the schedule's own; across ranks it reads every rank's routes from the transport.
        With `one_buffer` its arrays are views of one allocation (mok.moe's eager call, whose
        schedule never leaves the layer; a custom op would have to clone such views)."""
        core, dev, stream = tr.core, tr.dev, tr._stream()
        T, K = top_experts_TK.shape
        R, El, C = ws.world_size, ws.num_local_experts, ws.capacity
        local = R == 1  # nothing to share: no copy of the routes into the transport, no barrier
        if not local:
            tr.view["routes"][:T].copy_(_int32_routes(top_experts_TK))  # int32 in the field
            tr.view["tokens"].fill_(T)
            tr.barrier(1)
        addr, offsets, tensors = _table_arrays(ws, T, K, one_buffer=one_buffer)
        if local:
            int64 = top_experts_TK.dtype == torch.int64
            routes = dict(local_routes=True, routes=top_experts_TK.data_ptr(), routes_int64=int64, num_tokens=T,
                          route_row=addr[6], routes_copy=addr[7])  # fmt: skip
        else:  # each route's row goes back to its rank (for a push dispatch and a pull combine)
            routes = dict(route_row_ptrs=tr.ptrs["route_row"].data_ptr())
        # On the GPU many CTAs build it, in a scratch of the workspace.
        core.build_table(
            dev, 0 if local else tr.ptrs["routes"].data_ptr(), 0 if local else tr.ptrs["tokens"].data_ptr(), R,
            ws.max_tokens, K, ws.rank, El, ws.expert_alignment, C, addr[2], addr[3], addr[4], addr[5], addr[0],
            addr[1], stream, scratch=self._schedule_scratch(ws), error=tr.error.data_ptr(), **routes,
        )  # fmt: skip
        return _IssuedTable(addr[3], addr[2], addr[6] if local else 0, offsets, tensors)

    def _source_side(
        self, ws: Workspace, tr: Transport, top_experts_TK: torch.Tensor, table: _Table, *, defer: bool = False
    ) -> Schedule:
        """The Schedule of `table` and of this rank's own routes (the send side: the order and
        counts they go to the ranks in, each route's rank and row), issued now, or with `defer`
        (one rank only: the transport has no barrier to keep in step) at its first read
        (LazySendSide), on the routes as the table read them (its int32 copy, `table.routes`:
        routes the caller rewrites after the call do not change it)."""
        T, K = top_experts_TK.shape
        R, dev = ws.world_size, ws.device
        top = table.routes  # at one rank the table's copy of the routes (int32, as it read them)
        if top is None:  # an int32 copy where the routes are not int32
            top = top_experts_TK
            if top.dtype != torch.int32 or not top.is_contiguous():
                top = _int32_routes(top_experts_TK, out=torch.empty(T, K, dtype=torch.int32, device=dev))
        route_row = table.route_row
        if route_row is None:  # a copy of the transport's field, which the next schedule rewrites
            route_row = torch.empty(T * K, dtype=torch.int32, device=dev)
        fields: dict[str, Any] = dict(
            workspace=ws,
            backend=self.name,
            top_experts_TK=top,
            tokens_per_rank_R=table.tokens,
            row_src_rank_C=table.row_src,
            row_route_C=table.row_route,
            expert_offsets_El1=table.offsets,
            expert_counts_El=table.counts,
            recv_counts_R=table.recv,
            route_row_TK=route_row,
        )
        if defer:  # (its routes the table's copy: the issue reads them later)
            assert R == 1 and top is table.routes, "a deferred send side is one rank's (its barrier is collective)"
            unissued: dict[str, Any] = dict.fromkeys(SEND_SIDE)
            sched: Schedule = LazySendSide(**fields, **unissued)
            # (the call's stream by its handle: torch's current_stream object took ~30 us of host)
            sched.aux[PENDING_SEND_SIDE] = functools.partial(self._deferred_send_side, ws, tr, tr.stream)
            return sched
        sched = Schedule(**fields, **self._send_side_tensors(ws, T * K))
        self._issue_source_side(ws, tr, sched)
        return sched

    @staticmethod
    def _send_side_tensors(ws: Workspace, routes: int) -> dict[str, Any]:
        """SEND_SIDE's tensors, unfilled."""
        dev = ws.device
        return dict(
            send_order_TK=torch.empty(routes, dtype=torch.int64, device=dev),
            send_counts_R=torch.empty(ws.world_size, dtype=torch.int64, device=dev),
            route_rank_TK=torch.empty(routes, dtype=torch.int32, device=dev),
        )

    def _deferred_send_side(self, ws: Workspace, tr: Transport, stream: int, sched: Schedule) -> None:
        """LazySendSide's issue, at the first read: on the reader's stream, after everything the
        call's stream (`stream`, its handle; 0 on the CPU) had issued (the routes' copy among it)
        when the reader's is another."""
        with _on(ws):
            if stream and current_stream_handle(ws.device) != stream:
                call_stream = torch.cuda.ExternalStream(stream, device=ws.device)
                torch.cuda.current_stream(ws.device).wait_stream(call_stream)
            for name, tensor in self._send_side_tensors(ws, sched.top_experts_TK.numel()).items():
                object.__setattr__(sched, name, tensor)
            self._issue_source_side(ws, tr, sched)

    def _issue_source_side(self, ws: Workspace, tr: Transport, sched: Schedule) -> None:
        """Fill the send side of `sched` (_source_side) from its int32 routes, then the barrier after
        which every rank's routes may be rewritten."""
        top = sched.top_experts_TK
        T, K = top.shape
        R, El = ws.world_size, ws.num_local_experts
        tr.core.build_send_side(
            tr.dev, top.data_ptr(), T, K, El, R, sched.send_order_TK.data_ptr(), sched.send_counts_R.data_ptr(),
            tr._stream(), scratch=self._schedule_scratch(ws),
        )  # fmt: skip
        tr.barrier(2)  # every rank has read every rank's routes (they may be rewritten); rows landed
        if R > 1:  # the route rows are the transport's field (at one rank the table's own array)
            sched.route_row_TK.copy_(tr.view["route_row"][: T * K])
        flat, route_rank = top.view(-1), sched.route_rank_TK
        torch.div(flat, El, rounding_mode="floor", out=route_rank)
        if R > 1:  # a bad id's route goes to no rank (its row is no table's: the moves skip it)
            route_rank.masked_fill_((flat < 0) | (route_rank >= R), -1)

    # ------------------------------------------------------------------ forward

    def _combine(
        self,
        tr: Transport,
        base: torch.Tensor | None,
        rows: torch.Tensor,
        weights: torch.Tensor | None,
        T: int,
        K: int,
        H: int,
        row_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fixed-order combine of `rows` (route order, or with `row_index` [T*K] int32 each
        route's row of a table-ordered `rows`) onto `base`."""
        out = torch.empty(T, H, dtype=BF16, device=rows.device)
        tr.core.combine(
            tr.dev, out.data_ptr(), 0 if base is None else base.data_ptr(), rows.data_ptr(),
            0 if weights is None else weights.data_ptr(), T, K, H, tr._stream(),
            row_index=0 if row_index is None else row_index.data_ptr(), num_rows=rows.shape[0],
        )  # fmt: skip
        return out

    def _routed_forward(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule, tr: Transport, routed: Weights3, *, outputs: bool
    ) -> tuple[megakernel.Outputs, torch.Tensor | None]:
        """The routed experts over the ring: ((a, b, x rows), y rows in table order or None). The
        output rows go toward their routes (_give), except at one rank with a push combine and one
        macrobatch on the FP8 kernels, where the table-ordered y rows are returned for the combine
        to read through each route's row (nothing moves: what the megakernel's forward and the
        backward's direct path do). The BF16 kernels' case is _scattered_experts', which runs the
        experts wherever the token rows are scattered (scatters_token_rows: the same condition)."""
        H, K, inner = ws.hidden_size, ws.topk, routed[2].shape[2]
        plan = self._rows_plan(cfg, ws, sched, inner)
        rows, offsets = plan.num_rows, plan.offsets
        experts = self._routed_experts(cfg, routed)
        El = routed[0].shape[0]
        tensor_cores = experts is None and gpu_forward_kernels(cfg, ws.device, H, inner, El)
        fp8_cores = experts is None and gpu_mxfp8_forward_kernels(cfg, ws.device, H, inner, El)
        if experts is not None:
            experts_R = _row_experts(sched, rows)
        elif fp8_cores:
            mx_weights = _mx_weights(routed)
            segments = sched.expert_offsets_El1.to(torch.int64)
        elif tensor_cores:
            kernel_weights: Weights3 = (routed[0].contiguous(), routed[1].contiguous(), routed[2].contiguous())
            segments = sched.expert_offsets_El1.to(torch.int64)
        else:
            weights = expert_weights(cfg, routed)
        ring_rows = plan.ring_rows
        dev = ws.device
        ring_x = self._pulled_rows(cfg, ring_rows, H, dev)
        if fp8_cores:  # 16-byte aligned rows for the copy engine; the context keeps H + H/32 bytes
            ring_x = torch.zeros(ring_rows, _mx_row_bytes(H), dtype=torch.uint8, device=dev)
        # The BF16 GPU kernels zero the rows outside the segments themselves (zero_outside): no fill.
        ring_ab = torch.empty if tensor_cores else torch.zeros
        ring_a = ring_ab(ring_rows, inner, dtype=BF16, device=dev)
        ring_b = ring_ab(ring_rows, inner, dtype=BF16, device=dev)
        ring_h = torch.empty(ring_rows, inner, dtype=BF16, device=dev) if tensor_cores and outputs else None
        macrobatches = plan.macrobatches()
        direct = (
            outputs and fp8_cores and ws.world_size == 1 and cfg.combine == "push"
            and len(macrobatches) == 1
        )  # fmt: skip
        table_y: torch.Tensor | None = None
        # Last to first: the ring ends holding macrobatch 0 (without outputs only it is needed).
        for lo, hi in reversed(macrobatches) if outputs else macrobatches[:1]:
            if fp8_cores:  # as the BF16 GEMMs below: the whole macrobatch in one call
                n, nw = hi - lo, self._movers(cfg, ws)
                xs = self._mx_rows(cfg, tr, sched, ring_x[:n], lo, K, nw, keep=lo == 0)
                y_rows = self._y_rows(cfg, tr, lo, hi, H, dev) if outputs else None
                seg = (segments - lo).clamp_(0, n)
                wd_mx = mx_weights[2] if outputs else None
                out_mx = MxGroupedForward(ring_a[:n], ring_b[:n], None, None, y_rows)
                mxfp8_grouped_forward(xs, H, seg, mx_weights[0], mx_weights[1], wd_mx, cfg.swiglu_limit, out=out_mx)
                if direct:
                    table_y = y_rows
                elif y_rows is not None:
                    self._give(cfg, tr, sched, y_rows, "rows", "y_send", lo, nw)
                continue
            if tensor_cores:
                # The GPU GEMMs take the whole macrobatch at once (nothing overlaps the transport
                # yet, so smaller calls would only cost launches; a row's bits do not depend on
                # the call): pull its rows, the experts over its segments, push its outputs.
                n = hi - lo
                # The copies run alone between the GEMMs: every SM moves rows (fwd_num_comm_sms is
                # what the fused kernels will give to communication while they compute).
                nw = self._movers(cfg, ws)
                if cfg.dispatch == "push" and lo > 0:  # not kept: the GEMMs read the pushed rows
                    xs = self._received(cfg, tr, "x_recv", lo, hi)
                else:
                    xs = self._receive(cfg, tr, sched, "x", ring_x[:n], lo, K, nw)
                y_rows = self._y_rows(cfg, tr, lo, hi, H, dev) if outputs else None
                h = None if ring_h is None else ring_h[:n]
                seg = (segments - lo).clamp_(0, n)
                wd = kernel_weights[2] if outputs else None
                # The backend made every tensor to shape: the launch without grouped_forward's checks.
                launch_forward(xs, seg, kernel_weights[0], kernel_weights[1], wd,
                               GroupedForward(ring_a[:n], ring_b[:n], h, y_rows), limit=cfg.swiglu_limit,
                               with_h=outputs, zero_outside=True)  # fmt: skip
                if y_rows is not None:
                    self._give(cfg, tr, sched, y_rows, "rows", "y_send", lo, nw)
                continue
            for mlo, mhi in plan.minibatches(lo, hi):
                ring = slice(mlo - lo, mhi - lo)
                xs = self._receive(cfg, tr, sched, "x", ring_x[ring], mlo, K, cfg.fwd_num_comm_sms)
                y: torch.Tensor | None = None
                if experts is not None:
                    y = torch.empty(mhi - mlo, H, dtype=BF16, device=dev) if outputs else None
                    experts.forward(experts_R[mlo:mhi], xs, ring_a[ring], ring_b[ring], y)
                else:
                    r = _Rows(sched, mlo, mhi, offsets, weights)
                    a, b = gate_up(self._values(cfg, r.grid(xs), H), r.w, r.layout)
                    ring_a[ring] = r.flat(a, ring_a[ring])
                    ring_b[ring] = r.flat(b, ring_b[ring])
                    if outputs:
                        y_rows = down(swiglu(a, b, cfg.swiglu_limit), r.w, r.layout)
                        y = r.flat(y_rows, torch.empty(mhi - mlo, H, dtype=BF16, device=dev)).contiguous()
                if y is not None:
                    self._give(cfg, tr, sched, y, "rows", "y_send", mlo, cfg.fwd_num_comm_sms)
        if fp8_cores:
            ring_x = ring_x[:, : H + H // 32]
        return megakernel.Outputs(ring_a, ring_b, ring_x), table_y

    def _scattered_experts(
        self, cfg: MoKConfig, ws: Workspace, tr: Transport, route_row: int, row_src: int, offsets_El1: torch.Tensor,
        x_TH: torch.Tensor, routed: Weights3, y_rows: torch.Tensor | None,
    ) -> megakernel.Outputs:  # fmt: skip
        """The routed experts where the token rows are scattered (scatters_token_rows: one rank,
        one macrobatch, the BF16 tensor cores), with the least host work between the table and
        the GEMMs' launch: x's rows put into table order (Transport.scatter_local, by the
        addresses of the schedule's route_row_TK and row_src_rank_C: it reads nothing else, so
        it may run before the schedule's send side), then the grouped GEMMs over the capacity's
        rows, y into `y_rows` [C, H] (None: a and b only, a recompute). Returns the context the
        backward reads (a, b and the x rows, as the megakernel's)."""
        C, H, inner, dev = ws.capacity, ws.hidden_size, routed[2].shape[2], ws.device
        x_rows = self._pulled_rows(cfg, C, H, dev)
        tr.scatter_local(_bf16_rows(x_TH), x_rows, route_row, row_src, ws.topk, self._movers(cfg, ws))
        outputs = y_rows is not None
        a = torch.empty(C, inner, dtype=BF16, device=dev)
        b = torch.empty(C, inner, dtype=BF16, device=dev)
        h = torch.empty(C, inner, dtype=BF16, device=dev) if outputs else None
        # (the functional API hands the backend bf16 weights, contiguous; its call made the device current)
        launch_forward(x_rows, offsets_El1.to(torch.int64), routed[0], routed[1], routed[2] if outputs else None,
                       GroupedForward(a, b, h, y_rows), limit=cfg.swiglu_limit, with_h=outputs,
                       zero_outside=True)  # fmt: skip
        return megakernel.Outputs(a, b, x_rows)

    def _y_rows(self, cfg: MoKConfig, tr: Transport, lo: int, hi: int, H: int, dev: torch.device) -> torch.Tensor:
        """Where the GPU kernels write table rows [lo, hi)'s outputs: a pull combine's send rows,
        or a fresh buffer."""
        y_rows = self._output_rows(cfg, tr, "y_send", lo, hi)
        return torch.empty(hi - lo, H, dtype=BF16, device=dev) if y_rows is None else y_rows

    def _mx_rows(
        self, cfg: MoKConfig, tr: Transport, sched: Schedule, out: torch.Tensor, lo: int, K: int, nw: int,
        keep: bool = False, field: str = "x",
    ) -> torch.Tensor:  # fmt: skip
        """MXFP8 x (or dy) rows [lo, lo + len(out)) for the FP8 kernels (16-byte aligned rows):
        pulled into `out` ([n, _mx_row_bytes(H)] uint8), or the pushed table rows themselves (2H
        bytes each; copied into `out` as well when `keep`: the context holds macrobatch 0's rows)."""
        if cfg.dispatch == "push":
            pushed = tr.view[f"{field}_recv"][lo : lo + out.shape[0]].view(torch.uint8)
            if keep:
                out.copy_(pushed[:, : out.shape[1]])
            return pushed
        return self._receive(cfg, tr, sched, field, out, lo, K, nw)

    def _shared_forward(
        self, cfg: MoKConfig, x_TH: torch.Tensor, shared: Weights3 | None, *, outputs: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The shared expert on every local token: one expert whose rows are the tokens."""
        kernels, limit = self.expert_kernels, cfg.swiglu_limit
        if shared is not None and gpu_shared_kernels(x_TH.device, x_TH.shape[1], shared[0].shape[0]):
            T = x_TH.shape[0]
            one = torch.arange(2, dtype=torch.int64, device=x_TH.device) * T  # one segment: every token
            wd = shared[2].contiguous()[None] if outputs else None
            out = grouped_forward(x_TH.contiguous(), one, shared[0].contiguous()[None], shared[1].contiguous()[None],
                                  wd, limit, with_h=outputs)  # fmt: skip
            return out.y, out.a, out.b
        if kernels is None or shared is None:
            return shared_forward(x_TH, shared, limit, outputs=outputs)
        T, Is = x_TH.shape[0], shared[0].shape[0]
        a = torch.empty(T, Is, dtype=BF16, device=x_TH.device)
        b = torch.empty_like(a)
        y = torch.empty(T, x_TH.shape[1], dtype=BF16, device=x_TH.device) if outputs else None
        experts = _Experts(kernels, (shared[0][None], shared[1][None], shared[2][None]), limit)
        experts.forward(torch.zeros(T, dtype=torch.int64), x_TH, a, b, y)
        return y, a, b

    def _forward(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule, x_TH: torch.Tensor, router_weights_TK: torch.Tensor,
        routed: Weights3, shared: Weights3 | None,
    ) -> tuple[torch.Tensor, ForwardContext]:  # fmt: skip
        tr = self._transport(ws, cfg)
        path = expert_path(cfg, ws, routed[2].shape[2])
        return self._forward_on(cfg, ws, tr, path, sched, x_TH, router_weights_TK, routed, shared)

    def _forward_on(
        self, cfg: MoKConfig, ws: Workspace, tr: Transport, path: ExpertPath, sched: Schedule, x_TH: torch.Tensor,
        router_weights_TK: torch.Tensor, routed: Weights3, shared: Weights3 | None,
    ) -> tuple[torch.Tensor, ForwardContext]:  # fmt: skip
        """The forward of a call on `tr` along `path`."""
        _log_path(cfg, ws, path, "forward")
        rest = functools.partial(self._forward_rest, cfg, ws, sched, tr, x_TH, router_weights_TK, shared)
        if path.forward == "megakernel":
            table = (sched.row_route_C.data_ptr(), sched.expert_offsets_El1)
            ranks = None
            if ws.world_size > 1:  # each row read from its source rank's x_src, stored into its rows
                self._send_inputs(cfg, ws, tr, sched, x=x_TH)
                tr.barrier(3)  # every rank's x rows are there to read
                ranks = megakernel.Ranks(sched.row_src_rank_C.data_ptr(), tr.ptrs["x_src"], tr.ptrs["rows"])
            out = self._megakernel_launch(cfg, ws, tr, *table, x_TH, routed, ranks=ranks)
            y, shared_ab = rest(None, moved=ranks is not None)
            return y, self._context(sched, out, shared_ab)
        if scatters_token_rows(cfg, ws, routed[2].shape[2], path):  # one rank: nothing to send first
            y_rows = self._y_rows(cfg, tr, 0, ws.capacity, ws.hidden_size, ws.device)  # a pull combine's y_send
            out = self._scattered_experts(cfg, ws, tr, *_scatter_table(sched), x_TH, routed, y_rows)
            table_y = y_rows if cfg.combine == "push" else None
        else:
            self._send_inputs(cfg, ws, tr, sched, x=x_TH)
            tr.barrier(3)
            out, table_y = self._routed_forward(cfg, ws, sched, tr, routed, outputs=True)
        y, shared_ab = rest(table_y, moved=table_y is None)
        return y, self._context(sched, out, shared_ab)

    @overload
    @staticmethod
    def _megakernel_launch(
        cfg: MoKConfig, ws: Workspace, tr: Transport, row_route: int, offsets: torch.Tensor, x_TH: torch.Tensor,
        routed: Weights3, *, context: Literal[True] = True, ranks: megakernel.Ranks | None = None,
    ) -> megakernel.Outputs: ...  # fmt: skip

    @overload
    @staticmethod
    def _megakernel_launch(
        cfg: MoKConfig, ws: Workspace, tr: Transport, row_route: int, offsets: torch.Tensor, x_TH: torch.Tensor,
        routed: Weights3, *, context: bool, ranks: megakernel.Ranks | None = None,
    ) -> megakernel.Outputs | None: ...  # fmt: skip

    @staticmethod
    def _megakernel_launch(
        cfg: MoKConfig, ws: Workspace, tr: Transport, row_route: int, offsets: torch.Tensor, x_TH: torch.Tensor,
        routed: Weights3, *, context: bool = True, ranks: megakernel.Ranks | None = None,
    ) -> megakernel.Outputs | None:  # fmt: skip
        """The megakernel on the table (row_route_C's address, expert_offsets_El1): the
        routed experts in one launch, each route's row into the transport's `rows` (route order) of
        its source rank, and (with `context`) the x rows it gathered in table order (the context's
        routed x, as the chain's) and the pre-activations. At one rank no barrier (there is no
        peer); across ranks (`ranks`: on the CPU, as expert_path keeps the GPU's on the chain) the
        caller's barriers 3 and 4 stand before and after it. On the CPU it runs the rows in use
        (read on the host, as the CPU's ring plan does: the context holds those rows only)."""
        rows = int(offsets[-1]) if ws.device.type == "cpu" else None
        return megakernel.moe_forward(
            ws, row_route, offsets.data_ptr(), x_TH, routed, tr.view["rows"], tr.error, limit=cfg.swiglu_limit,
            timeout_ns=tr.timeout_ns, context=context, ranks=ranks, rows=rows,
        )  # fmt: skip

    def _forward_rest(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule | None, tr: Transport, x_TH: torch.Tensor,
        router_weights_TK: torch.Tensor, shared: Weights3 | None, y_rows: torch.Tensor | None,
        *, moved: bool = False,
    ) -> tuple[torch.Tensor, SharedContext]:  # fmt: skip
        """What follows the routed experts' launch: the shared expert, the combine, the error
        snapshot; y and the shared expert's context (a, b: None without one). The combine reads
        each route's output row from the table-ordered `y_rows` through the route's row (one
        rank: where the GEMMs left them), else from the transport's `rows` in route order: where
        the megakernel wrote them, or with `moved` where they land once every rank is past the
        barrier after the outputs (and a pull combine collected them). `sched` may be None where
        neither is asked (one rank's megakernel, no context: the routes' shape is the weights')."""
        (T, K), H = router_weights_TK.shape, ws.hidden_size
        ys, shared_a, shared_b = self._shared_forward(cfg, x_TH, shared, outputs=True)
        w = router_weights_TK.float().reshape(-1).contiguous()
        if y_rows is not None:
            assert sched is not None, "the route rows of table-ordered outputs are the schedule's"
            y = self._combine(tr, ys, y_rows, w, T, K, H, row_index=sched.route_row_TK.reshape(-1))
        else:
            if moved:
                assert sched is not None, "a move across ranks follows the schedule"
                tr.barrier(4)  # every push has landed (or every output row is there to pull)
                self._collect(cfg, ws, tr, sched, d_w=False)
            y = self._combine(tr, ys, tr.view["rows"][: T * K], w, T, K, H)
        self._after_call(tr)
        return y, (shared_a, shared_b)

    def _context(self, sched: Schedule, out: megakernel.Outputs, shared_ab: SharedContext) -> ForwardContext:
        """The context the backward reads: the routed rows' (`out`) and the shared expert's."""
        return ForwardContext(sched, self.name, out.x, out.a, out.b, *shared_ab)

    def _recompute_forward_context(
        self,
        cfg: MoKConfig,
        ws: Workspace,
        sched: Schedule,
        x_TH: torch.Tensor,
        routed: Weights3,
        shared: Weights3 | None,
    ) -> ForwardContext:
        tr = self._transport(ws, cfg)
        if scatters_token_rows(cfg, ws, routed[2].shape[2]):  # one rank: nothing to send, no peer to meet
            out = self._scattered_experts(cfg, ws, tr, *_scatter_table(sched), x_TH, routed, None)
        else:
            self._send_inputs(cfg, ws, tr, sched, x=x_TH)
            tr.barrier(7)
            out = self._routed_forward(cfg, ws, sched, tr, routed, outputs=False)[0]
        _, shared_a, shared_b = self._shared_forward(cfg, x_TH, shared, outputs=False)
        tr.barrier(8)  # every rank has pulled: x_src may be rewritten
        self._after_call(tr)
        return self._context(sched, out, (shared_a, shared_b))

    # ------------------------------------------------------------------ backward

    def _mx_macrobatch_backward(
        self, cfg: MoKConfig, seg: torch.Tensor, ctx: ForwardContext, m: int, xs: torch.Tensor, dys: torch.Tensor,
        wr: torch.Tensor, mx: list[MXFP8Tensor], gate_up: list[MXFP8Tensor], acc: Weights3 | None,
        final: Weights3, last: bool, tr: Transport, sched: Schedule, lo: int, nw: int,
    ) -> None:  # fmt: skip
        """One macrobatch of the MXFP8 routed experts' backward on the FP8 kernels: MXFP8 rows xs
        and dys ([n, >= H + H/32] at 16-byte strides), router weights wr [n]; `mx` the weights
        with their transposed copies, `gate_up` Wg and Wu with their normal copies (for a replay).
        The weight gradients (dWg, dWu, dWd) start from +0 in macrobatch 0, are carried in the
        fp32 `acc` between macrobatches, and the last macrobatch writes `final` (bf16, or `acc`
        itself in fp32); dx and d_w go to the transport."""
        n, (_, I, H) = xs.shape[0], mx[0].shape
        if m == 0:
            a, b = ctx.a_MI[:n], ctx.b_MI[:n]
        else:  # replay: the pre-activations recomputed by the forward's GEMMs (the same bits)
            ab = mxfp8_grouped_forward(xs, H, seg, gate_up[0], gate_up[1], None, cfg.swiglu_limit)
            a, b = ab.a, ab.b
        g = mxfp8_grouped_gemm(dys, H, seg, mx[2].operand(transposed=True), out_dtype=torch.float32)
        # The element pass: the SwiGLU backward, dx's A quantized along 2I, and the weight
        # gradients' four operands quantized along the rows (x and dy from their dispatched values).
        bw = mxfp8_swiglu_backward(g, a, b, wr, xs, dys, H, cfg.swiglu_limit)
        dx = mxfp8_grouped_gemm(bw.dab_rows, 2 * I, seg, mx[0].operand(True), mx[1].operand(True))
        # dWg += Q(d_a)^T Q(x_q), dWu += Q(d_b)^T Q(x_q), dWd += Q(bf16(w dy))^T Q(h).
        for i, (a_t, b_t) in enumerate(((bw.da_t, bw.x_t), (bw.db_t, bw.x_t), (bw.wdy_t, bw.h_t))):
            carry = None if m == 0 or acc is None else acc[i]  # acc is None: one macrobatch
            out = final[i] if last or acc is None else acc[i]
            mxfp8_grouped_wgrad(a_t, b_t, seg, carry=carry, out=out, out_dtype=out.dtype)
        d_w = bw.d_w
        self._give(cfg, tr, sched, dx, "rows", "y_send", lo, nw)
        self._give(cfg, tr, sched, d_w.contiguous(), "d_w", "dw_send", lo, nw)

    def _shared_backward(
        self, cfg: MoKConfig, x_TH: torch.Tensor, dy_TH: torch.Tensor, a_TIs: torch.Tensor | None,
        b_TIs: torch.Tensor | None, shared: Weights3 | None, wgrad_dtype: torch.dtype,
    ) -> tuple[torch.Tensor | None, Weights3 | None]:  # fmt: skip
        """(dx_s, (dWg_s, dWu_s, dWd_s)) of the shared expert: tokens are the rows, in order, unweighted."""
        kernels, limit = self.expert_kernels, cfg.swiglu_limit
        # One call over every token: the weight gradients' row blocks never meet a split.
        if shared is not None and gpu_shared_kernels(x_TH.device, x_TH.shape[1], shared[0].shape[0]):
            assert a_TIs is not None and b_TIs is not None
            (T, H), Is, dev = x_TH.shape, shared[0].shape[0], x_TH.device
            one = torch.arange(2, dtype=torch.int64, device=dev) * T  # one segment: every token
            wg, wu, wd = (w.contiguous()[None] for w in shared)
            grads = _wgrad_tensors(1, H, Is, wgrad_dtype, dev)
            fp32 = wgrad_dtype == torch.float32
            out = grouped_backward(x_TH.contiguous(), one, a_TIs, b_TIs, dy_TH.contiguous(), None, wg, wu, wd,
                                   grads if fp32 else None, limit, carry_in=False,
                                   wgrad_out=None if fp32 else grads)  # fmt: skip
            return out.dx, (grads[0][0], grads[1][0], grads[2][0])
        if kernels is None or shared is None:
            return shared_backward(x_TH, dy_TH, a_TIs, b_TIs, shared, limit, wgrad_dtype)
        assert a_TIs is not None and b_TIs is not None
        (T, H), Is, dev = x_TH.shape, shared[0].shape[0], x_TH.device
        dx = torch.empty(T, H, dtype=BF16, device=dev)
        d_w = torch.empty(T, dtype=torch.float32, device=dev)  # unused: no router weight
        d_gate_up = torch.zeros(1, 2 * Is, H, dtype=torch.float32, device=dev)
        d_down = torch.zeros(1, H, Is, dtype=torch.float32, device=dev)
        experts = _Experts(kernels, (shared[0][None], shared[1][None], shared[2][None]), limit)
        experts.backward(torch.zeros(T, dtype=torch.int64), x_TH, a_TIs, b_TIs, dy_TH, None, dx, d_w, d_gate_up, d_down)
        dWg, dWu, dWd = routed_wgrads(d_gate_up, d_down, wgrad_dtype)
        return dx, (dWg[0], dWu[0], dWd[0])

    @staticmethod
    def _backward_lane(cfg: MoKConfig, ws: Workspace, inner: int) -> bool:
        """Whether a backward on `ws` with `cfg` (routed inner size `inner`) is one rank's direct one
        with dy gathered by the g GEMM, which `_backward_call` issues in one extension call: BF16 on
        the tensor cores, one macrobatch (no replay), a push combine, H below
        GATHER_DY_MAX_HIDDEN. Decided once per workspace, config and I, as expert_path."""
        last = ws.state.get("backward lane")
        if last is not None and last[0] is cfg and last[1] == inner:
            return last[2]  # type: ignore[no-any-return]
        plan = static_ring_plan(cfg, ws, inner) if ws.device.type == "cuda" else None
        lane = (
            plan is not None
            and ws.world_size == 1
            and cfg.combine == "push"
            and plan.macrobatch >= plan.num_rows
            and ws.hidden_size < GATHER_DY_MAX_HIDDEN
            and gpu_forward_kernels(cfg, ws.device, ws.hidden_size, inner, ws.num_local_experts)
            and expert_path(cfg, ws, inner).backward == "tensor-cores"
            and not replays_in_backward(cfg, ws)
        )
        ws.state["backward lane"] = (cfg, inner, lane)
        return lane

    @classmethod
    def _gathers_x(cls, cfg: MoKConfig, ws: Workspace, inner: int) -> bool:
        """Whether a backward on `ws` with `cfg` (routed inner size `inner`) gathers x's rows by route
        in dW1 (GATHER_X_MAX_INNER), its forward then storing no routed x."""
        return inner <= GATHER_X_MAX_INNER and cls._backward_lane(cfg, ws, inner)

    def _backward_call(
        self, cfg: MoKConfig, ws: Workspace, tr: Transport, sched: Schedule, ctx: ForwardContext, dy_TH: torch.Tensor,
        x_TH: torch.Tensor, router_weights_TK: torch.Tensor, routed: Weights3, shared: Weights3 | None,
        wgrad_dtype: torch.dtype,
    ) -> Grads:  # fmt: skip
        """The direct backward (see _backward) in one extension call (grouped.backward_call): the
        shared expert's first (its dx is the combine's base), then the table's offsets widened, the
        routed kernels reading dy and the router weights by route, d_router stored by route and the
        combine of dx, which publishes the error words, with the bits of _backward's walk. A context
        without x's rows (the forward stored none: _gathers_x) has dW1 gather them from x_TH."""
        _log_path(cfg, ws, expert_path(cfg, ws, routed[2].shape[2]), "backward")
        C, H, El = ws.capacity, ws.hidden_size, ws.num_local_experts
        dxs, d_shared = self._shared_backward(cfg, x_TH, dy_TH, ctx.shared_a_TIs, ctx.shared_b_TIs, shared, wgrad_dtype)
        wg, wu, wd = (w.contiguous() for w in routed)
        weights = (wg, wu, wd)
        inner = wg.shape[1]
        grads = _wgrad_tensors(El, H, inner, torch.float32 if wgrad_dtype == torch.float32 else BF16, ws.device)
        w = router_weights_TK
        if w.dtype != torch.float32 or not w.is_contiguous():
            w = w.float().contiguous()
        x_rows = None if ctx.x_routed_MH is None else ctx.x_routed_MH[:C]
        dx, d_router = backward_call(
            sched.expert_offsets_El1, sched.row_route_C, sched.route_row_TK, x_rows, ctx.a_MI[:C],
            ctx.b_MI[:C], dy_TH.contiguous(), w, weights, grads, dxs, x_TH=None if x_rows is not None else
            _bf16_rows(x_TH), limit=cfg.swiglu_limit, error=tr.error_ptr, mirror=tr.mirror_address,
            stream=tr._stream(),
        )  # fmt: skip
        # (its combine published the error words: no _after_call)
        dtype = router_weights_TK.dtype
        return Grads(dx, d_router if d_router.dtype == dtype else d_router.to(dtype), grads, d_shared)

    def _backward(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule, ctx: ForwardContext, dy_TH: torch.Tensor,
        x_TH: torch.Tensor, router_weights_TK: torch.Tensor, routed: Weights3, shared: Weights3 | None,
        wgrad_dtype: torch.dtype,
    ) -> Grads:  # fmt: skip
        tr = self._transport(ws, cfg)
        T, K, H, El = sched.num_tokens, sched.topk, ws.hidden_size, ws.num_local_experts
        inner = routed[2].shape[2]
        if T > 0 and self._backward_lane(cfg, ws, inner):
            return self._backward_call(cfg, ws, tr, sched, ctx, dy_TH, x_TH, router_weights_TK, routed, shared,
                                       wgrad_dtype)  # fmt: skip
        replay = replays_in_backward(cfg, ws)
        w_TK = router_weights_TK.float().reshape(-1).contiguous()
        plan = self._rows_plan(cfg, ws, sched, inner)
        rows, macro, offsets = plan.num_rows, plan.macrobatch, plan.offsets
        dev, nw = ws.device, cfg.bwd_num_comm_sms
        experts = self._routed_experts(cfg, routed)
        # A replay recomputes a and b with the GEMMs the forward used (so their bits match).
        tensor_cores = experts is None and gpu_forward_kernels(cfg, dev, H, inner, El)
        fp8_cores = experts is None and gpu_mxfp8_forward_kernels(cfg, dev, H, inner, El)
        mx_gate_up: list[MXFP8Tensor] = []  # quantized at the first replay that needs them
        if fp8_cores:
            segments = sched.expert_offsets_El1.to(torch.int64)
        # The MXFP8 backward on the FP8 kernels, a macrobatch per call (as the forward): g and dx
        # (mok_mxfp8.grouped_gemm), the weight gradients in 32-row blocks carried in fp32 between
        # macrobatches (grouped_wgrad). Macrobatch bounds are multiples of the alignment (>= 32 in
        # MXFP8), so the row blocks are the reference's.
        fp8_backward = fp8_cores and rows % 32 == 0 and macro % 32 == 0
        if fp8_backward:
            # Its GEMMs read the transposed copies; a replay (macrobatch > 0) also Wg's and Wu's normal
            # copies, quantized when first needed.
            mx_t = [w if isinstance(w, MXFP8Tensor) else mxfp8_quantize(w, normal=False) for w in routed]
        # The GPU backward's weight gradients take 64-row blocks from each segment start: every
        # macrobatch boundary and segment start must be a multiple of 64 for a split to carry
        # exactly (docs/determinism.md "The GPU GEMMs"); otherwise the reference arithmetic.
        path = expert_path(cfg, ws, inner)
        _log_path(cfg, ws, path, "backward")
        gpu_backward = tensor_cores and path.backward == "tensor-cores"
        if tensor_cores:
            wg_k, wu_k, wd_k = (w.contiguous() for w in routed)
            segments = sched.expert_offsets_El1.to(torch.int64)
        if gpu_backward or fp8_backward:
            # The weight gradients: fp32 accumulators carried between macrobatches (or handed
            # out, for fp32 parameters), the last macrobatch writing the bf16 gradients itself.
            fp32 = wgrad_dtype == torch.float32
            num_macro = -(-rows // macro)
            acc = _wgrad_tensors(El, H, inner, torch.float32, dev) if fp32 or num_macro > 1 else None
            final = acc if fp32 and acc is not None else _wgrad_tensors(El, H, inner, BF16, dev)
        else:
            d_gate_up = torch.zeros(El, 2 * inner, H, dtype=torch.float32, device=dev)
            d_down = torch.zeros(El, H, inner, dtype=torch.float32, device=dev)
        if experts is not None:
            experts_R = _row_experts(sched, rows)
        elif not (gpu_backward or fp8_backward):  # the rows' loop below: the reference's weights
            weights = expert_weights(cfg, routed)
        # One rank, one macrobatch, a push combine: the combine reads dx and d_w where the GEMMs
        # left them, in table order, through each route's row (no push into route order).
        direct = gpu_backward and ws.world_size == 1 and cfg.combine == "push" and macro >= rows
        # ... where the SwiGLU kernel reads each row's router weight through its route (w_TK as it
        # is: no copy into table order, which cost a move of 4-byte rows, 40-110 us; session 16),
        # and below GATHER_DY_MAX_HIDDEN the g GEMM gathers dy's rows by route too (no move of dy).
        gather_dy = direct and H < GATHER_DY_MAX_HIDDEN and T > 0
        # Else at one rank in one macrobatch dy's rows are scattered into the table (each read
        # once; scatters_token_rows), not sent to dy_src and pulled.
        scatter_dy = gpu_backward and not gather_dy and ws.world_size == 1 and macro >= rows
        # On the CPU after the megakernel's call (expert_path: BF16, no replay, a push combine) the
        # backward is its mirror, one call: each row's dy and weight read from its source rank, its
        # dx and d_w pushed to its route there (mok_bf16.moe_backward; at one rank dy_TH and w_TK
        # are read where they are, so nothing is sent).
        host_call = path.backward == "megakernel" and dev.type == "cpu"
        read_in_place = host_call and ws.world_size == 1
        self._send_inputs(cfg, ws, tr, sched, x=x_TH if replay else None,
                          dy=None if gather_dy or scatter_dy or read_in_place else dy_TH,
                          w=None if direct or read_in_place else w_TK)  # fmt: skip
        tr.barrier(5)
        table_dx = table_dw = None
        if host_call:
            saved = (ctx.routed_x(), ctx.a_MI, ctx.b_MI)
            dy = _bf16_rows(dy_TH).contiguous()
            dwg, dwu, d_down = megakernel.moe_backward(ws, sched, saved, routed, tr.ptrs, tr.view, dy, w_TK,
                                                       limit=cfg.swiglu_limit)  # fmt: skip
            d_gate_up = torch.cat((dwg, dwu), dim=1)
        for m, (lo, hi) in enumerate(() if host_call else plan.macrobatches()):  # first to last
            if fp8_backward:
                n, nw = hi - lo, self._movers(cfg, ws, backward=True)
                mx_bytes = (n, _mx_row_bytes(H))
                if m == 0:
                    xs = ctx.routed_x()[:n]
                    if xs.stride(0) % 16:  # a saved copy of packed rows (the autograd op clones them)
                        xs = torch.zeros(mx_bytes, dtype=torch.uint8, device=dev)
                        xs[:, : H + H // 32] = ctx.routed_x()[:n, : H + H // 32]
                else:
                    xs = self._mx_rows(cfg, tr, sched, torch.zeros(mx_bytes, dtype=torch.uint8, device=dev), lo, K, nw)
                dy_buf = torch.zeros(mx_bytes, dtype=torch.uint8, device=dev)
                dys = self._mx_rows(cfg, tr, sched, dy_buf, lo, K, nw, field="dy")
                if cfg.dispatch == "push":
                    wr = self._received(cfg, tr, "w_recv", lo, hi)
                else:
                    wr = self._receive(cfg, tr, sched, "w", torch.empty(n, dtype=torch.float32, device=dev), lo, 1, nw)
                mx_gate_up = mx_gate_up or (_mx_weights(routed[:2]) if m > 0 else [])
                self._mx_macrobatch_backward(cfg, (segments - lo).clamp_(0, n), ctx, m, xs, dys, wr, mx_t,
                                             mx_gate_up, acc, final, hi == rows, tr, sched, lo, nw)  # fmt: skip
                continue
            if gpu_backward:
                # The whole macrobatch in one call, as in the forward (and every SM moving rows):
                # its weight gradients read and write each expert's fp32 accumulators once.
                n, nw = hi - lo, self._movers(cfg, ws, backward=True)
                pushed = cfg.dispatch == "push"  # the GEMMs read pushed rows where they are
                if m == 0:
                    xs = ctx.routed_x()[:n]
                elif pushed:  # replay: the re-dispatched x; a replay recomputes a, b
                    xs = self._received(cfg, tr, "x_recv", lo, hi)
                else:
                    xs = self._receive(cfg, tr, sched, "x", self._pulled_rows(cfg, n, H, dev), lo, K, nw)
                if gather_dy:  # written by the g GEMM: its gathered rows in table order
                    dys = torch.empty(n, H, dtype=BF16, device=dev)
                elif scatter_dy:
                    table = (sched.route_row_TK.data_ptr(), sched.row_src_rank_C.data_ptr())
                    dys = tr.scatter_local(_bf16_rows(dy_TH), self._pulled_rows(cfg, n, H, dev), *table, K, nw)
                elif pushed:
                    dys = self._received(cfg, tr, "dy_recv", lo, hi)
                else:
                    dys = self._receive(cfg, tr, sched, "dy", self._pulled_rows(cfg, n, H, dev), lo, K, nw)
                if direct:
                    wr = w_TK
                elif pushed:
                    wr = self._received(cfg, tr, "w_recv", lo, hi)
                else:
                    wr = self._receive(cfg, tr, sched, "w", torch.empty(n, dtype=torch.float32, device=dev), lo, 1, nw)
                # The segments of this macrobatch's rows (every segment when it holds them all)
                seg = segments if lo == 0 and n >= ws.capacity else (segments - lo).clamp_(0, n)
                if m == 0:
                    a, b = ctx.a_MI[:n], ctx.b_MI[:n]
                else:
                    ab = grouped_forward(xs, seg, wg_k, wu_k, None, cfg.swiglu_limit, with_h=False)
                    a, b = ab.a, ab.b
                last = hi == rows
                dx_out, dw_out = (
                    self._output_rows(cfg, tr, "y_send", lo, hi),
                    self._output_rows(cfg, tr, "dw_send", lo, hi),
                )
                out = None if dx_out is None or dw_out is None else GroupedBackward(dx_out, dw_out)
                # Direct: dx's rows go into dy's, the call's own buffer (dWd, dy's last reader, runs
                # first): one [n, H] array less, and no zero fill (the combine reads the routes' rows).
                if direct:
                    out = GroupedBackward(dys, torch.empty(n, dtype=torch.float32, device=dev))
                wgrad_out = final if last and not fp32 else None
                weight_route = sched.row_route_C[:n] if direct else None
                dy_tokens = dy_TH.contiguous() if gather_dy else None
                if n == 0:  # no kernel runs: the checked call gives the weight gradients' carry
                    dx, d_w = grouped_backward(xs, seg, a, b, dys, wr, wg_k, wu_k, wd_k, acc, cfg.swiglu_limit,
                                               out=out, carry_in=m > 0, wgrad_out=wgrad_out,
                                               weight_route=weight_route, dy_tokens=dy_tokens)  # fmt: skip
                else:
                    # The launch without grouped_backward's checks: every tensor here is made to shape
                    # by this backend (outputs fresh when no transport rows are given: zeroed outside
                    # the segments by the call).
                    fresh = out is None
                    if out is None:
                        out = GroupedBackward(torch.empty(n, H, dtype=BF16, device=dev),
                                              torch.empty(n, dtype=torch.float32, device=dev))  # fmt: skip
                    launch_backward(xs, seg, a, b, dys, wr, wg_k, wu_k, wd_k, out, backward_scratch(n, inner, dev),
                                    acc, wgrad_out, limit=cfg.swiglu_limit, carry_in=m > 0, zero_outside=fresh,
                                    weight_route=weight_route, dy_tokens=dy_tokens)  # fmt: skip
                    dx, d_w = out
                if direct:
                    table_dx, table_dw = dx, d_w
                    continue
                self._give(cfg, tr, sched, dx, "rows", "y_send", lo, nw)
                self._give(cfg, tr, sched, d_w, "d_w", "dw_send", lo, nw)
                continue
            for mlo, mhi in plan.minibatches(lo, hi):
                ring = slice(mlo - lo, mhi - lo)
                x_kernel = None  # MXFP8 rows the FP8 kernels read, for a replay's pre-activations
                if m == 0:
                    xs = ctx.routed_x()[ring]
                elif fp8_cores:
                    x_kernel = torch.zeros(mhi - mlo, _mx_row_bytes(H), dtype=torch.uint8, device=dev)
                    x_kernel = self._mx_rows(cfg, tr, sched, x_kernel, mlo, K, nw)
                    xs = x_kernel[:, : H + H // 32]
                else:  # replay: re-dispatch x (and recompute the pre-activations below)
                    xs = self._receive(cfg, tr, sched, "x", self._pulled_rows(cfg, mhi - mlo, H, dev), mlo, K, nw)
                dys = self._receive(cfg, tr, sched, "dy", self._pulled_rows(cfg, mhi - mlo, H, dev), mlo, K, nw)
                wr = self._receive(
                    cfg, tr, sched, "w", torch.empty(mhi - mlo, dtype=torch.float32, device=dev), mlo, 1, nw
                )
                if experts is not None:
                    experts_M = experts_R[mlo:mhi]
                    if m == 0:
                        a, b = ctx.a_MI[ring], ctx.b_MI[ring]
                    else:
                        a = torch.empty(mhi - mlo, inner, dtype=BF16, device=dev)
                        b = torch.empty_like(a)
                        experts.forward(experts_M, xs, a, b)
                    dx, d_w = torch.empty(mhi - mlo, H, dtype=BF16, device=dev), torch.empty_like(wr)
                    experts.backward(experts_M, xs, a, b, dys, wr, dx, d_w, d_gate_up, d_down)
                else:
                    r = _Rows(sched, mlo, mhi, offsets, weights)
                    xg, dyg, wg = self._values(cfg, r.grid(xs), H), self._values(cfg, r.grid(dys), H), r.grid(wr)
                    if m == 0:
                        a, b = r.grid(ctx.a_MI[ring]), r.grid(ctx.b_MI[ring])
                    elif x_kernel is not None:
                        seg = (segments - mlo).clamp_(0, mhi - mlo)
                        mx_gate_up = mx_gate_up or _mx_weights(routed[:2])
                        mx = mxfp8_grouped_forward(
                            x_kernel, H, seg, mx_gate_up[0], mx_gate_up[1], None, cfg.swiglu_limit
                        )
                        a, b = r.grid(mx.a), r.grid(mx.b)
                    elif tensor_cores:
                        seg = (segments - mlo).clamp_(0, mhi - mlo)
                        ab = grouped_forward(xs, seg, wg_k, wu_k, None, cfg.swiglu_limit, with_h=False)
                        a, b = r.grid(ab.a), r.grid(ab.b)
                    else:
                        a, b = gate_up(xg, r.w, r.layout)
                    rg = row_backward(xg, a, b, dyg, wg, r.w, cfg.swiglu_limit, r.layout)
                    accumulate_wgrads(xg, dyg, wg, rg, r.acc(d_gate_up), r.acc(d_down), r.layout, weights=r.w)
                    dx_rows = torch.empty(mhi - mlo, H, dtype=BF16, device=dev)
                    dx, d_w = r.flat(rg.dx, dx_rows).contiguous(), r.flat(rg.d_w, wr).contiguous()
                self._give(cfg, tr, sched, dx, "rows", "y_send", mlo, nw)
                self._give(cfg, tr, sched, d_w, "d_w", "dw_send", mlo, nw)
        dxs, d_shared = self._shared_backward(cfg, x_TH, dy_TH, ctx.shared_a_TIs, ctx.shared_b_TIs, shared, wgrad_dtype)
        if table_dx is not None and table_dw is not None:
            route_row = sched.route_row_TK.reshape(-1)
            dx = self._combine(tr, dxs, table_dx, None, T, K, H, row_index=route_row)
            # (A route no segment lists, its id no expert's, has row -1: it reads row 0, as the
            # call's results are not to be used: the next call raises the bad id.)
            d_router = table_dw.index_select(0, route_row.clamp(min=0)).view(T, K).to(router_weights_TK.dtype)
            self._after_call(tr)
            return Grads(dx, d_router, final, d_shared)
        tr.barrier(6)  # every push has landed (or every output row is there to pull)
        self._collect(cfg, ws, tr, sched, d_w=True)
        dx = self._combine(tr, dxs, tr.view["rows"][: T * K], None, T, K, H)
        d_router = tr.view["d_w"][: T * K].clone().view(T, K).to(router_weights_TK.dtype)
        self._after_call(tr)
        if gpu_backward or fp8_backward:
            return Grads(dx, d_router, final, d_shared)
        return Grads(dx, d_router, routed_wgrads(d_gate_up, d_down, wgrad_dtype), d_shared)
