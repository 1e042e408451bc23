"""The layer against the float64 per-token loop, over awkward shapes and routings."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, config, run_functional
from reference.moe_loop import moe_loop

from mok_torch.testing import make_inputs

# (T, H, I, E, K, Is, routing, swiglu_limit)
CASES = [
    pytest.param(37, 64, 32, 8, 2, 0, "balanced", None, id="odd-T"),
    pytest.param(1, 64, 32, 4, 1, 16, "balanced", None, id="one-token-K1-shared"),
    pytest.param(50, 32, 64, 8, 4, 32, "skewed", None, id="skewed-shared"),
    pytest.param(40, 64, 32, 8, 2, 0, "worst", None, id="worst-case"),
    pytest.param(24, 32, 16, 16, 3, 0, "sparse", None, id="empty-experts"),
    pytest.param(33, 64, 32, 8, 2, 24, "balanced", 0.25, id="swiglu-limit"),
    pytest.param(16, 64, 32, 4, 4, 0, "balanced", None, id="K-equals-E"),
]


@pytest.mark.parametrize("T,H,I,E,K,Is,routing,limit", CASES)
def test_matches_fp64_loop(T, H, I, E, K, Is, routing, limit):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + E)
    got = run_functional(inp, config(expert_alignment=8, swiglu_limit=limit), wgrad_dtype=torch.float32)
    want = moe_loop(inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed, inp.shared, inp.dy_TH, limit)
    assert_close("y", got["y"], want.y)
    assert_close("dx", got["dx"], want.dx)
    assert_close("d_router_weights", got["d_router_weights"], want.d_router_weights)
    for name, g, w in zip(("dWg", "dWu", "dWd"), (got["dWg"], got["dWu"], got["dWd"]), want.d_routed, strict=True):
        assert_close(name, g, w)
    if Is:
        for name, w in zip(("dWg_s", "dWu_s", "dWd_s"), want.d_shared, strict=True):
            assert_close(name, got[name], w)


def test_swiglu_limit_bites():
    """With a small limit the clamp changes the result (so the limit test tests something)."""
    inp = make_inputs(33, 64, 32, 8, 2, 0, "balanced", seed=3)
    free = run_functional(inp, config(expert_alignment=8))
    clamped = run_functional(inp, config(expert_alignment=8, swiglu_limit=0.25))
    assert not torch.equal(free["y"], clamped["y"])
    assert not torch.equal(free["dWg"], clamped["dWg"])


def test_zero_router_weight_gets_exact_gradient():
    """d_w = <g, h> needs no division by w: a route with w = 0 still gets its gradient."""
    inp = make_inputs(12, 32, 16, 4, 2, 0, "balanced", seed=5)
    inp.router_weights_TK[:, 1] = 0.0
    got = run_functional(inp, config(expert_alignment=8), wgrad_dtype=torch.float32)
    want = moe_loop(inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed, inp.shared, inp.dy_TH)
    assert got["d_router_weights"][:, 1].abs().sum() > 0
    assert_close("d_router_weights", got["d_router_weights"], want.d_router_weights)
