"""What the ranks of an expert-parallel group must agree on, checked across the group.

A layer call at EP > 1 is a protocol: every rank sizes its buffers, tables and messages from the
workspace (max_tokens, H, K, E, the alignment), the config (precision, the transfer directions,
the batching) and the weights' shapes. Ranks that disagree would not fail by themselves: they
would read rows of the wrong size, route tokens to experts nobody owns, or wait at barriers the
others never reach. So before the first call with a given set of settings, every rank sends what
it holds to every other rank and compares: a difference raises a `ValueError` on every rank
naming each setting and each rank's value.

The check runs once per workspace and distinct set of values (`Workspace.state["agreed"]`): a
collective and a host read each time, so it is not on the hot path. Its wait is bounded by the
config's `timeout_s`; a rank that does not take part within it (it is missing, out of step, or
holds another process group over the same ranks) leaves the others with a `TimeoutError`, and
the workspace refuses further calls (`Workspace.state["broken"]`): after a collective that did
not complete, the process group itself is out of step.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .workspace import Workspace

# Per setting: a CRC-32 of its repr, then its first 24 bytes (what a message shows).
_WORDS = 4
_SHOWN = 8 * (_WORDS - 1)


def _encode(value: object) -> list[int]:
    text = repr(value).encode()
    shown = text[:_SHOWN].ljust(_SHOWN, b"\0")
    words = [int.from_bytes(shown[i : i + 8], "little", signed=True) for i in range(0, _SHOWN, 8)]
    return [zlib.crc32(text), *words]


def _shown(words: list[int]) -> str:
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[1:]).rstrip(b"\0")
    text = raw.decode(errors="replace")
    return text + ("..." if len(raw) == _SHOWN else "")


def check_usable(ws: Workspace) -> None:
    """Raise if an earlier agreement check or wait across the group left `ws` unusable."""
    broken = ws.state.get("broken")
    if broken is not None:
        raise RuntimeError(
            f"mok: this workspace is unusable after an earlier error ({broken}); the process group may be "
            "out of step: re-create the process group and the workspace (mok.clear_workspace_cache())"
        )


def agree(ws: Workspace, what: str, settings: dict[str, object], timeout_s: float) -> None:
    """Raise `ValueError` on every rank of `ws.group` unless all ranks hold the same `settings`.

    `what` names the kind of settings in the message ("workspace", "config", "weights").
    Collective the first time a rank sees a given (what, settings) on `ws`; free after that.
    """
    check_usable(ws)
    if ws.world_size == 1:
        return
    key = (what, tuple((name, repr(value)) for name, value in settings.items()))
    agreed: set[Any] = ws.state.setdefault("agreed", set())
    if key in agreed:
        return
    if ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"mok: the {what} settings of this call are new to the group and must be checked across it, which "
            "cannot happen inside a CUDA graph capture: make one eager call with them before capturing"
        )
    names = list(settings)
    local = [zlib.crc32("\0".join(names).encode()), len(names)]
    for name in names:
        local += _encode(settings[name])
    rows = _exchange(ws, local, what, timeout_s)
    if any(r[:2] != rows[ws.rank][:2] for r in rows):
        raise ValueError(
            f"mok: the ranks of the expert-parallel group run different versions of mok (their {what} settings "
            "are not the same list); every rank must run the same mok"
        )
    differences = []
    for i, name in enumerate(names):
        at = 2 + _WORDS * i
        values = [r[at : at + _WORDS] for r in rows]
        if any(v != values[0] for v in values):
            each = ", ".join(f"rank {r} has {_shown(v)}" for r, v in enumerate(values))
            differences.append(f"{name}: {each}")
    if differences:
        raise ValueError(
            f"mok: the ranks of the expert-parallel group disagree on their {what} settings (every rank raises "
            "this): " + "; ".join(differences)
        )
    agreed.add(key)


def agree_call(ws: Workspace, cfg: Any, backend: str, inner: tuple[int, int | None] | None = None) -> None:
    """`agree` on what a layer call depends on: the workspace and the config (with the backend
    they resolve to) and, given `inner` (I, Is or None), the weights' intermediate sizes. At one
    rank only the workspace's usability is checked; at R > 1 a set of values agreed before costs
    one lookup (the settings are not rebuilt)."""
    check_usable(ws)
    if ws.world_size == 1:
        return
    key = (cfg.key, backend, inner)
    seen: set[Any] = ws.state.setdefault("agreed calls", set())
    if key in seen:
        return
    if inner is None:
        agree(ws, "workspace", workspace_settings(ws), cfg.timeout_s)
        agree(ws, "config", config_settings(cfg, backend), cfg.timeout_s)
    else:
        weights: dict[str, object] = {"intermediate size I": inner[0], "shared intermediate size Is": inner[1] or 0}
        agree(ws, "weights", weights, cfg.timeout_s)
    seen.add(key)


def bounded(issue: Callable[[], Any], what: str, timeout_s: float, ws: Workspace | None = None) -> None:
    """Run a collective mok starts (`issue` makes it with async_op=True and returns its work)
    and wait for it at most `timeout_s` (the host's wait, for gloo and NCCL alike: a wait with a
    timeout blocks until the work completes). Past that: a `TimeoutError` naming `what`, and `ws`
    refused from then on (its group is out of step)."""
    try:
        work = issue()
        assert work is not None
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        if ws is not None:
            ws.state["broken"] = f"{what} did not complete"
        raise TimeoutError(
            f"mok: {what} did not complete within timeout_s ({timeout_s:g} s): a rank is missing or out of step "
            f"(a call the others did not make), or the ranks passed different process groups "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc


def _exchange(ws: Workspace, local: list[int], what: str, timeout_s: float) -> list[list[int]]:
    """Every rank's `local` (the same length on each), in rank order: one all-gather, bounded."""
    on = ws.device if str(dist.get_backend(ws.group)).lower().startswith("nccl") else torch.device("cpu")
    mine = torch.tensor(local, dtype=torch.int64, device=on)
    gathered = [torch.empty_like(mine) for _ in range(ws.world_size)]
    issue = lambda: dist.all_gather(gathered, mine, group=ws.group, async_op=True)  # noqa: E731
    bounded(issue, f"the {what} check across the group", timeout_s, ws)
    return [g.tolist() for g in gathered]


# The calls a rank makes on a workspace, each a step of the group's sequence.
CALLS = ("schedule", "forward", "backward", "recompute")


def step_in(ws: Workspace, call: str, timeout_s: float) -> None:
    """Count a call on `ws` and, at EP > 1 on the reference backend (whose collectives carry no
    identity of their own), check that every rank is at the same call of the same kind: a rank
    that made a call the others did not is found here, on every rank, before its rows move.
    (The native backends check the same at every barrier, in mok-core.)"""
    check_usable(ws)
    ws.state["timeout_s"] = timeout_s  # what the backend's own collectives wait at most
    count = ws.state["calls"] = ws.state.get("calls", 0) + 1
    if ws.world_size == 1 or (ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return
    rows = _exchange(ws, [count, CALLS.index(call)], "the call sequence", timeout_s)
    if any(r != rows[ws.rank] for r in rows):
        each = ", ".join(f"rank {r} at call {n} ({CALLS[k]})" for r, (n, k) in enumerate(rows))
        ws.state["broken"] = "the ranks were out of step"
        raise RuntimeError(
            f"mok: the ranks of the expert-parallel group are out of step: {each} (a call, or its backward, "
            "that one rank made and another did not); every rank raises this"
        )


def workspace_settings(ws: Workspace) -> dict[str, object]:
    """What every rank's workspace must hold alike (the group's members included)."""
    members = dist.get_process_group_ranks(ws.group) if ws.group is not None else [0]
    return {
        "group members": members,
        "world_size": ws.world_size,
        "device type": ws.device.type,
        "max_tokens": ws.max_tokens,
        "hidden_size": ws.hidden_size,
        "topk": ws.topk,
        "num_experts": ws.num_experts,
        "expert_alignment": ws.expert_alignment,
    }


def config_settings(cfg: Any, backend: str) -> dict[str, object]:
    """What every rank's config must hold alike: everything that shapes the protocol (not
    timeout_s, which each rank may set for itself)."""
    return {
        "backend": backend,
        "precision": cfg.precision,
        "dispatch": cfg.dispatch,
        "combine": cfg.combine,
        "minibatch_size": cfg.minibatch_size,
        "macrobatch_size": cfg.macrobatch_size,
        "swiglu_limit": cfg.swiglu_limit,
        "megakernel": cfg.megakernel,
        "fwd_num_comm_sms": cfg.fwd_num_comm_sms,
        "bwd_num_comm_sms": cfg.bwd_num_comm_sms,
    }
