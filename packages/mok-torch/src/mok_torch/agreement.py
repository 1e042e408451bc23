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


def _exchange(ws: Workspace, local: list[int], what: str, timeout_s: float) -> list[list[int]]:
    """Every rank's `local` (the same length on each), in rank order: one all-gather whose wait
    (the host's, for gloo and NCCL alike: a wait with a timeout blocks until it completes) is
    bounded by `timeout_s`."""
    on = ws.device if str(dist.get_backend(ws.group)).lower().startswith("nccl") else torch.device("cpu")
    mine = torch.tensor(local, dtype=torch.int64, device=on)
    gathered = [torch.empty_like(mine) for _ in range(ws.world_size)]
    try:
        work = dist.all_gather(gathered, mine, group=ws.group, async_op=True)
        assert work is not None
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        ws.state["broken"] = f"the {what} check across the group did not complete"
        raise TimeoutError(
            f"mok: not every rank of the expert-parallel group checked its {what} settings within timeout_s "
            f"({timeout_s} s): a rank is missing or out of step (a call the others did not make), or the ranks "
            f"passed different process groups ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    return [g.tolist() for g in gathered]


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
