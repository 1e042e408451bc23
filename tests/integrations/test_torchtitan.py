"""mok inside torchtitan 0.3.0's MoE, against torchtitan's own dispatchers and experts.

MoKTokenDispatcher moves rows with torchtitan's arithmetic, so a RoutedExperts with it gives
the bits of the stock one; MoKRoutedExperts fuses dispatch, experts and combine in mok's
arithmetic, so it is compared within the bf16 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed (nox -s torchtitan runs these tests)")

from helpers import BACKEND, assert_close
from multiproc import run_ranks
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.distributed import utils as tt_dist_utils
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
)

from mok_torch import MoKConfig
from mok_torch.integrations.torchtitan import (
    MoKRoutedExperts,
    MoKTokenDispatcher,
    mok_routed_experts,
    mok_token_dispatcher,
)

D, F = 32, 24

# (B, L, E, K): one token, K = 1, T not a multiple of anything, experts left empty
CASES = [(1, 1, 4, 1), (1, 37, 5, 3), (2, 16, 8, 2), (1, 5, 16, 4)]


def _routing(T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_TD bf16, topk_scores_TK fp32, topk_expert_ids_TK int64) with distinct ids per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    logits = torch.randn(T, E, generator=g)
    ids = torch.topk(logits, K, dim=-1, sorted=False).indices
    scores = torch.softmax(logits, -1).gather(1, ids)
    return x, scores, ids


def _weights(E: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {
        "w1_EFD": torch.randn(E, F, D, generator=g) / D**0.5,
        "w2_EDF": torch.randn(E, D, F, generator=g) / F**0.5,
        "w3_EFD": torch.randn(E, F, D, generator=g) / D**0.5,
    }


def _routed_experts(cls: type, dispatcher: object, E: int, weights: dict[str, torch.Tensor], **kw: object) -> object:
    cfg = cls.Config(
        inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
        token_dispatcher=dispatcher,
        **kw,
    )
    module = cfg.build()
    with torch.no_grad():
        for name, w in weights.items():
            getattr(module.inner_experts, name).copy_(w)
    return module


def _run(module, x_TD, scores_TK, ids_TK, num_experts: int) -> dict[str, torch.Tensor]:
    """Forward and backward of routed experts on [1, T, D]; output and every gradient."""
    x = x_TD.clone().requires_grad_()
    scores = scores_TK.clone().requires_grad_()
    counts = torch.bincount(ids_TK.flatten(), minlength=num_experts)
    out = module(x[None], scores[None], ids_TK[None], counts)[0]
    g = torch.Generator().manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    res = {"out": out.detach(), "dx": x.grad, "dscores": scores.grad}
    for name, p in module.inner_experts.named_parameters():
        res["d" + name] = p.grad
    return res


@pytest.mark.parametrize("B, L, E, K", CASES)
def test_dispatcher_matches_stock_bitwise(B, L, E, K):
    x, scores, ids = _routing(B * L, E, K, seed=E + K)
    w = _weights(E, seed=E)
    stock = _routed_experts(RoutedExperts, LocalTokenDispatcher.Config(num_experts=E, top_k=K), E, w)
    ours = _routed_experts(RoutedExperts, MoKTokenDispatcher.Config(num_experts=E, top_k=K), E, w)
    assert isinstance(ours.token_dispatcher, MoKTokenDispatcher)
    want, got = _run(stock, x, scores, ids, E), _run(ours, x, scores, ids, E)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_dispatcher_rows_and_padding():
    E, K = 5, 3
    x, scores, ids = _routing(37, E, K, seed=3)
    counts = torch.bincount(ids.flatten(), minlength=E)
    stock = LocalTokenDispatcher.Config(num_experts=E, top_k=K).build()
    want_rows, want_counts, want_meta = stock.dispatch(x, scores, ids, counts)
    plain = MoKTokenDispatcher.Config(num_experts=E, top_k=K).build()
    rows, per_expert, _ = plain.dispatch(x, scores, ids, counts)
    assert torch.equal(rows, want_rows) and torch.equal(per_expert, want_counts)
    padded = MoKTokenDispatcher.Config(num_experts=E, top_k=K, pad_multiple=8).build()
    rows, per_expert, meta = padded.dispatch(x, scores, ids, counts)
    assert bool((per_expert % 8 == 0).all()) and int(per_expert.sum()) == rows.shape[0]
    starts = torch.cumsum(per_expert, 0) - per_expert
    for e in range(E):
        seg = rows[starts[e] : starts[e] + per_expert[e]]
        n = int(want_counts[e])
        assert torch.equal(seg[:n], want_rows[want_counts[:e].sum() : want_counts[: e + 1].sum()])
        assert not seg[n:].any(), "padding rows are zero"
    # the combine of padded rows gives the unpadded combine's bits
    out = padded.combine(rows * 2, meta, x)
    assert torch.equal(out, stock.combine(want_rows * 2, want_meta, x))


def test_dispatcher_checks():
    d = MoKTokenDispatcher.Config(num_experts=4, top_k=2).build()
    x, scores, ids = _routing(6, 4, 1, seed=0)
    with pytest.raises(ValueError, match="top_k = 2"):
        d.dispatch(x, scores, ids, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="power of two"):
        MoKTokenDispatcher.Config(num_experts=4, top_k=2, pad_multiple=3)


@pytest.mark.parametrize("B, L, E, K", CASES)
def test_fused_layer_matches_stock(B, L, E, K):
    x, scores, ids = _routing(B * L, E, K, seed=E + K)
    w = _weights(E, seed=E)
    disp = LocalTokenDispatcher.Config(num_experts=E, top_k=K)
    stock = _routed_experts(RoutedExperts, disp, E, w)
    fused = _routed_experts(MoKRoutedExperts, disp, E, w, mok=MoKConfig(backend=BACKEND))
    want, got = _run(stock, x, scores, ids, E), _run(fused, x, scores, ids, E)
    for name in want:
        assert_close(name, got[name].float(), want[name].float())


def test_fused_layer_rejects_other_experts():
    class BiasedExperts(GroupedExperts):
        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

    cfg = MoKRoutedExperts.Config(
        inner_experts=BiasedExperts.Config(dim=D, hidden_dim=F, num_experts=4),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=4, top_k=1),
    )
    with pytest.raises(TypeError, match="GroupedExperts"):
        cfg.build()


def _moe_config(E: int, K: int) -> MoE.Config:
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config

    return make_moe_config(
        num_experts=E,
        router=make_router_config(dim=D, num_experts=E, gate_param_init={}, top_k=K),
        routed_experts=make_routed_experts_config(
            dim=D, hidden_dim=F, num_experts=E, top_k=K, param_init={}, comm_backend="standard"
        ),
    )


def test_overrides_select_mok():
    """torchtitan's --override.imports swaps the configs in a model's tree."""
    cfg = _moe_config(8, 2)
    apply_overrides(
        OverrideConfig(imports=[("mok_torch.integrations.torchtitan.mok_routed_experts", {"expert_alignment": 16})]),
        cfg,
    )
    assert isinstance(cfg.routed_experts, MoKRoutedExperts.Config)
    assert cfg.routed_experts.mok == MoKConfig(expert_alignment=16)
    assert isinstance(cfg.routed_experts.token_dispatcher, AllToAllTokenDispatcher.Config)
    cfg = _moe_config(8, 2)
    apply_overrides(OverrideConfig(imports=["mok_torch.integrations.torchtitan.mok_token_dispatcher"]), cfg)
    assert type(cfg.routed_experts) is RoutedExperts.Config
    assert isinstance(cfg.routed_experts.token_dispatcher, MoKTokenDispatcher.Config)
    assert (cfg.routed_experts.token_dispatcher.num_experts, cfg.routed_experts.token_dispatcher.top_k) == (8, 2)
    # the factories are plain functions too
    assert isinstance(
        mok_token_dispatcher(LocalTokenDispatcher.Config(num_experts=4, top_k=1)), MoKTokenDispatcher.Config
    )
    assert isinstance(mok_routed_experts(_moe_config(4, 1).routed_experts), MoKRoutedExperts.Config)


E_EP, K_EP = 6, 2


class _EPOnly:
    """The part of torchtitan's ParallelDims that RoutedExperts.parallelize reads without a
    sharding config (these modules hold this rank's experts as plain tensors already)."""

    spmd_backend = "partial_dtensor"

    def __init__(self, ep_mesh: object) -> None:
        self.ep_mesh = ep_mesh

    def get_optional_mesh(self, dims: str, **_: object) -> object:
        return self.ep_mesh if dims == "ep" else None


def ep_scenario(rank: int, world: int, group, backend: str) -> dict:
    """At EP = world over gloo: stock AllToAll, MoKTokenDispatcher, MoKRoutedExperts on rank's tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    # spmd_types' typed collectives need the trainer's sparse mesh; torchtitan's plain path does not
    tt_dist_utils.set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    El = E_EP // world
    x, scores, ids = _routing(11 + 6 * rank, E_EP, K_EP, seed=rank)
    w = {n: t[rank * El : (rank + 1) * El] for n, t in _weights(E_EP, seed=0).items()}
    mok = {"mok": MoKConfig(backend=backend)}
    results = {}
    for name, cls, disp, kw in (
        ("stock", RoutedExperts, AllToAllTokenDispatcher.Config(num_experts=E_EP, top_k=K_EP), {}),
        ("dispatcher", RoutedExperts, MoKTokenDispatcher.Config(num_experts=E_EP, top_k=K_EP), {}),
        ("fused", MoKRoutedExperts, LocalTokenDispatcher.Config(num_experts=E_EP, top_k=K_EP), mok),
    ):
        module = _routed_experts(cls, disp, El, w, **kw)
        module.parallelize(_EPOnly(mesh))  # RoutedExperts.parallelize wires the EP mesh
        results[name] = _run(module, x, scores, ids, E_EP)
    return results


def test_expert_parallel_two_ranks_gloo():
    results = run_ranks(2, "test_torchtitan.ep_scenario", BACKEND)
    for r, res in enumerate(results):
        for name, want in res["stock"].items():
            assert torch.equal(res["dispatcher"][name], want), f"rank {r}: {name}"
            assert_close(f"rank {r}: {name}", res["fused"][name].float(), want.float())


def parallelized_moe_scenario(rank: int, world: int, group, backend: str) -> dict:
    """A whole MoE parallelized by torchtitan (ParallelDims with EP = world, its MoE sharding
    config, experts sharded on dim 0 as DTensors), stock and with mok_routed_experts."""
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    tt_dist_utils.set_spmd_backend("partial_dtensor")
    # torchtitan fixes its device type at import, "cuda" where none is found
    tt_parallel_dims.device_type = "cpu"
    g = torch.Generator().manual_seed(rank)
    x_BLD = torch.randn(1, 9 + 4 * rank, D, generator=g)
    dy = torch.randn(x_BLD.shape, generator=g)
    results = {}
    for name in ("stock", "mok"):
        dims = ParallelDims(
            dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world, spmd_backend="partial_dtensor"
        )
        dims.build_mesh()
        cfg = _moe_config(E_EP, K_EP)
        layout = {"w1_EFD": Shard(1), "w2_EDF": Shard(2), "w3_EFD": Shard(1)}
        set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False, expert_param_layout=layout)
        if name == "mok":
            imports = [("mok_torch.integrations.torchtitan.mok_routed_experts", {"backend": backend})]
            apply_overrides(OverrideConfig(imports=imports), cfg)
        moe = cfg.build()
        torch.manual_seed(0)  # every rank the same full weights; parallelize keeps each rank's shard
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape) * 0.1)
        moe.parallelize(dims)
        assert isinstance(moe.routed_experts, MoKRoutedExperts) == (name == "mok")
        x = x_BLD.clone().requires_grad_()
        y = moe(x)
        y.backward(dy)
        res = {"y": y.detach(), "dx": x.grad}
        for n, p in moe.named_parameters():
            res["d" + n] = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        results[name] = res
    return results


def test_parallelized_moe_two_ranks_gloo():
    for r, res in enumerate(run_ranks(2, "test_torchtitan.parallelized_moe_scenario", BACKEND)):
        assert res["mok"].keys() == res["stock"].keys()
        for name, want in res["stock"].items():
            assert_close(f"rank {r}: {name}", res["mok"][name].float(), want.float())
