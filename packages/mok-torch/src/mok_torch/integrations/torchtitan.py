"""torchtitan (0.3.0): mok as a token dispatcher, and mok's fused layer as the routed experts.

Shape letters follow torchtitan's MoE legend: T tokens (B*L), D model dim (H in mok), F expert
hidden dim (I in mok), E experts, e local experts (El), K top-k, N = T*K routes, R the rows
handed to this rank's experts (with padding, the sum of the padded counts).

torchtitan 0.3.0's `MoE` calls `routed_experts(x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
num_local_tokens_per_expert_E)`; its `RoutedExperts` runs `token_dispatcher.dispatch`, the
`GroupedExperts` (`w1_EFD` gate, `w3_EFD` up, `w2_EDF` down) and `token_dispatcher.combine`.
Two ways in, both chosen through torchtitan's override mechanism
(`--override.imports`, see docs/torchtitan.md):

    # 1. Only the rows move through mok; torchtitan's GroupedExperts compute.
    "mok_torch.integrations.torchtitan.mok_token_dispatcher"
    # 2. Dispatch, experts and combine in one mok layer call on torchtitan's router output.
    "mok_torch.integrations.torchtitan.mok_routed_experts"

(1) `MoKTokenDispatcher` hands each rank the rows of its local experts, expert-major, each
expert's rows in global token order (source rank, then the source's token order), which is the
order torchtitan's `LocalTokenDispatcher` and `AllToAllTokenDispatcher` produce; its combine
applies the scores in fp32 and sums each token's routes in expert order, as their scatter-add
does. (2) `MoKRoutedExperts` keeps torchtitan's parameters and their names (checkpoints,
initialisation and sharding are torchtitan's), and calls `mok_torch.moe` with them: torchtitan's
[E, F, D] gate / up and [E, D, F] down are mok's Wg, Wu [El, I, H] and Wd [El, H, I] as they are.

Importing this module needs torchtitan; `import mok_torch` never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import functional
from ..autograd import agree_max_tokens, moe
from ..backends.reference import transport
from ..config import MoKConfig
from ..structs import Schedule
from ..workspace import get_workspace

try:
    from torch.distributed.tensor import DTensor
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mok_torch.integrations.torchtitan needs torchtitan 0.3.0: pip install torchtitan==0.3.0"
    ) from exc


def _sum_routes(rows_TKD: torch.Tensor, order_TK: torch.Tensor, acc: torch.dtype, out: torch.dtype) -> torch.Tensor:
    """sum_k rows[t, order[t, k]] in `acc` from zero, rounded once to `out`: [T, D].

    torchtitan sums a token's routes in expert order: its combine's scatter-add accumulates in
    fp32, the backward of its gather (an index_put) in the rows' dtype (both measured on the
    CPU). mok's dispatcher sums in the same order and precision, so the bits agree.
    """
    rows_TKD = torch.take_along_dim(rows_TKD, order_TK[:, :, None], dim=1)
    acc_TD = torch.zeros(rows_TKD.shape[0], rows_TKD.shape[2], dtype=acc, device=rows_TKD.device)
    for k in range(rows_TKD.shape[1]):
        acc_TD = acc_TD + rows_TKD[:, k].to(acc)
    return acc_TD.to(out)


class _Pull(torch.autograd.Function):
    """x [T, D] -> the schedule table [C, D]; the adjoint sums each token's K returned rows."""

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, sched: Schedule, order_TK: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.sched, ctx.order_TK = sched, order_TK
        return transport.pull(sched, x_TD)

    @staticmethod
    def backward(ctx: Any, grad_CD: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        sched = ctx.sched
        grad_ND = transport.push(sched, grad_CD.contiguous())
        grad_TKD = grad_ND.view(sched.num_tokens, sched.topk, -1)
        return _sum_routes(grad_TKD, ctx.order_TK, grad_ND.dtype, grad_ND.dtype), None, None


class _Push(torch.autograd.Function):
    """The schedule table [C, D] -> per-route rows [N, D] on their source; adjoint: a pull."""

    @staticmethod
    def forward(ctx: Any, rows_CD: torch.Tensor, sched: Schedule) -> torch.Tensor:  # type: ignore[override]
        ctx.sched = sched
        return transport.push(sched, rows_CD)

    @staticmethod
    def backward(ctx: Any, grad_ND: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return transport.pull(ctx.sched, grad_ND.contiguous(), per_route=True), None


@dataclass(frozen=True, kw_only=True)
class MoKDispatchMetadata:
    """What `MoKTokenDispatcher.combine` needs of its dispatch."""

    schedule: Schedule
    num_rows: int  # R: rows handed to the local experts, padding included
    topk_scores_TK: torch.Tensor
    expert_order_TK: torch.Tensor  # each token's routes in expert order, the order sums run in


class MoKTokenDispatcher(LocalTokenDispatcher):
    """torchtitan's token dispatcher over mok's schedule and transport (any EP degree).

    Without an EP mesh (`wire_meshes(ep_mesh=None)`) it serves EP = 1; with one, every rank of
    the mesh's group must dispatch and combine the same number of times (collectives).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(LocalTokenDispatcher.Config):
        pad_multiple: int | None = None
        """Pad each local expert's rows with zero rows to a multiple of this (a power of two
        <= 1024; None: no padding), for grouped GEMMs that need aligned segments."""
        timeout_s: float = 300.0
        """How long a wait on another rank may take before it raises."""

        def __post_init__(self) -> None:
            # MoKConfig validates the alignment and timeout and names the limits.
            MoKConfig(expert_alignment=self.pad_multiple or 1, timeout_s=self.timeout_s)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # The reference transport moves rows with collectives, so it runs on gloo and NCCL alike.
        self.mok_config = MoKConfig(
            backend="reference", expert_alignment=config.pad_multiple or 1, timeout_s=config.timeout_s
        )
        self.group: Any = None

    def wire_meshes(self, *, ep_mesh: Any) -> None:
        self.group = None if ep_mesh is None else ep_mesh.get_group()

    def dispatch(  # type: ignore[override]
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, MoKDispatchMetadata]:
        """Rows of this rank's experts.

        Args:
            x_TD: [T, D] this rank's tokens, unsorted.
            topk_scores_TK: [T, K] float routing scores (applied in `combine`).
            topk_expert_ids_TK: [T, K] int global expert ids.
            num_local_tokens_per_expert_E: [E] (unused: mok counts from the ids).

        Returns:
            routed_input_RD: [R, D] x's dtype, expert-major, zero rows where padded.
            num_tokens_per_local_expert_e: [e] int64 rows per local expert, padding included.
            metadata for `combine`.
        """
        del num_local_tokens_per_expert_E
        T, D = x_TD.shape
        K = topk_expert_ids_TK.shape[1]
        if K != self.top_k:
            raise ValueError(f"topk_expert_ids_TK has K = {K}, the dispatcher was configured with top_k = {self.top_k}")
        cfg, dev = self.mok_config, x_TD.device
        max_tokens = agree_max_tokens(T, self.group, dev, cfg.timeout_s)
        ws = get_workspace(
            cfg, self.group, device=dev, max_tokens=max_tokens, hidden_size=D, topk=K, num_experts=self.num_experts
        )
        sched = functional.build_schedule(ws, cfg, topk_expert_ids_TK)
        offsets = sched.expert_offsets_El1
        num_rows = int(offsets[-1])
        order_TK = torch.argsort(topk_expert_ids_TK, dim=1, stable=True)
        rows_CD = _Pull.apply(x_TD, sched, order_TK)
        metadata = MoKDispatchMetadata(
            schedule=sched, num_rows=num_rows, topk_scores_TK=topk_scores_TK, expert_order_TK=order_TK
        )
        return rows_CD[:num_rows], (offsets[1:] - offsets[:-1]).to(torch.int64), metadata

    def combine(  # type: ignore[override]
        self, routed_output_RD: torch.Tensor, metadata: MoKDispatchMetadata, x_TD: torch.Tensor
    ) -> torch.Tensor:
        """out[t] = sum over t's routes, in expert order, of score * expert output: [T, D] x's dtype.

        The score multiplies in fp32 and rounds to the rows' dtype; the sum runs in fp32 from
        zero, route by route in expert order, and rounds once to x's dtype: the arithmetic of
        torchtitan's combine (its deterministic scatter-add on the CPU; measured, not documented).
        """
        sched, R = metadata.schedule, metadata.num_rows
        if routed_output_RD.shape[0] != R:
            raise ValueError(f"routed_output_RD has {routed_output_RD.shape[0]} rows, its dispatch handed out {R}")
        T, K, D = sched.num_tokens, sched.topk, routed_output_RD.shape[1]
        padded_CD = torch.nn.functional.pad(routed_output_RD, (0, 0, 0, sched.workspace.capacity - R))
        routes_ND = _Push.apply(padded_CD, sched)
        scores_N1 = metadata.topk_scores_TK.reshape(-1, 1)
        weighted_TKD = (routes_ND.to(torch.float32) * scores_N1).to(routes_ND.dtype).view(T, K, D)
        return _sum_routes(weighted_TKD, metadata.expert_order_TK, torch.float32, x_TD.dtype)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # EP shards the experts on dim 0 as DTensors; mok takes this rank's experts as a plain tensor.
    return weight.to_local() if isinstance(weight, DTensor) else weight


class MoKRoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts with dispatch, SwiGLU experts and combine as one `mok_torch.moe`.

    The parameters stay in `inner_experts` (a plain `GroupedExperts`) under their names; the
    `token_dispatcher` is built but not called (it stays for torchtitan code that inspects it).
    With EP, rank r holds experts [r*e, (r+1)*e) and the group is the EP mesh's.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        mok: MoKConfig = field(default_factory=MoKConfig)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if type(self.inner_experts) is not GroupedExperts:
            # A subclass may change the arithmetic (biases, clamps, quantized GEMMs) mok does not do.
            raise TypeError(
                f"MoKRoutedExperts runs torchtitan's GroupedExperts (SwiGLU, no biases) only, got "
                f"{type(self.inner_experts).__name__}"
            )
        self.mok_config = config.mok
        self.ep_group: Any = None

    def parallelize(self, parallel_dims: Any) -> None:
        super().parallelize(parallel_dims)
        mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = None if mesh is None else mesh.get_group()

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """sum_k score[t,k] * SwiGLU expert_{id[t,k]}(x[t]): [B, L, D] x's dtype (computed in bf16)."""
        del num_local_tokens_per_expert_E
        B, L, D = x_BLD.shape
        K = topk_expert_ids_BLK.shape[-1]
        experts = self.inner_experts
        routed = (_local(experts.w1_EFD), _local(experts.w3_EFD), _local(experts.w2_EDF))
        y_TD = moe(
            x_BLD.reshape(B * L, D),
            topk_expert_ids_BLK.reshape(B * L, K),
            topk_scores_BLK.reshape(B * L, K),
            routed=routed,
            config=self.mok_config,
            group=self.ep_group,
        )
        return y_TD.view(B, -1, D)


@override(
    target=LocalTokenDispatcher.Config,
    description="mok: token rows moved by mok's schedule and transport",
)
def mok_token_dispatcher(
    cfg: LocalTokenDispatcher.Config, *, pad_multiple: int | None = None, timeout_s: float = 300.0
) -> MoKTokenDispatcher.Config:
    """Every token dispatcher (local or EP) becomes a MoKTokenDispatcher."""
    return derive(cfg, MoKTokenDispatcher.Config, pad_multiple=pad_multiple, timeout_s=timeout_s)


@override(
    target=RoutedExperts.Config,
    exact=True,
    description="mok: dispatch, experts and combine fused in one layer",
)
def mok_routed_experts(cfg: RoutedExperts.Config, **mok_config: Any) -> MoKRoutedExperts.Config:
    """Every RoutedExperts becomes a MoKRoutedExperts; the kwargs are MoKConfig's fields."""
    return derive(cfg, MoKRoutedExperts.Config, mok=MoKConfig(**mok_config))
