"""Argument checks of the public API.

Every call checks its tensors before any backend sees them and raises TypeError (wrong type
or dtype) or ValueError (wrong shape, device, layout or value) with a message that names the
argument, so bad input can never reach a kernel. A call whose arguments have the metadata of one
that passed (call_signature) skips the checks that read only metadata, which would pass again
(CheckedCalls; mok.moe and the functional API keep them): its host time before the first launch
is time the device waits in a call from an idle device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def describe(obj: object) -> str:
    """What an argument is, for an error message: "tuple of length 2" for a sequence, else its type."""
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__} of length {len(obj)}"
    return type(obj).__name__


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype],
    shape: Sequence[tuple[str, int | None]],
    device: torch.device | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Check type, dtype, shape (named dims; None = any size), device and contiguity."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(shape):
        letters = ", ".join(letter for letter, _ in shape)
        raise ValueError(f"{name} must have shape [{letters}] ({len(shape)} dims), got {list(t.shape)}")
    sizes = t.shape
    for axis, (letter, size) in enumerate(shape):
        if size is not None and sizes[axis] != size:
            letters = ", ".join(letter for letter, _ in shape)
            want = ", ".join(str(s) if s is not None else letter for letter, s in shape)
            raise ValueError(f"{name} must have shape [{letters}] = [{want}], got {list(sizes)} ({letter} differs)")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")
    return t


def check_expert_ids(name: str, top_experts: torch.Tensor, num_experts: int) -> None:
    """Every id in [0, num_experts). Reads one flag on the host."""
    if top_experts.numel() == 0:
        return
    # One reduction and one read on the host (the slow path below runs only for a bad id).
    lo, hi = torch.aminmax(top_experts)
    low, high = torch.stack([lo, hi]).tolist()
    if low < 0 or high >= num_experts:
        bad = (top_experts < 0) | (top_experts >= num_experts)
        where = bad.nonzero()[0].tolist()
        value = int(top_experts[tuple(where)])
        raise ValueError(
            f"{name} holds expert id {value} at position {where}, outside [0, {num_experts}) (E = {num_experts})"
        )


def check_weights(
    name: str,
    weights: object,
    shapes: Sequence[Sequence[tuple[str, int | None]]],
    *,
    dtypes: Sequence[torch.dtype],
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """A tuple of weight tensors of the given named shapes."""
    if not isinstance(weights, (tuple, list)) or len(weights) != len(shapes):
        raise TypeError(f"{name} must be a tuple of {len(shapes)} tensors (gate, up, down), got {describe(weights)}")
    parts = ("gate", "up", "down")
    return tuple(
        check_tensor(f"{name}[{i}] ({parts[i]})", w, dtypes=dtypes, shape=s, device=device)
        for i, (w, s) in enumerate(zip(weights, shapes, strict=True))
    )


def call_signature(*args: object) -> tuple | None:
    """What the metadata checks of a call read from its arguments: per tensor its dtype, shape,
    device and contiguity (None stays None, a tuple or list of tensors counts as its tensors); None
    when an argument is anything else (an MXFP8Tensor, say: such calls are checked in full). Two
    calls with equal signatures, config and workspace pass or fail the same metadata checks, so a
    call may skip them when its signature is that of a call that passed (`CheckedCalls`)."""
    out: list[object] = []
    for a in args:
        if a is None:
            out.append(None)
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, a.shape, a.device, a.is_contiguous()))
        elif isinstance(a, (tuple, list)):
            for t in a:
                if not isinstance(t, torch.Tensor):
                    return None
                out.append((t.dtype, t.shape, t.device, t.is_contiguous()))
            out.append(len(a))
        else:
            return None
    return tuple(out)


class CheckedCalls:
    """Signatures (call_signature) of calls that passed their checks, with what the checks found
    (e.g. the backend), for one config object: a few kept, the oldest dropped first. A call with a
    known signature skips the metadata checks; values that must be read on every call (expert ids
    of a CPU tensor, a workspace's usability) are still checked by the caller."""

    LIMIT = 8

    def __init__(self) -> None:
        self.config: object = None
        self.found: dict[tuple, object] = {}

    def get(self, config: object, signature: tuple | None) -> object | None:
        if signature is None or (config is not self.config and config != self.config):
            return None
        return self.found.get(signature)

    def add(self, config: object, signature: tuple | None, found: object) -> None:
        if signature is None:
            return
        if config is not self.config and config != self.config:
            self.config, self.found = config, {}
        if len(self.found) >= self.LIMIT:
            del self.found[next(iter(self.found))]
        self.found[signature] = found
