"""mok-core: the compiled runtime of mok (schedule, transport, dispatch/combine), without torch.

The extension ``mok_core._C`` takes raw device pointers, sizes, dtypes and stream handles;
``mok-torch`` validates tensors and calls it. This package also ships mok-core's C++ headers
and CMake package config, which the precision packages (mok-bf16, mok-mxfp8) compile against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._C import (
    ErrorMirror,
    ShmSegment,
    barrier,
    build_info,
    build_send_side,
    build_table,
    combine,
    cuda_device_count,
    cuda_device_properties,
    entry_points,
    plan_ring,
    pull_rows,
    push_rows,
    schedule_capacity,
    schedule_scratch_bytes,
    version,
    zero_rows,
)

__version__: str = version()

__all__ = [
    "ErrorMirror",
    "ShmSegment",
    "__version__",
    "backend_info",
    "barrier",
    "build_info",
    "build_send_side",
    "build_table",
    "cmake_dir",
    "combine",
    "cuda_device_count",
    "cuda_device_properties",
    "entry_points",
    "include_dir",
    "plan_ring",
    "pull_rows",
    "push_rows",
    "schedule_capacity",
    "schedule_scratch_bytes",
    "version",
    "zero_rows",
]

_PACKAGE_DIR = Path(__file__).resolve().parent


def _installed_dir(relative: str) -> str:
    path = _PACKAGE_DIR / relative
    if not path.is_dir():
        raise FileNotFoundError(
            f"mok-core's {relative} is missing at {path}: this mok_core was not installed from "
            "a wheel or `pip install packages/mok-core`"
        )
    return str(path)


def cmake_dir() -> str:
    """Folder holding ``MokCoreConfig.cmake``: pass it as ``MokCore_DIR`` or on
    ``CMAKE_PREFIX_PATH`` to ``find_package(MokCore CONFIG)``."""
    return _installed_dir("share/cmake/MokCore")


def include_dir() -> str:
    """Folder holding mok-core's public C++ headers (``mok/core/*.h``)."""
    return _installed_dir("include")


def backend_info() -> dict[str, Any]:
    """What this package provides to ``mok-torch``, found through the ``mok.backends`` entry
    point: mok-core is the runtime, not a precision."""
    build = build_info()
    return {
        "package": "mok-core",
        "version": __version__,
        "role": "runtime",
        "precision": None,
        "devices": list(build["backends"]),
        "build": build,
    }
