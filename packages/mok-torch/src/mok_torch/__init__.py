"""mok: a deterministic mixture-of-experts training layer for PyTorch.

    import mok_torch as mok
    y = mok.moe(x, top_experts, router_weights, routed=(Wg, Wu, Wd), config=mok.MoKConfig())
    layer = mok.MoELayer(hidden_size, intermediate_size, num_experts, topk)

See docs/design.md §10 for the whole API and docs/determinism.md for what "deterministic" promises.
"""

from __future__ import annotations

from .autograd import moe
from .backends import available_backends, compiled_packages, register_backend, resolve_backend
from .config import MoKConfig, default_minibatch_size
from .functional import backward, build_schedule, check_errors, forward, recompute_forward_context
from .layer import MoELayer, route, stable_topk
from .mxfp8 import MXFP8Tensor, mxfp8_quantize
from .replay import RoutingRecord, record_routing, replay_routing
from .structs import ForwardContext, Grads, Schedule
from .workspace import Workspace, clear_workspace_cache, create_workspace, get_workspace

__version__ = "0.1.0"

__all__ = [
    "ForwardContext",
    "Grads",
    "MXFP8Tensor",
    "MoELayer",
    "MoKConfig",
    "RoutingRecord",
    "Schedule",
    "Workspace",
    "__version__",
    "available_backends",
    "backward",
    "build_schedule",
    "check_errors",
    "clear_workspace_cache",
    "compiled_packages",
    "create_workspace",
    "default_minibatch_size",
    "forward",
    "get_workspace",
    "moe",
    "mxfp8_quantize",
    "recompute_forward_context",
    "record_routing",
    "register_backend",
    "replay_routing",
    "resolve_backend",
    "route",
    "stable_topk",
]
