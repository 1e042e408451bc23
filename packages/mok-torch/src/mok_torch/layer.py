"""MoELayer: router + routed SwiGLU experts + optional shared expert, as an nn.Module.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .autograd import moe
from .config import MoKConfig
from .validation import INDEX_DTYPES, check_expert_ids, check_tensor
from .workspace import group_rank_and_size

SCORE_FUNCS = ("softmax", "sigmoid")


def stable_topk(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k largest scores; ties go to the lower expert id, on every device."""
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]


def route(
    logits_TE: torch.Tensor,
    topk: int,
    *,
    score_func: str = "softmax",
    norm_topk_prob: bool = True,
    top_experts_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_experts [T, K], router_weights [T, K] fp32) from router logits.

    Given `top_experts_TK` (router replay), the choice is replayed and the weights are still
    computed from the live logits, so the router keeps receiving gradients.
    """
    logits = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    top = stable_topk(scores.detach(), topk) if top_experts_TK is None else top_experts_TK.to(torch.int64)
    # A replayed id outside [0, E) is mok.moe's to report (on a GPU without a host read); the
    # gather reads a clamped id so that it never indexes out of bounds first.
    weights = scores.gather(1, top if top_experts_TK is None else top.clamp(0, scores.shape[1] - 1))
    if norm_topk_prob:
        denom = weights[:, 0]
        for k in range(1, topk):  # k ascending, whatever the shape
            denom = denom + weights[:, k]
        weights = weights / denom[:, None]
    return top, weights


class MoELayer(nn.Module):
    """A mixture-of-experts SwiGLU layer with expert parallelism over `group`.

    Args:
        hidden_size: H.
        intermediate_size: I of each routed expert.
        num_experts: E, in all; this rank holds El = E / R of them (R = size of `group`).
        topk: K experts per token.
        shared_intermediate_size: Is of the shared expert (0 = none).
        group: expert-parallel process group (None = all experts on this rank).
        config: MoKConfig (precision, backend, batching; default MoKConfig()).
        score_func: "softmax" (Qwen/Mixtral style) or "sigmoid" (DeepSeek-V3 style).
        norm_topk_prob: renormalise the K chosen weights to sum to 1.
        max_tokens: the most tokens a rank brings to one call; None agrees on it per call.
        device, dtype: of the parameters (computation is bf16 whatever the dtype).

    forward(x [..., H], top_experts=None) -> y [..., H]. `top_experts` [..., K] replays a
    recorded routing; after each call `last_top_experts` holds the choice made.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        topk: int,
        shared_intermediate_size: int = 0,
        group: Any = None,
        config: MoKConfig | None = None,
        *,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        max_tokens: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("num_experts", num_experts),
            ("topk", topk),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if (
            isinstance(shared_intermediate_size, bool)
            or not isinstance(shared_intermediate_size, int)
            or shared_intermediate_size < 0
        ):
            raise ValueError(f"shared_intermediate_size must be an int >= 0, got {shared_intermediate_size!r}")
        if topk > num_experts:
            raise ValueError(f"topk ({topk}) must be <= num_experts ({num_experts})")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        rank, world = group_rank_and_size(group)
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the group size ({world})")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.topk = num_experts, topk
        self.shared_intermediate_size = shared_intermediate_size
        self.group, self.config = group, MoKConfig() if config is None else config
        self._group_name = ops.group_name(group)  # resolved once, so compiled code never touches the group
        self.score_func, self.norm_topk_prob, self.max_tokens = score_func, norm_topk_prob, max_tokens
        self.num_local_experts = num_experts // world
        self.expert_offset = rank * self.num_local_experts
        El, H, I = self.num_local_experts, hidden_size, intermediate_size
        self.router = nn.Linear(H, num_experts, bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Parameter(torch.empty(El, I, H, device=device, dtype=dtype))
        self.up_proj = nn.Parameter(torch.empty(El, I, H, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(El, H, I, device=device, dtype=dtype))
        if shared_intermediate_size:
            Is = shared_intermediate_size
            self.shared_gate_proj = nn.Parameter(torch.empty(Is, H, device=device, dtype=dtype))
            self.shared_up_proj = nn.Parameter(torch.empty(Is, H, device=device, dtype=dtype))
            self.shared_down_proj = nn.Parameter(torch.empty(H, Is, device=device, dtype=dtype))
        else:
            self.register_parameter("shared_gate_proj", None)
            self.register_parameter("shared_up_proj", None)
            self.register_parameter("shared_down_proj", None)
        self.last_top_experts: torch.Tensor | None = None
        # Choices queued by mok_torch.replay_routing, consumed one per call.
        self._replay: list[torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default: uniform in +-1/sqrt(fan_in) for every projection."""
        self.router.reset_parameters()
        for p in (
            self.gate_proj,
            self.up_proj,
            self.down_proj,
            self.shared_gate_proj,
            self.shared_up_proj,
            self.shared_down_proj,
        ):
            if p is not None:
                bound = 1.0 / math.sqrt(p.shape[-1])
                nn.init.uniform_(p, -bound, bound)

    @property
    def routed_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj, self.up_proj, self.down_proj

    @property
    def shared_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self.shared_gate_proj is None:
            return None
        return self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, top_experts: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape [..., H] with H = {self.hidden_size}, got {list(x.shape)}")
        lead = x.shape[:-1]
        x_TH = x.reshape(-1, self.hidden_size)
        if top_experts is None and self._replay is not None:
            if not self._replay:
                raise ValueError("replay_routing: this layer was called more often than the record has calls")
            top_experts = self._replay.pop(0).to(x.device)
        top_TK = None
        if top_experts is not None:
            check_tensor(
                "top_experts",
                top_experts,
                dtypes=INDEX_DTYPES,
                shape=[("...", None)] * top_experts.dim(),
                device=x.device,
                contiguous=False,
            )
            if tuple(top_experts.shape) != tuple(lead) + (self.topk,):
                raise ValueError(
                    f"top_experts must have shape {list(lead) + [self.topk]} ([..., K]), got {list(top_experts.shape)}"
                )
            top_TK = top_experts.reshape(-1, self.topk)
            # Checked here, before the router, where it costs no wait for a device: on a GPU
            # mok.moe's schedule kernel checks the ids without a host read (route() clamps its
            # gather). Not while compiling either (a host read breaks the graph).
            if not top_experts.is_cuda and not torch.compiler.is_compiling():
                check_expert_ids("top_experts", top_experts, self.num_experts)
        logits = F.linear(x_TH.float(), self.router.weight.float())
        top_TK, weights_TK = route(
            logits, self.topk, score_func=self.score_func, norm_topk_prob=self.norm_topk_prob, top_experts_TK=top_TK
        )
        self.last_top_experts = top_TK.detach().reshape(tuple(lead) + (self.topk,))
        y_TH = moe(
            x_TH,
            top_TK,
            weights_TK,
            self.routed_weights,
            self.shared_weights,
            config=self.config,
            group=self.group,
            max_tokens=self.max_tokens,
            _group_name=self._group_name,
        )
        return y_TH.reshape(x.shape)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"num_experts={self.num_experts} ({self.num_local_experts} local), topk={self.topk}, "
            f"shared_intermediate_size={self.shared_intermediate_size}, score_func={self.score_func!r}"
        )
