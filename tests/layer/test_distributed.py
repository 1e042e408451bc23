"""Expert parallelism across processes: EP 2, 4 and 8 give bitwise the results of EP 1.

The same global batch is split into contiguous, uneven slices (one rank may bring no token
at all); outputs and input gradients are concatenated over ranks in token order, routed
weight gradients over ranks in expert order, and compared bitwise with one process holding
every expert. Runs on gloo (CPU) by default and on NCCL with MOK_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BACKEND, DEVICE, assert_bitwise, config, run_functional
from multiproc import run_ranks

import mok_torch as mok
from mok_torch.testing import make_inputs

pytestmark = pytest.mark.multiprocess

T_GLOBAL = 45
SPLITS = {1: [45], 2: [20, 25], 4: [10, 0, 20, 15], 8: [6, 6, 0, 6, 6, 6, 6, 9]}
SHAPE = dict(num_tokens=T_GLOBAL, hidden_size=32, intermediate_size=16, num_experts=8, topk=2)
CONFIGS = [
    dict(expert_alignment=8),
    dict(expert_alignment=8, minibatch_size=8, macrobatch_size=16),
    dict(expert_alignment=32, minibatch_size=32, macrobatch_size=64),
]
ROUTINGS = ("balanced", "skewed", "worst")


def _slice(world: int, rank: int) -> slice:
    start = sum(SPLITS[world][:rank])
    return slice(start, start + SPLITS[world][rank])


def functional_scenarios(rank: int, world: int, group, device: str) -> dict:
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    out = {}
    for routing in ROUTINGS:
        inp = make_inputs(**SHAPE, shared_intermediate_size=8, routing=routing, seed=11)
        for i, kw in enumerate(CONFIGS):
            out[(routing, i)] = run_functional(
                inp,
                config(**kw),
                group=group,
                rank=rank,
                world=world,
                tokens=_slice(world, rank),
                max_tokens=T_GLOBAL,
                device=dev,
            )
    return out


def layer_scenario(rank: int, world: int, group, device: str) -> dict:
    """moe()/MoELayer with autograd over the group, the token count agreed by all-reduce."""
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    layer = mok.MoELayer(
        32, 16, 8, 2, shared_intermediate_size=8, group=group, config=config(expert_alignment=8), device=dev
    )
    # The same global weights at every EP size: each rank copies its experts' slice.
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(8, *p.shape[1:], generator=g) / 4 for p in (layer.gate_proj, layer.up_proj, layer.down_proj)]
    El = layer.num_local_experts
    with torch.no_grad():
        for p, w in zip((layer.gate_proj, layer.up_proj, layer.down_proj), full, strict=True):
            p.copy_(w[rank * El : (rank + 1) * El])
        for p in (layer.router.weight, *layer.shared_weights):
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    x = (torch.randn(T_GLOBAL, 32, generator=g)[_slice(world, rank)]).to(dev).requires_grad_()
    dy = torch.randn(T_GLOBAL, 32, generator=g)[_slice(world, rank)].to(dev)
    y = layer(x)
    (y * dy).sum().backward()
    return {
        "y": y.detach().cpu(),
        "dx": x.grad.cpu(),
        "dWg": layer.gate_proj.grad.cpu(),
        "dWu": layer.up_proj.grad.cpu(),
        "dWd": layer.down_proj.grad.cpu(),
        "top": layer.last_top_experts.cpu(),
    }


def _merge(results: list[dict], token_keys=("y", "dx", "d_router_weights"), expert_keys=("dWg", "dWu", "dWd")) -> dict:
    merged = {k: torch.cat([r[k] for r in results]) for k in token_keys if k in results[0]}
    merged.update({k: torch.cat([r[k] for r in results]) for k in expert_keys})
    return merged


@pytest.fixture(scope="module")
def ep1_functional():
    return functional_scenarios(0, 1, None, DEVICE)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_functional_ep_invariance(world, ep1_functional):
    if DEVICE == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"EP {world} on CUDA needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    per_rank = run_ranks(world, "test_distributed.functional_scenarios", DEVICE, device=DEVICE)
    for key, base in ep1_functional.items():
        merged = _merge([r[key] for r in per_rank])
        assert_bitwise(base, merged, what=f"EP {world} {key}: ")
        # the shared expert's gradients depend on the rank-local batch only; EP 1 has them
        # for the whole batch, so check each rank against a one-rank run of its own slice
    assert per_rank[0][("balanced", 0)]["saved_rows"].item() >= 0


@pytest.mark.parametrize("world", [2, 4])
def test_layer_autograd_ep_invariance(world):
    if DEVICE == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"EP {world} on CUDA needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    base = layer_scenario(0, 1, None, DEVICE)
    merged = _merge(
        run_ranks(world, "test_distributed.layer_scenario", DEVICE, device=DEVICE), token_keys=("y", "dx", "top")
    )
    assert torch.equal(base["top"], merged["top"])
    assert_bitwise(base, merged, keys=("y", "dx", "dWg", "dWu", "dWd"), what=f"EP {world} MoELayer: ")


def shared_grad_scenario(rank: int, world: int, group, device: str) -> dict:
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    inp = make_inputs(**SHAPE, shared_intermediate_size=8, routing="balanced", seed=12)
    return run_functional(
        inp,
        config(expert_alignment=8),
        group=group,
        rank=rank,
        world=world,
        tokens=_slice(world, rank),
        max_tokens=T_GLOBAL,
        device=dev,
    )


def test_shared_expert_grads_are_rank_local():
    """Shared-expert weight gradients equal a one-rank run over the same rank-local batch."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    per_rank = run_ranks(2, "test_distributed.shared_grad_scenario", DEVICE, device=DEVICE)
    inp = make_inputs(**SHAPE, shared_intermediate_size=8, routing="balanced", seed=12)
    for rank, res in enumerate(per_rank):
        alone = run_functional(inp, config(expert_alignment=8), tokens=_slice(2, rank), max_tokens=T_GLOBAL)
        assert_bitwise(alone, res, keys=("dWg_s", "dWu_s", "dWd_s", "y"), what=f"rank {rank}: ")


def test_backend_is_the_one_requested():
    assert BACKEND in mok.available_backends("bf16", DEVICE)
