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
    pad         uint64 [R]        barrier slots: slot s holds the last epoch rank s announced

Every call writes its own inputs, crosses a barrier, moves rows, and crosses a barrier
again before it reads what peers pushed to it; so a buffer is never rewritten while a peer
may still read it, and the barriers are the only synchronisation.
"""

from __future__ import annotations

import ctypes
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...workspace import Workspace

_ALIGN = 256
# Barrier stages, named in timeout errors.
STAGES = {
    1: "schedule: routes written",
    2: "schedule: routes read",
    3: "forward: inputs written",
    4: "forward: outputs pushed",
    5: "backward: inputs written",
    6: "backward: gradients pushed",
    7: "recompute: inputs written",
    8: "recompute: rows pulled",
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
        ("pad", torch.int64, (R,)),  # uint64 slots (torch has no uint64 arithmetic we need)
    ]
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

        self.core = mok_core
        self.ws = ws
        self.device = ws.device
        self.dev = ws.device.type
        self.timeout_ns = int(timeout_s * 1e9)
        self.fields, self.nbytes = layout(ws)
        self._segments: list[Any] = []  # keep shared memory mappings alive
        base, bases = self._allocate()
        self.view = {
            name: base[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for name, f in self.fields.items()
        }
        ptr_device = self.device if self.dev == "cuda" else torch.device("cpu")
        self.ptrs = {
            name: torch.tensor([b + f.offset for b in bases], dtype=torch.int64, device=ptr_device)
            for name, f in self.fields.items()
        }
        self.epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
        # (host copy of the error flag, event) of the last GPU call, read by the next one
        self.pending: tuple[torch.Tensor, Any] | None = None
        self.error = torch.zeros(4, dtype=torch.int32, device=self.device)

    def _allocate(self) -> tuple[torch.Tensor, list[int]]:
        ws = self.ws
        if ws.world_size == 1:
            base = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
            return base, [base.data_ptr()]
        if self.dev == "cuda":
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(ws.group.group_name)
            base = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(base, ws.group)
            base.zero_()
            self._segments.append(handle)
            # buffer_ptrs are allocation bases; a pooled tensor may start inside its allocation
            shift = base.data_ptr() - int(handle.buffer_ptrs[ws.rank])
            return base, [int(p) + shift for p in handle.buffer_ptrs]
        # CPU: POSIX shared memory. Rank 0 draws a random tag that names every rank's segment
        # (a tensor broadcast: object collectives would need numpy).
        tag = torch.tensor([uuid.uuid4().int & ((1 << 62) - 1)], dtype=torch.int64)
        dist.broadcast(tag, src=dist.get_global_rank(ws.group, 0), group=ws.group)
        names = [f"/mok-{int(tag):016x}-{r}" for r in range(ws.world_size)]
        own = self.core.ShmSegment(names[ws.rank], self.nbytes, True)
        dist.barrier(group=ws.group)  # every segment exists
        segments = [own if r == ws.rank else self.core.ShmSegment(n, self.nbytes, False) for r, n in enumerate(names)]
        dist.barrier(group=ws.group)  # every rank has mapped every segment: the names can go
        own.unlink()
        self._segments.extend(segments)
        buf = (ctypes.c_uint8 * self.nbytes).from_address(own.address)
        self._segments.append(buf)
        return torch.frombuffer(buf, dtype=torch.uint8), [s.address for s in segments]

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.dev == "cuda" else 0

    def barrier(self, stage: int) -> None:
        ok = self.core.barrier(
            self.dev,
            self.epoch.data_ptr(),
            self.ptrs["pad"].data_ptr(),
            self.ws.rank,
            self.ws.world_size,
            self.error.data_ptr(),
            stage,
            self.timeout_ns,
            self._stream(),
        )
        if self.dev == "cpu" and not ok:
            raise_transport_error(self.error.tolist(), self.timeout_ns)

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
        f = self.fields[field]
        row_bytes = dst.stride(0) * dst.element_size() if dst.dim() > 1 else dst.element_size()
        src_stride = (f.nbytes // f.shape[0]) if len(f.shape) > 1 else torch.empty(0, dtype=f.dtype).element_size()
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
        self, src: torch.Tensor, field: str, sched_rows: tuple[torch.Tensor, torch.Tensor], num_workers: int
    ) -> None:
        """Row i of src to its source's `field`, at its route's slot (padding rows skipped)."""
        src_rank, route = sched_rows
        row_bytes = src.stride(0) * src.element_size() if src.dim() > 1 else src.element_size()
        self.core.push_rows(
            self.dev,
            src.data_ptr(),
            self.ptrs[field].data_ptr(),
            src_rank.data_ptr(),
            route.data_ptr(),
            src_rank.shape[0],
            row_bytes,
            row_bytes,
            row_bytes,
            num_workers,
            self._stream(),
        )


def raise_transport_error(error: list[int], timeout_ns: int) -> None:
    code, peer, stage, rank = error
    if code == 0:
        return
    raise RuntimeError(
        f"mok: rank {rank} waited more than {timeout_ns / 1e9:g} s for rank {peer} at stage "
        f"'{STAGES.get(stage, stage)}' (MoKConfig.timeout_s); the expert-parallel group is out of step"
    )
