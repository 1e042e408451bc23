"""Workspaces: the per-(group, device, shape) state a layer call runs in.

A workspace fixes what every rank of the expert-parallel group must agree on before any
data moves: the group, the largest token count a rank may bring (`max_tokens`), the hidden
size, top-k, the number of experts and the expert alignment. From these follows the
worst-case capacity of the schedule table (docs/design.md §6), so no call can overflow it and
no token is ever dropped. Backends keep their buffers in `Workspace.state`.
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .config import DEFAULT_NUM_SMS, MAX_TABLE_ROWS, MoKConfig

# The send side sorts routes into E + 2 int32 buckets (src/schedule.cpp: build_send_side).
MAX_EXPERTS = MAX_TABLE_ROWS - 2


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def schedule_capacity(world_size: int, max_tokens: int, topk: int, num_local_experts: int, alignment: int) -> int:
    """Worst-case rows of the schedule table (mok-core's schedule_capacity, include/mok/core/schedule.h)."""
    return align_up(world_size * max_tokens * topk + num_local_experts * (alignment - 1), alignment)


def _check_capacity(world: int, max_tokens: int, topk: int, local: int, align: int) -> int:
    """The table's capacity, or a ValueError naming max_tokens when its int32 rows cannot hold it."""
    capacity = schedule_capacity(world, max_tokens, topk, local, align)
    if capacity <= MAX_TABLE_ROWS:
        return capacity
    # The largest max_tokens whose table fits, for the message.
    fits = (MAX_TABLE_ROWS // align * align - local * (align - 1)) // (world * topk)
    bound = (
        f"max_tokens must be <= {fits} here"
        if fits >= 1
        else "no max_tokens fits: lower num_experts or expert_alignment"
    )
    raise ValueError(
        f"max_tokens ({max_tokens}) is too large: with topk {topk}, {world} rank(s), {local} local expert(s) "
        f"and expert_alignment {align} the schedule table needs {capacity} rows, more than 2^31 - 1 "
        f"(mok-core indexes its rows with int32: kMaxTableRows); {bound}"
    )


def group_rank_and_size(group: Any) -> tuple[int, int]:
    """(rank, size) of an expert-parallel group; None means a single-rank group."""
    if group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: a process group was given but torch.distributed is not initialized")
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to a rank outside it
        raise ValueError(
            "group: this process is not a member of the group (torch.distributed.new_group returns this "
            "placeholder to ranks outside it): call mok only on the group's ranks, with the group they share"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    return rank, dist.get_world_size(group)


def _device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


@dataclass(eq=False)
class Workspace:
    """State shared by the schedule, forward and backward calls of one layer shape.

    Attributes:
        group: the expert-parallel process group (None = one rank).
        rank, world_size: this rank's index in the group and the group size R.
        device: where tensors of this workspace live.
        max_tokens: the most tokens any rank brings to one call (T_r <= max_tokens).
        hidden_size, topk, num_experts: H, K and E (global expert count).
        num_local_experts: El = E / R; rank r owns experts [r*El, (r+1)*El).
        expert_alignment: segment alignment of the schedule table, in rows.
        capacity: rows of the schedule table: every route of every rank to this rank's
            experts plus the worst-case alignment padding; at most 2^31 - 1 (int32 indices).
        num_sms: multiprocessors of the device (the minibatch heuristic plans waves with it).
        state: per-backend buffers, keyed by backend name.
    """

    group: Any
    rank: int
    world_size: int
    device: torch.device
    max_tokens: int
    hidden_size: int
    topk: int
    num_experts: int
    num_local_experts: int
    expert_alignment: int
    capacity: int
    num_sms: int
    state: dict[str, Any] = field(default_factory=dict)

    def owner_of(self, expert: int) -> int:
        return expert // self.num_local_experts


def _as_device(device: torch.device | str | int) -> torch.device:
    """A device with its index ("cuda" alone means the current GPU)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def create_workspace(
    config: MoKConfig,
    group: Any,
    *,
    device: torch.device | str | int,
    max_tokens: int,
    hidden_size: int,
    topk: int,
    num_experts: int,
) -> Workspace:
    """A new workspace (not cached). See `get_workspace`."""
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(config).__name__}")
    device = _as_device(device)
    _check_positive_int("max_tokens", max_tokens)
    _check_positive_int("hidden_size", hidden_size)
    _check_positive_int("topk", topk)
    _check_positive_int("num_experts", num_experts)
    if topk > num_experts:
        raise ValueError(f"topk ({topk}) must be <= num_experts ({num_experts})")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts must be <= {MAX_EXPERTS} (expert ids are int32 in mok-core), got {num_experts}")
    rank, world = group_rank_and_size(group)
    if num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel group size ({world})")
    if group is not None and world > 1:
        backend = str(dist.get_backend(group)).lower()
        if device.type == "cpu" and "gloo" not in backend:
            raise ValueError(f"group: CPU tensors need a gloo process group, got backend {backend!r}")
        if device.type == "cpu":
            _settle_gloo_at_exit()
        if device.type == "cuda" and "nccl" not in backend:
            raise ValueError(f"group: CUDA tensors need an NCCL process group, got backend {backend!r}")
    local = num_experts // world
    align = config.expert_alignment
    capacity = _check_capacity(world, max_tokens, topk, local, align)
    return Workspace(
        group=group,
        rank=rank,
        world_size=world,
        device=device,
        max_tokens=max_tokens,
        hidden_size=hidden_size,
        topk=topk,
        num_experts=num_experts,
        num_local_experts=local,
        expert_alignment=align,
        capacity=capacity,
        num_sms=_device_num_sms(device),
    )


_GLOO_EXIT_HOOK = False


def _settle_gloo_at_exit() -> None:
    """Lets gloo's worker threads drop their last Python references before the interpreter ends.

    A gloo collective issued inside backward carries the autograd engine's thread-local Python
    context; gloo's worker thread releases it after the collective completes, which needs the
    GIL. If the main thread reaches interpreter finalisation first, that thread is killed inside
    a noexcept destructor and the process aborts ("terminate called without an active
    exception"). mok issues such collectives, so it gives those threads a moment at exit.
    """
    global _GLOO_EXIT_HOOK
    if not _GLOO_EXIT_HOOK:
        _GLOO_EXIT_HOOK = True
        atexit.register(time.sleep, 0.05)


_CACHE: dict[tuple, Workspace] = {}
_CACHE_LOCK = threading.Lock()
_CACHE_GENERATION = [0]  # clear_workspace_cache's count: a workspace remembered before it is not used


def cache_generation() -> int:
    """How often the workspace cache was cleared: what a remembered workspace is held against."""
    return _CACHE_GENERATION[0]


def get_workspace(
    config: MoKConfig,
    group: Any,
    *,
    device: torch.device | str | int,
    max_tokens: int,
    hidden_size: int,
    topk: int,
    num_experts: int,
) -> Workspace:
    """The cached workspace for (group, device, max_tokens, H, K, E, expert alignment).

    Every rank of `group` must call this with the same arguments. `group=None` means one
    rank (no expert parallelism). A ValueError names max_tokens when the schedule table of
    these sizes would pass 2^31 - 1 rows, before anything is allocated.
    """
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(config).__name__}")
    dev = _as_device(device)
    key = (id(group), dev, max_tokens, hidden_size, topk, num_experts, config.expert_alignment)
    with _CACHE_LOCK:
        ws = _CACHE.get(key)
        if ws is None or ws.group is not group:
            ws = create_workspace(
                config,
                group,
                device=dev,
                max_tokens=max_tokens,
                hidden_size=hidden_size,
                topk=topk,
                num_experts=num_experts,
            )
            _CACHE[key] = ws
    return ws


def cached_workspaces() -> list[Workspace]:
    """The workspaces `get_workspace` holds (those mok.moe and MoELayer calls use)."""
    with _CACHE_LOCK:
        return list(_CACHE.values())


def clear_workspace_cache() -> None:
    """Drop every cached workspace (and the buffers backends keep in them)."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _CACHE_GENERATION[0] += 1
