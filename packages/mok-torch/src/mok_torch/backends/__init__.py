"""Backend registry.

A backend implements the layer for some precisions and devices. `reference` (pure
PyTorch) is built in and always works; `cpu` and `cuda` (the native backends) are built
in and available when the installed mok-core has the runtime for that device. Other
backends come from installed packages through the entry-point group `mok.backends`, read
once, lazily, on first use (never at import):

- an entry point that loads to a backend object (anything with `name`, `build_schedule`,
  `forward`, `backward`, `recompute_forward_context` and `unavailable_reason`) registers it;
- an entry point that loads to a function returning a dict describes a compiled package
  (mok-core, mok-bf16, mok-mxfp8: version, build info, devices); those are reported by
  `compiled_packages()` and used by the native backends that wrap them.

`resolve_backend` picks the backend a call runs on and says exactly why one is missing.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

import torch

from ..config import MoKConfig
from .native import NativeBackend
from .reference import ReferenceBackend

ENTRY_POINT_GROUP = "mok.backends"

# Preference of `backend="auto"` per device type: fastest first, the reference last.
AUTO_ORDER = {"cuda": ("cuda", "reference"), "cpu": ("cpu", "reference")}


@runtime_checkable
class Backend(Protocol):
    name: str

    def unavailable_reason(self, precision: str, device: torch.device) -> str | None: ...
    def build_schedule(self, ws: Any, cfg: MoKConfig, top_experts_TK: torch.Tensor) -> Any: ...
    def forward(self, *args: Any, **kwargs: Any) -> Any: ...
    def backward(self, *args: Any, **kwargs: Any) -> Any: ...
    def recompute_forward_context(self, *args: Any, **kwargs: Any) -> Any: ...


class BackendRegistry:
    """Backends by name, plus the compiled packages' descriptions, from entry points."""

    def __init__(self, builtin: list[Backend], entry_points: Callable[[], Iterable[Any]] | None = None) -> None:
        self._lock = threading.RLock()
        self._backends: dict[str, Backend] = {b.name: b for b in builtin}
        self._packages: dict[str, dict[str, Any]] = {}
        self._errors: dict[str, str] = {}
        self._entry_points = entry_points or (lambda: metadata.entry_points(group=ENTRY_POINT_GROUP))
        self._loaded = False

    def register(self, backend: Backend) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must implement the mok Backend protocol, got {type(backend).__name__}")
        with self._lock:
            if backend.name in self._backends and self._backends[backend.name] is not backend:
                raise ValueError(f"a backend named {backend.name!r} is already registered")
            self._backends[backend.name] = backend

    def _load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            for ep in self._entry_points():
                try:
                    obj = ep.load()
                    if not isinstance(obj, Backend) and callable(obj):
                        obj = obj()
                    if isinstance(obj, Backend):
                        self.register(obj)
                    elif isinstance(obj, dict):
                        self._packages[ep.name] = obj
                    else:
                        raise TypeError(f"loaded a {type(obj).__name__}, neither a backend nor a package description")
                except Exception as exc:  # a broken package must not break the reference backend
                    self._errors[ep.name] = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"mok: entry point {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=4)

    @property
    def backends(self) -> dict[str, Backend]:
        self._load()
        return dict(self._backends)

    @property
    def packages(self) -> dict[str, dict[str, Any]]:
        self._load()
        return dict(self._packages)

    @property
    def errors(self) -> dict[str, str]:
        self._load()
        return dict(self._errors)


_REGISTRY = BackendRegistry([ReferenceBackend(), NativeBackend("cpu"), NativeBackend("cuda")])


# resolve_backend's answers, by (config.backend, precision, device): asked several times per
# layer call. Cleared when a backend is registered.
_RESOLVED: dict[tuple[str, str, torch.device], Backend] = {}


def register_backend(backend: Backend) -> None:
    """Make `backend` selectable by its name (MoKConfig.backend)."""
    _REGISTRY.register(backend)
    _RESOLVED.clear()


def compiled_packages() -> dict[str, dict[str, Any]]:
    """Descriptions of the installed compiled packages, by entry-point name (core, bf16, ...)."""
    return _REGISTRY.packages


def entry_point_errors() -> dict[str, str]:
    """Entry points of `mok.backends` that failed to load, with the reason."""
    return _REGISTRY.errors


def registered_backends() -> dict[str, Backend]:
    return _REGISTRY.backends


def check_backend_errors(ws: Any) -> None:
    """Every registered backend's `check_errors(ws)` hook (optional: a backend whose calls can
    record an error for a later call to raise, as the native GPU backend's device-side waits do,
    has one; the hook waits for what it needs and raises what it finds)."""
    for backend in registered_backends().values():
        hook = getattr(backend, "check_errors", None)
        if hook is not None:
            hook(ws)


def checks_expert_ids_on_device(backend: Backend, device: torch.device) -> bool:
    """Whether `backend` finds expert ids outside [0, E) on `device` itself (optional hook
    `checks_expert_ids_on_device(device)`): it then records a bad id in its error words, for its
    next call or `mok.check_errors` to raise, and mok-torch does not read the ids on the host."""
    hook = getattr(backend, "checks_expert_ids_on_device", None)
    return bool(hook(device)) if hook is not None else False


def _missing_reason(name: str) -> str:
    pkgs = compiled_packages()
    installed = ", ".join(
        f"{info.get('package', key)} {info.get('version', '?')} ({'+'.join(info.get('devices', []))})"
        for key, info in sorted(pkgs.items())
    )
    return (
        f"no installed package registers a {name!r} backend "
        f"(compiled packages found: {installed or 'none'}; the native {name!r} backend is not built yet)"
    )


def available_backends(precision: str, device: torch.device | str) -> list[str]:
    """Names of the backends that can run `precision` on `device`."""
    device = torch.device(device)
    return [n for n, b in registered_backends().items() if b.unavailable_reason(precision, device) is None]


def resolve_backend(cfg: MoKConfig, device: torch.device | str) -> Backend:
    """The backend a call with `cfg` on `device` runs on; ValueError saying why if none."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    key = (cfg.backend, cfg.precision, device)
    backend = _RESOLVED.get(key)
    if backend is None:
        backend = _RESOLVED[key] = _resolve_backend(cfg, device)
    return backend


def _resolve_backend(cfg: MoKConfig, device: torch.device) -> Backend:
    backends = registered_backends()
    if cfg.backend == "auto":
        reasons = []
        for name in AUTO_ORDER.get(device.type, ("reference",)):
            backend = backends.get(name)
            why = _missing_reason(name) if backend is None else backend.unavailable_reason(cfg.precision, device)
            if why is None:
                assert backend is not None
                return backend
            reasons.append(f"{name}: {why}")
        raise ValueError(
            f"config.backend='auto': no backend runs precision {cfg.precision!r} on {device.type}: "
            + "; ".join(reasons)
        )
    backend = backends.get(cfg.backend)
    if backend is None:
        raise ValueError(f"config.backend={cfg.backend!r} is not available: {_missing_reason(cfg.backend)}")
    why = backend.unavailable_reason(cfg.precision, device)
    if why is not None:
        raise ValueError(f"config.backend={cfg.backend!r} cannot run on {device}: {why}")
    return backend
