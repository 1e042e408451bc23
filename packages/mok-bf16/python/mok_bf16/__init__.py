"""mok-bf16: mok's BF16 expert kernels (grouped SwiGLU forward and backward on Hopper; all on the CPU).

The extension ``mok_bf16._C`` takes raw device pointers, sizes and stream handles, and is
compiled against mok-core's headers; ``mok-torch`` finds this package through the
``mok.backends`` entry point and calls it with validated tensors.

Expert entry points (``include/mok/bf16/experts.h``), bitwise mok-torch's reference backend:

- ``swiglu_forward``: pre-activations ``a, b`` and expert outputs ``y`` of table rows, each
  row with its own local expert;
- ``swiglu_backward``: ``dx`` and the router-weight gradient ``d_w`` of each row, and the
  weight gradients accumulated in place (each expert's rows in ascending order).

They run on the CPU (``device="cpu"``); ``"cuda"`` raises RuntimeError.

- ``grouped_forward``: the forward over segments of consecutive rows (the schedule table's
  layout). On ``"cuda"`` it runs the sm_90a tensor-core GEMMs (``cuda/sm90/grouped_gemm.cuh``):
  deterministic and batch invariant, but each element is one fixed-order fp32 sum of the
  tensor cores, not the reference's sequential one; on ``"cpu"`` the reference arithmetic.
- ``grouped_backward``: the backward over the same segments: ``dx``, ``d_w`` and the weight
  gradients added to fp32 accumulators (``cuda/sm90/experts_backward.cu``, ``cuda/sm90/wgrad_gemm.cuh``).
- ``moe_forward``: the routed experts of a whole layer call in one call, x rows gathered from the
  token rows and each output row stored at its route; on ``"cuda"`` the forward megakernel, one
  persistent launch (``cuda/sm90/moe_forward.cu``), on ``"cpu"`` the same rows through the CPU
  kernels, at one rank or across ranks (each row read from and stored to its source rank's rows
  by address); the bits of ``grouped_forward`` on the same device.
- ``moe_forward_call``: one rank's schedule table, ``moe_forward`` on it and mok-core's combine in
  one call (mok-core's two through ``mok_core.entry_points()``): the host's one crossing per forward.
- ``moe_backward``: the routed experts' backward of a whole layer call in one call on ``"cpu"``,
  the mirror of ``moe_forward``: each row's dy and router weight read from its source rank, its dx
  row and d_w stored at its route there (at one rank or across ranks, by address); the bits of
  ``grouped_backward``.
- ``moe_backward_call``: one rank's direct backward in one call on ``"cuda"``: the table's offsets
  widened, ``grouped_backward`` reading dy and the router weights by route and storing d_w by route,
  and mok-core's combine of dx: the host's one crossing per backward.
``G_SWIGLU_MAX_INNER``: the widest inner size whose CUDA backward runs the SwiGLU backward in the
g GEMM's epilogue (no g array; above it ``scratch_g`` is required).
``exp_f64`` and ``sigmoid`` expose the element functions they share, for tests.
"""

from __future__ import annotations

from typing import Any

from ._C import (
    G_SWIGLU_MAX_INNER,
    build_info,
    exp_f64,
    grouped_backward,
    grouped_forward,
    moe_backward,
    moe_backward_call,
    moe_forward,
    moe_forward_call,
    moe_forward_state_bytes,
    sigmoid,
    swiglu_backward,
    swiglu_forward,
    version,
)

__version__: str = version()

__all__ = [
    "G_SWIGLU_MAX_INNER",
    "__version__",
    "backend_info",
    "build_info",
    "exp_f64",
    "grouped_backward",
    "grouped_forward",
    "moe_backward",
    "moe_backward_call",
    "moe_forward",
    "moe_forward_call",
    "moe_forward_state_bytes",
    "sigmoid",
    "swiglu_backward",
    "swiglu_forward",
    "version",
]


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
