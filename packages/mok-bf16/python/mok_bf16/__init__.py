"""mok-bf16: mok's BF16 expert kernels (grouped SwiGLU forward/backward, weight gradients, d_w).

The extension ``mok_bf16._C`` takes raw device pointers, sizes and stream handles, and is
compiled against mok-core's headers; ``mok-torch`` finds this package through the
``mok.backends`` entry point and calls it with validated tensors.
"""

from __future__ import annotations

from typing import Any

from ._C import build_info, version

__version__: str = version()

__all__ = ["__version__", "backend_info", "build_info", "version"]


def backend_info() -> dict[str, Any]:
    """What this package provides to ``mok-torch``: the ``bf16`` precision."""
    build = build_info()
    return {
        "package": "mok-bf16",
        "version": __version__,
        "role": "precision",
        "precision": "bf16",
        "devices": list(build["backends"]),
        "build": build,
    }
