"""mok-mxfp8: MXFP8 quantization (OCP MX: E4M3 elements, an E8M0 scale per 32) and FP8 kernels.

The extension ``mok_mxfp8._C`` takes raw device pointers, sizes and stream handles, and is
compiled against mok-core's headers; ``mok-torch`` finds this package through the
``mok.backends`` entry point and calls it with validated tensors.
"""

from __future__ import annotations

from typing import Any

from ._C import (
    build_info,
    grouped_forward,
    grouped_gemm,
    grouped_swiglu_backward,
    grouped_wgrad,
    quantize,
    swiglu_backward,
    swiglu_forward,
    version,
)

__version__: str = version()

__all__ = [
    "__version__",
    "backend_info",
    "build_info",
    "grouped_forward",
    "grouped_gemm",
    "grouped_swiglu_backward",
    "grouped_wgrad",
    "quantize",
    "swiglu_backward",
    "swiglu_forward",
    "version",
]


def backend_info() -> dict[str, Any]:
    """What this package provides to ``mok-torch``: the ``mxfp8`` precision."""
    build = build_info()
    return {
        "package": "mok-mxfp8",
        "version": __version__,
        "role": "precision",
        "precision": "mxfp8",
        "devices": list(build["backends"]),
        "build": build,
    }
