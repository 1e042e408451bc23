"""The native backends, `cpu` and `cuda`: mok-core's runtime with the expert math in PyTorch.

mok-core builds the schedule table on the device, moves rows through shared memory (POSIX
shared memory between the processes of one machine, or symmetric memory between GPUs) with
epoch barriers that time out, and runs the fixed-order epilogues. The expert math between
the pulls and the pushes is the reference arithmetic (so every result is bitwise the
reference backend's); the precision packages replace it with kernels.

On the GPU nothing reads a device value on the host: the ring walks every row of the
table's capacity in static minibatches (rows past the last segment are empty and skipped
by the transport), each row carries its expert, and a whole forward + backward can be
captured in one CUDA graph. On the CPU the host reads the segment offsets and works on
expert blocks, as the reference does.

Shape letters: T tokens, K top-k, H hidden, I inner size, El local experts, C capacity.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ...config import MoKConfig, resolve_batching
from ...structs import ForwardContext, Grads, Schedule
from ...workspace import Workspace
from ..reference.experts import (
    BF16,
    ExpertWeights,
    Grouped,
    PerRow,
    accumulate_wgrads,
    down,
    gate_up,
    routed_wgrads,
    row_backward,
    shared_backward,
    shared_forward,
    swiglu,
)
from ..reference.ring import Block, replays_in_backward
from .transport import Transport, raise_transport_error

Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _on(ws: Workspace) -> Any:
    """The workspace's device made current: mok-core launches on the current device."""
    return torch.cuda.device(ws.device) if ws.device.type == "cuda" else contextlib.nullcontext()


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
    # The experts run the reference arithmetic until the precision packages' kernels land.
    reference_experts = True

    def __init__(self, device_type: str) -> None:
        self.name = device_type
        self.device_type = device_type

    # ------------------------------------------------------------------ availability

    def unavailable_reason(self, precision: str, device: torch.device) -> str | None:
        from .. import compiled_packages

        if device.type != self.device_type:
            return f"the {self.name!r} backend runs on {self.device_type} tensors, not {device.type}"
        if precision != "bf16":
            return f"the {self.name!r} backend runs precision 'bf16' only so far, not {precision!r}"
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
        tr.timeout_ns = int(cfg.timeout_s * 1e9)
        self._check_errors(tr)
        return tr

    def _check_errors(self, tr: Transport) -> None:
        """Raise a transport error a previous GPU call recorded (read without waiting)."""
        pending = tr.pending
        if tr.dev == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # no event queries inside a capture
        if pending is not None and pending[1].query():
            tr.pending = None
            raise_transport_error(pending[0].tolist(), tr.timeout_ns)

    def _after_call(self, tr: Transport) -> None:
        if tr.dev != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        host = torch.empty(4, dtype=torch.int32, pin_memory=True)
        host.copy_(tr.error, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        tr.pending = (host, event)

    def _stream(self, tr: Transport) -> int:
        return tr._stream()

    def _rows_plan(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule, inner: int
    ) -> tuple[int, int, int, tuple[int, ...] | None]:
        """(rows to walk, macrobatch, minibatch, host offsets or None)."""
        minibatch, macrobatch = resolve_batching(cfg, ws.hidden_size, inner, ws.num_sms)
        if self.device_type == "cpu":
            offsets = tuple(sched.expert_offsets_El1.tolist())
            rows = offsets[-1]
        else:
            offsets, rows = None, ws.capacity  # static: every row of the capacity
        if macrobatch is None:
            macrobatch = max(-(-rows // minibatch) * minibatch, minibatch)
        return rows, macrobatch, minibatch, offsets

    # ------------------------------------------------------------------ entry points

    def build_schedule(self, ws: Workspace, cfg: MoKConfig, top_experts_TK: torch.Tensor) -> Schedule:
        with _on(ws):
            return self._build_schedule(ws, cfg, top_experts_TK)

    def forward(self, cfg: MoKConfig, ws: Workspace, *args: Any) -> tuple[torch.Tensor, ForwardContext]:
        with _on(ws):
            return self._forward(cfg, ws, *args)

    def recompute_forward_context(self, cfg: MoKConfig, ws: Workspace, *args: Any) -> ForwardContext:
        with _on(ws):
            return self._recompute_forward_context(cfg, ws, *args)

    def backward(self, cfg: MoKConfig, ws: Workspace, *args: Any) -> Grads:
        with _on(ws):
            return self._backward(cfg, ws, *args)

    # ------------------------------------------------------------------ schedule

    def _build_schedule(self, ws: Workspace, cfg: MoKConfig, top_experts_TK: torch.Tensor) -> Schedule:
        tr = self._transport(ws, cfg)
        core, dev, stream = tr.core, tr.dev, tr._stream()
        top = top_experts_TK.to(torch.int32).contiguous()
        T, K = top.shape
        R, El, C = ws.world_size, ws.num_local_experts, ws.capacity
        tr.view["routes"][:T].copy_(top)
        tr.view["tokens"].fill_(T)
        tr.barrier(1)
        new = lambda n, dt: torch.empty(n, dtype=dt, device=ws.device)  # noqa: E731
        row_src, row_route = new(C, torch.int32), new(C, torch.int32)
        offsets, counts = new(El + 1, torch.int32), new(El, torch.int32)
        recv, tokens = new(R, torch.int64), new(R, torch.int64)
        core.build_table(
            dev, tr.ptrs["routes"].data_ptr(), tr.ptrs["tokens"].data_ptr(), R, ws.max_tokens, K, ws.rank, El,
            ws.expert_alignment, C, row_src.data_ptr(), row_route.data_ptr(), offsets.data_ptr(), counts.data_ptr(),
            recv.data_ptr(), tokens.data_ptr(), stream,
        )  # fmt: skip
        send_order, send_counts = new(T * K, torch.int64), new(R, torch.int64)
        core.build_send_side(dev, top.data_ptr(), T, K, El, R, send_order.data_ptr(), send_counts.data_ptr(), stream)
        tr.barrier(2)  # every rank has read every rank's routes: they may be rewritten
        self._after_call(tr)
        return Schedule(
            workspace=ws,
            backend=self.name,
            top_experts_TK=top,
            tokens_per_rank_R=tokens,
            row_src_rank_C=row_src,
            row_route_C=row_route,
            expert_offsets_El1=offsets,
            expert_counts_El=counts,
            recv_counts_R=recv,
            send_order_TK=send_order,
            send_counts_R=send_counts,
        )

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
    ) -> torch.Tensor:
        out = torch.empty(T, H, dtype=BF16, device=rows.device)
        tr.core.combine(
            tr.dev, out.data_ptr(), 0 if base is None else base.data_ptr(), rows.data_ptr(),
            0 if weights is None else weights.data_ptr(), T, K, H, tr._stream(),
        )  # fmt: skip
        return out

    def _routed_forward(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule, tr: Transport, weights: ExpertWeights, *, outputs: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        H, K, inner = ws.hidden_size, ws.topk, weights.intermediate_size
        rows, macro, mini, offsets = self._rows_plan(cfg, ws, sched, inner)
        ring_rows = min(macro, rows)
        dev = ws.device
        ring_x = torch.zeros(ring_rows, H, dtype=BF16, device=dev)
        ring_a = torch.zeros(ring_rows, inner, dtype=BF16, device=dev)
        ring_b = torch.zeros(ring_rows, inner, dtype=BF16, device=dev)
        macrobatches = [(lo, min(lo + macro, rows)) for lo in range(0, rows, macro)]
        # Last to first: the ring ends holding macrobatch 0 (without outputs only it is needed).
        for lo, hi in reversed(macrobatches) if outputs else macrobatches[:1]:
            for mlo in range(lo, hi, mini):
                mhi = min(mlo + mini, hi)
                table = (sched.row_src_rank_C[mlo:mhi], sched.row_route_C[mlo:mhi])
                xs = ring_x[mlo - lo : mhi - lo]
                tr.pull(xs, "x_src", table, route_divisor=K, num_workers=cfg.fwd_num_comm_sms)
                r = _Rows(sched, mlo, mhi, offsets, weights)
                a, b = gate_up(r.grid(xs), r.w, r.layout)
                ring_a[mlo - lo : mhi - lo] = r.flat(a, ring_a[mlo - lo : mhi - lo])
                ring_b[mlo - lo : mhi - lo] = r.flat(b, ring_b[mlo - lo : mhi - lo])
                if outputs:
                    y = r.flat(down(swiglu(a, b, cfg.swiglu_limit), r.w, r.layout), xs).contiguous()
                    tr.push(y, "rows", table, num_workers=cfg.fwd_num_comm_sms)
        return ring_x, ring_a, ring_b

    def _forward(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule, x_TH: torch.Tensor, router_weights_TK: torch.Tensor,
        routed: Weights3, shared: Weights3 | None,
    ) -> tuple[torch.Tensor, ForwardContext]:  # fmt: skip
        tr = self._transport(ws, cfg)
        T, K, H = sched.num_tokens, sched.topk, ws.hidden_size
        tr.view["x_src"][:T].copy_(x_TH)
        tr.barrier(3)
        ring_x, ring_a, ring_b = self._routed_forward(
            cfg, ws, sched, tr, ExpertWeights.from_weights(*routed), outputs=True
        )
        ys, shared_a, shared_b = shared_forward(x_TH, shared, cfg.swiglu_limit)
        tr.barrier(4)  # every push has landed
        w = router_weights_TK.float().reshape(-1).contiguous()
        y = self._combine(tr, ys, tr.view["rows"][: T * K], w, T, K, H)
        self._after_call(tr)
        return y, ForwardContext(sched, self.name, ring_x, ring_a, ring_b, shared_a, shared_b)

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
        tr.view["x_src"][: sched.num_tokens].copy_(x_TH)
        tr.barrier(7)
        ring_x, ring_a, ring_b = self._routed_forward(
            cfg, ws, sched, tr, ExpertWeights.from_weights(*routed), outputs=False
        )
        _, shared_a, shared_b = shared_forward(x_TH, shared, cfg.swiglu_limit, outputs=False)
        tr.barrier(8)  # every rank has pulled: x_src may be rewritten
        self._after_call(tr)
        return ForwardContext(sched, self.name, ring_x, ring_a, ring_b, shared_a, shared_b)

    # ------------------------------------------------------------------ backward

    def _backward(
        self, cfg: MoKConfig, ws: Workspace, sched: Schedule, ctx: ForwardContext, dy_TH: torch.Tensor,
        x_TH: torch.Tensor, router_weights_TK: torch.Tensor, routed: Weights3, shared: Weights3 | None,
        wgrad_dtype: torch.dtype,
    ) -> Grads:  # fmt: skip
        tr = self._transport(ws, cfg)
        T, K, H, El = sched.num_tokens, sched.topk, ws.hidden_size, ws.num_local_experts
        weights = ExpertWeights.from_weights(*routed)
        inner = weights.intermediate_size
        replay = replays_in_backward(cfg, ws)
        tr.view["dy_src"][:T].copy_(dy_TH)
        tr.view["w_src"][: T * K].copy_(router_weights_TK.float().reshape(-1))
        if replay:
            tr.view["x_src"][:T].copy_(x_TH)
        tr.barrier(5)
        rows, macro, mini, offsets = self._rows_plan(cfg, ws, sched, inner)
        dev, nw = ws.device, cfg.bwd_num_comm_sms
        d_gate_up = torch.zeros(El, 2 * inner, H, dtype=torch.float32, device=dev)
        d_down = torch.zeros(El, H, inner, dtype=torch.float32, device=dev)
        for m, lo in enumerate(range(0, rows, macro)):  # first to last
            hi = min(lo + macro, rows)
            for mlo in range(lo, hi, mini):
                mhi = min(mlo + mini, hi)
                table = (sched.row_src_rank_C[mlo:mhi], sched.row_route_C[mlo:mhi])
                r = _Rows(sched, mlo, mhi, offsets, weights)
                if m == 0:
                    xs = ctx.x_routed_MH[mlo - lo : mhi - lo]
                    a, b = r.grid(ctx.a_MI[mlo - lo : mhi - lo]), r.grid(ctx.b_MI[mlo - lo : mhi - lo])
                else:  # replay: re-pull x and recompute the pre-activations
                    xs = torch.empty(mhi - mlo, H, dtype=BF16, device=dev)
                    tr.pull(xs, "x_src", table, route_divisor=K, num_workers=nw)
                    a, b = gate_up(r.grid(xs), r.w, r.layout)
                dys = torch.empty(mhi - mlo, H, dtype=BF16, device=dev)
                tr.pull(dys, "dy_src", table, route_divisor=K, num_workers=nw)
                wr = torch.empty(mhi - mlo, dtype=torch.float32, device=dev)
                tr.pull(wr, "w_src", table, route_divisor=1, num_workers=nw)
                xg, dyg, wg = r.grid(xs), r.grid(dys), r.grid(wr)
                rg = row_backward(xg, a, b, dyg, wg, r.w, cfg.swiglu_limit, r.layout)
                tr.push(r.flat(rg.dx, dys).contiguous(), "rows", table, num_workers=nw)
                tr.push(r.flat(rg.d_w, wr).contiguous(), "d_w", table, num_workers=nw)
                accumulate_wgrads(xg, dyg, wg, rg, r.acc(d_gate_up), r.acc(d_down), r.layout)
        dxs, d_shared = shared_backward(
            x_TH, dy_TH, ctx.shared_a_TIs, ctx.shared_b_TIs, shared, cfg.swiglu_limit, wgrad_dtype
        )
        tr.barrier(6)  # every push has landed
        dx = self._combine(tr, dxs, tr.view["rows"][: T * K], None, T, K, H)
        d_router = tr.view["d_w"][: T * K].clone().view(T, K).to(router_weights_TK.dtype)
        self._after_call(tr)
        return Grads(dx, d_router, routed_wgrads(d_gate_up, d_down, wgrad_dtype), d_shared)
