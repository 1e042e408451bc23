"""The transport buffers of the native backends: one segment per rank, mapped by every peer.

Each rank owns one segment (POSIX shared memory on the CPU, symmetric memory on the GPU)
that its peers read (pulls) and write (pushes) directly:

    routes      int32 [Tmax, K]   this rank's routes, read by every expert rank's schedule
    tokens      int64 [1]         this rank's token count
    x_src       bf16  [Tmax, H]   forward x (and backward x for replay), pulled by expert ranks
    dy_src      bf16  [Tmax, H]   backward dy, pulled by expert ranks
    w_src       fp32  [Tmax*K]    backward router weights, pulled per route
    rows        bf16  [Tmax*K, H] pushed expert outputs (forward) / dx rows (backward), one per route
    d_w         fp32  [Tmax*K]    pushed router-weight gradients, one per route
    route_row   int32 [Tmax*K]    each route's row in its expert rank's table, written by that
                                  rank's table build (mok_core.build_table)
    pad         uint64 [R]        barrier slots: slot s holds the last epoch rank s announced

The direction of each transfer is a setting (MoKConfig.dispatch / .combine). The defaults
need only the segment above: expert ranks pull x, dy and w from the sources and push their
outputs back. The other directions use a second segment per direction, made by the first
call that needs it (a collective, like the first):

    dispatch="push"  x_recv  bf16 [C, H], dy_recv bf16 [C, H], w_recv fp32 [C]: the sources
                     write each route's row into the expert rank's table rows
    combine="pull"   y_send  bf16 [C, H], dw_send fp32 [C]: the expert ranks leave their
                     output rows in table order, the sources read their routes' rows

Every call writes its own inputs, crosses a barrier, moves rows, and crosses a barrier
again before it reads what peers pushed to it (or lets peers read what it left); so a
buffer is never rewritten while a peer may still read it, and the barriers are the only
synchronisation.
"""

from __future__ import annotations

import ctypes
import functools
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...workspace import Workspace

_ALIGN = 256
# Barrier stages, named in timeout errors.
OUT_OF_STEP = 2  # the error code of a barrier that met a peer elsewhere (mok-core's kErrorOutOfStep)
BAD_EXPERT = 3  # the schedule table met an expert id outside [0, E) (mok-core's kErrorBadExpert)
STAGES = {
    1: "schedule: routes written",
    2: "schedule: routes read",
    3: "forward: inputs written",
    4: "forward: outputs pushed",
    5: "backward: inputs written",
    6: "backward: gradients pushed",
    7: "recompute: inputs written",
    8: "recompute: rows pulled",
    9: "forward megakernel: a down tile waiting for its rows' gate/up tiles (this GPU)",
}


@dataclass(frozen=True)
class Field:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


def layout(ws: Workspace) -> tuple[dict[str, Field], int]:
    Tmax, K, H, R = ws.max_tokens, ws.topk, ws.hidden_size, ws.world_size
    specs = [
        ("routes", torch.int32, (Tmax, K)),
        ("tokens", torch.int64, (1,)),
        ("x_src", torch.bfloat16, (Tmax, H)),
        ("dy_src", torch.bfloat16, (Tmax, H)),
        ("w_src", torch.float32, (Tmax * K,)),
        ("rows", torch.bfloat16, (Tmax * K, H)),
        ("d_w", torch.float32, (Tmax * K,)),
        ("route_row", torch.int32, (Tmax * K,)),
        ("pad", torch.int64, (R,)),  # uint64 slots (torch has no uint64 arithmetic we need)
    ]
    return _fields(specs)


# The segments of the non-default directions (MoKConfig.dispatch="push", .combine="pull").
def exchange_layout(ws: Workspace, direction: str) -> tuple[dict[str, Field], int]:
    C, H = ws.capacity, ws.hidden_size
    if direction == "dispatch":
        specs = [
            ("x_recv", torch.bfloat16, (C, H)),
            ("dy_recv", torch.bfloat16, (C, H)),
            ("w_recv", torch.float32, (C,)),
        ]
    else:
        specs = [("y_send", torch.bfloat16, (C, H)), ("dw_send", torch.float32, (C,))]
    return _fields(specs)


def _fields(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, Field], int]:
    fields, offset = {}, 0
    for name, dtype, shape in specs:
        f = Field(offset, dtype, shape)
        fields[name] = f
        offset += -(-f.nbytes // _ALIGN) * _ALIGN
    return fields, offset


class Transport:
    """This rank's segment, typed views of it, and per-field arrays of every rank's pointers."""

    def __init__(self, ws: Workspace, timeout_s: float) -> None:
        import mok_core

        if ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "mok: the first call on a workspace makes its buffers (and the error words' pinned "
                "host mirror), which cannot be inside a CUDA graph capture: run one call before capturing"
            )
        self.core = mok_core
        self.ws = ws
        self.device = ws.device
        self.dev = ws.device.type
        self.timeout_ns = int(timeout_s * 1e9)
        self.fields, self.nbytes = layout(ws)
        self._segments: list[Any] = []  # keep shared memory mappings alive
        self.view: dict[str, torch.Tensor] = {}
        self.ptrs: dict[str, torch.Tensor] = {}
        self.field_of = dict(self.fields)  # every segment's fields, by name
        self._add_segment(self.fields, self.nbytes)
        self.directions: set[str] = set()  # exchange segments made so far
        self.epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
        # The stream of the call in progress (begin_call), 0 on the CPU
        self.stream = 0
        self.error = torch.zeros(4, dtype=torch.int32, device=self.device)
        self.error_ptr = self.error.data_ptr()
        # On the GPU the error words as the host sees them (mok_core.ErrorMirror): each call's last
        # step copies the words there behind its work, and the next call reads them with no copy
        # or event of its own (docs/core-runtime.md); its device address for the kernels that
        # publish (the combine of the one-call lanes). Made here: never inside a capture.
        self.mirror = self.core.ErrorMirror("cuda") if self.dev == "cuda" else None
        self.mirror_address = 0 if self.mirror is None else self.mirror.device_address
        # The layer calls made on this transport (schedule, forward, backward, recompute): every
        # barrier's tag carries it beside the stage, so ranks out of step are found at the next
        # barrier (the barrier in mok-core/include/mok/core/transport.h).
        self.calls = 0
        # At one rank, every route's rank (0) for scatter_local: made here, not inside a capture.
        one = ws.world_size == 1
        self.rank_zero = torch.zeros(ws.max_tokens * ws.topk, dtype=torch.int32, device=self.device) if one else None

    def _add_segment(self, fields: dict[str, Field], nbytes: int) -> None:
        """Allocate one segment of `fields` on every rank (collective): typed views, pointer arrays."""
        base, bases = self._allocate(nbytes)
        for name, f in fields.items():
            self.view[name] = base[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape)
        ptr_device = self.device if self.dev == "cuda" else torch.device("cpu")
        for name, f in fields.items():
            self.ptrs[name] = torch.tensor([b + f.offset for b in bases], dtype=torch.int64, device=ptr_device)

    def ensure(self, direction: str) -> None:
        """The segment of `direction` ("dispatch": push dispatch, "combine": pull combine), made
        on first use. Collective: every rank asks at the same call (they share the config)."""
        if direction in self.directions:
            return
        if self.dev == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mok: the {direction} buffers of MoKConfig.{direction}="
                f"{'push' if direction == 'dispatch' else 'pull'} are made by the first call that uses them, "
                "which cannot be inside a CUDA graph capture: run one call before capturing"
            )
        fields, nbytes = exchange_layout(self.ws, direction)
        self._add_segment(fields, nbytes)
        self.field_of.update(fields)
        self.directions.add(direction)

    def _allocate(self, nbytes: int) -> tuple[torch.Tensor, list[int]]:
        ws = self.ws
        if ws.world_size == 1:
            base = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            return base, [base.data_ptr()]
        if self.dev == "cuda":
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(ws.group.group_name)
            base = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
            # symm_mem's rendezvous takes no timeout: meet first with a wait bounded by timeout_s,
            # so that a missing rank is an error here and the rendezvous only follows a meeting
            # every rank has reached.
            present = torch.ones(1, dtype=torch.int32, device=self.device)
            self._wait(lambda: dist.all_reduce(present, group=ws.group, async_op=True))
            handle = symm_mem.rendezvous(base, ws.group)
            base.zero_()
            self._segments.append(handle)
            # buffer_ptrs are allocation bases; a pooled tensor may start inside its allocation
            shift = base.data_ptr() - int(handle.buffer_ptrs[ws.rank])
            return base, [int(p) + shift for p in handle.buffer_ptrs]
        # CPU: POSIX shared memory. Rank 0 draws a random tag that names every rank's segment
        # (a tensor broadcast: object collectives would need numpy).
        tag = torch.tensor([uuid.uuid4().int & ((1 << 62) - 1)], dtype=torch.int64)
        self._wait(lambda: dist.broadcast(tag, src=dist.get_global_rank(ws.group, 0), group=ws.group, async_op=True))
        names = [f"/mok-{int(tag):016x}-{r}" for r in range(ws.world_size)]
        own = self.core.ShmSegment(names[ws.rank], nbytes, True)
        try:
            self._wait(lambda: dist.barrier(group=ws.group, async_op=True))  # every segment exists
            segments = [own if r == ws.rank else self.core.ShmSegment(n, nbytes, False) for r, n in enumerate(names)]
            self._wait(lambda: dist.barrier(group=ws.group, async_op=True))  # every rank mapped every segment
        finally:
            own.unlink()  # the names can go (and on a failure no segment is left behind)
        self._segments.extend(segments)
        buf = (ctypes.c_uint8 * nbytes).from_address(own.address)
        self._segments.append(buf)
        return torch.frombuffer(buf, dtype=torch.uint8), [s.address for s in segments]

    def _wait(self, issue: Any) -> None:
        """A collective of the shared-memory set-up, its wait bounded by timeout_s."""
        from ...agreement import bounded

        bounded(issue, "setting up the shared memory across the group", self.timeout_ns / 1e9, self.ws)

    def begin_call(self) -> None:
        """Note the current stream: every launch of the call that follows goes there."""
        self.stream = current_stream_handle(self.device) if self.dev == "cuda" else 0

    def _stream(self) -> int:
        return self.stream

    def publish_error(self) -> None:
        """After a GPU call's work: a copy of the error words to the host's mirror behind it (one
        16-byte cudaMemcpyAsync; a capture records it). The one-call lanes have their combine
        publish instead (mirror_address)."""
        if self.mirror is not None:
            self.mirror.publish(self.error_ptr, self.stream)

    def published_error(self) -> list[int] | None:
        """The error words when a published copy shows an error, else None, never waiting while
        there is none. With one, the device is synchronized first (every call's work and copy done:
        the device's words are read whole, and no copy of an older call lands after a clear); inside
        a CUDA graph capture, where no synchronize may run, None (the next call outside raises it)."""
        if self.mirror is None or self.mirror.read()[0] == 0 or torch.cuda.is_current_stream_capturing():
            return None
        torch.cuda.synchronize(self.device)
        return self.error.tolist()  # type: ignore[no-any-return]

    def raise_error(self, words: list[int]) -> None:
        """raise_transport_error on words read from `error`. A bad expert id at R = 1 clears the
        words first: no peer can be out of step, so the workspace serves on."""
        if words[0] == BAD_EXPERT and self.ws.world_size == 1:
            self.error.zero_()
            if self.mirror is not None:  # (the caller synchronized: no copy is in flight)
                self.mirror.clear()
        raise_transport_error(words, self.timeout_ns, self.ws)

    def barrier(self, stage: int) -> None:
        """Meet the group at `stage` (STAGES) of the current call; the tag every rank in step
        announces alike is (the call count mod 2^16, the stage)."""
        if self.ws.world_size == 1:
            return  # no peer to meet: the stream already orders this rank's own work
        ok = self.core.barrier(
            self.dev,
            self.epoch.data_ptr(),
            self.ptrs["pad"].data_ptr(),
            self.ws.rank,
            self.ws.world_size,
            self.error.data_ptr(),
            barrier_tag(self.calls, stage),
            self.timeout_ns,
            self._stream(),
        )
        if self.dev == "cpu" and not ok:
            self.raise_error(self.error.tolist())

    def pull(
        self,
        dst: torch.Tensor,
        field: str,
        sched_rows: tuple[torch.Tensor, torch.Tensor],
        route_divisor: int,
        num_workers: int,
    ) -> None:
        """dst[i] = row of table row i from its source's `field` (zero for padding rows)."""
        src_rank, route = sched_rows
        f = self.field_of[field]
        row_bytes = _row_stride(dst)
        src_stride = _field_stride(f)
        self.core.pull_rows(
            self.dev,
            dst.data_ptr(),
            self.ptrs[field].data_ptr(),
            src_rank.data_ptr(),
            route.data_ptr(),
            src_rank.shape[0],
            route_divisor,
            row_bytes,
            src_stride,
            row_bytes,
            num_workers,
            self._stream(),
        )

    def push(
        self,
        src: torch.Tensor,
        field: str,
        sched_rows: tuple[torch.Tensor, torch.Tensor],
        num_workers: int,
        src_divisor: int = 1,
    ) -> None:
        """Row i // src_divisor of src to rank sched_rows[0][i]'s `field`, at row sched_rows[1][i]
        (i with rank -1 skipped): table rows back to their routes (src_divisor 1), or token rows
        to their routes' table rows (src_divisor K, the push dispatch). src's rows may be
        narrower than the field's (MXFP8 rows in bf16-sized slots)."""
        dst_rank, dst_row = sched_rows
        row_bytes = src.shape[1] * src.element_size() if src.dim() > 1 else src.element_size()
        self.core.push_rows(
            self.dev, src.data_ptr(), self.ptrs[field].data_ptr(), dst_rank.data_ptr(), dst_row.data_ptr(),
            dst_rank.shape[0], row_bytes, _row_stride(src), _field_stride(self.field_of[field]), num_workers,
            self._stream(), src_divisor,
        )  # fmt: skip

    def zero_padding(self, field: str, row_src_rank: torch.Tensor, num_workers: int) -> None:
        """Zero the padding rows of this rank's table-ordered `field`, rows the sources pushed leave
        them as they were."""
        t = self.view[field]
        row_bytes = _row_stride(t)
        self.core.zero_rows(
            self.dev, t.data_ptr(), row_src_rank.data_ptr(), row_src_rank.shape[0], row_bytes, row_bytes,
            num_workers, self._stream(),
        )  # fmt: skip

    def scatter_local(
        self, src_TH: torch.Tensor, dst: torch.Tensor, route_row: int, row_src_rank: int, topk: int, num_workers: int
    ) -> torch.Tensor:
        """One rank: table rows `dst` [n, H] <- each route's token row of src_TH (route t * K + k
        to table row route_row[t * K + k]; a route of row -1, which no segment lists, skipped),
        padding rows (row_src_rank < 0) zeroed: what a pull of the token rows into table order
        gives, with each token row read once for its K routes (a pull reads it once per route,
        from HBM at the large shapes: a token's routes lie in K experts' segments, far apart in
        the table). route_row and row_src_rank: the addresses of the schedule's int32 arrays of
        those names (route_row_TK, its first T * K read; row_src_rank_C, its first n), so that the
        experts may be issued before the table's tensors are made. Every route's row must lie in
        dst's rows. It reads no route ranks (at one rank every route's is 0): the schedule's send
        side may still be on its way."""
        assert self.rank_zero is not None, "scatter_local is a one-rank move"
        stream, dst_stride = self._stream(), _row_stride(dst)
        self.core.push_rows(
            self.dev, src_TH.data_ptr(), 0, self.rank_zero.data_ptr(), route_row, src_TH.shape[0] * topk,
            src_TH.shape[1] * src_TH.element_size(), _row_stride(src_TH), dst_stride, num_workers, stream, topk,
            dst_local=dst.data_ptr(),
        )  # fmt: skip
        self.core.zero_rows(self.dev, dst.data_ptr(), row_src_rank, dst.shape[0], dst_stride, dst_stride, num_workers,
                            stream)  # fmt: skip
        return dst


def _field_stride(f: Field) -> int:
    """Bytes from one row of a transport field to the next (its element size for a 1-D field)."""
    return (f.nbytes // f.shape[0]) if len(f.shape) > 1 else torch.empty(0, dtype=f.dtype).element_size()


def _row_stride(t: torch.Tensor) -> int:
    """Bytes from one row of `t` to the next (its element size for a 1-D tensor)."""
    return t.stride(0) * t.element_size() if t.dim() > 1 else t.element_size()


def current_stream_handle(device: torch.device) -> int:
    """The cudaStream_t of `device`'s current stream, as an int (torch's raw accessor where it has
    one: a few hundred ns against several us for torch.cuda.current_stream)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and device.index is not None:
        return int(raw(device.index))
    return int(torch.cuda.current_stream(device).cuda_stream)


@functools.cache
def core_entry_points() -> Any:
    """mok-core's table build and combine as plain function pointers (a PyCapsule, made once), for
    mok-bf16's calls that issue them with their own kernels in one crossing from Python
    (moe_forward_call, moe_backward_call; docs/core-runtime.md "Entry points for other
    extensions")."""
    import mok_core

    return mok_core.entry_points()


def barrier_tag(call: int, stage: int) -> int:
    """The 24-bit tag of a barrier: the stage (< 256) in the low byte, the call count above."""
    return (call & 0xFFFF) << 8 | (stage & 0xFF)


def bad_expert_error(error: list[int], ws: Workspace) -> ValueError:
    """The ValueError of error words with code BAD_EXPERT: the first route of the group (source
    rank, then t, k) whose expert id lay outside [0, E) (mok-core's schedule.h, bad_expert_word)."""
    _, _, low, high = error
    flat = 0x7FFFFFFF - (high & 0xFFFFFFFF)
    per_rank = ws.max_tokens * ws.topk
    source, route = divmod(flat, per_rank)
    t, k = divmod(route, ws.topk)
    low &= 0xFFFFFFFF
    value = low - (1 << 32) if low & 0x80000000 else low  # the word's low half, as int32
    whose = f" of rank {source}" if ws.world_size > 1 else ""
    # (where an int64 id past int32 is read: schedule.h, RouteSource)
    shown = f"{value} (or an int64 id beyond int32)" if value in (2**31 - 1, -(2**31)) else str(value)
    return ValueError(
        f"top_experts{whose} holds expert id {shown} at position [{t}, {k}], outside [0, {ws.num_experts}) "
        f"(E = {ws.num_experts}); found on the GPU by the schedule kernel, which left the route out of "
        "that call (its result is not to be used; mok.check_errors() right after a call raises this at once)"
    )


def raise_transport_error(error: list[int], timeout_ns: int, ws: Workspace | None = None) -> None:
    """Raise the error the error words record, if any. A failed wait leaves `ws` refused from now
    on (its group is out of step: agreement.check_usable); so does a bad expert id at R > 1 (a rank
    may already be a call ahead), while at R = 1 the caller clears the words and `ws` serves on."""
    code, peer, tag, rank = error
    if code == 0:
        return
    if code == BAD_EXPERT and ws is not None:
        exc = bad_expert_error(error, ws)
        if ws.world_size > 1:
            ws.state["broken"] = str(exc)
        raise exc
    stage, call = tag & 0xFF, tag >> 8
    where = f"stage '{STAGES.get(stage, stage)}'" + (f" of call {call}" if call else "")
    if code == OUT_OF_STEP:
        what = (
            f"rank {rank} met rank {peer} at another barrier at {where}: the ranks are out of step "
            "(a call, or a stage of one, that one rank made and another did not)"
        )
    else:
        what = f"rank {rank} waited more than {timeout_ns / 1e9:g} s for rank {peer} at {where}"
    if ws is not None:
        ws.state["broken"] = what
    raise RuntimeError(f"mok: {what} (MoKConfig.timeout_s); the expert-parallel group is out of step")
