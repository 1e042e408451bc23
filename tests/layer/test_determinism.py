"""The determinism contract (docs/determinism.md), bitwise, in one process."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKEND,
    CONTRACT_KEYS,
    DEVICE,
    assert_bitwise,
    assert_fused_forward_is_the_two_calls,
    config,
    run_functional,
)

import mok_torch as mok
from mok_torch.testing import make_inputs

SHAPES = [
    pytest.param(45, 64, 32, 8, 2, 16, "balanced", id="balanced-shared"),
    pytest.param(30, 32, 48, 8, 3, 0, "skewed", id="skewed"),
    pytest.param(20, 32, 16, 4, 2, 0, "worst", id="worst"),
]

# Every knob the contract says cannot change a bit (minibatch/macrobatch force ring replay).
CONFIGS = [
    dict(expert_alignment=8),
    dict(expert_alignment=8, minibatch_size=8),
    dict(expert_alignment=8, minibatch_size=8, macrobatch_size=16),
    dict(expert_alignment=8, minibatch_size=16, macrobatch_size=48),
    dict(expert_alignment=1, minibatch_size=5, macrobatch_size=15),
    dict(expert_alignment=128),
    dict(expert_alignment=16, macrobatch_size=32),
    dict(expert_alignment=8, fwd_num_comm_sms=40, bwd_num_comm_sms=28),
    dict(expert_alignment=8, minibatch_size=8, macrobatch_size=16, dispatch="push", combine="pull"),
]


@pytest.mark.parametrize("T,H,I,E,K,Is,routing", SHAPES)
def test_run_to_run_bitwise(T, H, I, E, K, Is, routing):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=1)
    cfg = config(expert_alignment=8, minibatch_size=8, macrobatch_size=16)
    first, second = run_functional(inp, cfg), run_functional(inp, cfg)
    assert_bitwise(first, second, tuple(first))  # every output, shared-expert gradients too


@pytest.mark.parametrize("T,H,I,E,K,Is,routing", SHAPES)
def test_config_invariance(T, H, I, E, K, Is, routing):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=2)
    base = run_functional(inp, config(**CONFIGS[0]))
    keys = CONTRACT_KEYS + (("dWg_s", "dWu_s", "dWd_s") if Is else ())
    for kw in CONFIGS[1:]:
        assert_bitwise(base, run_functional(inp, config(**kw)), keys, what=f"{kw}: ")


def test_replay_really_happens():
    """A ring smaller than the rows keeps only macrobatch 0 (so the invariance above covers replay)."""
    inp = make_inputs(40, 32, 16, 4, 2, 0, "worst", seed=4)
    full = run_functional(inp, config(expert_alignment=8))
    ring = run_functional(inp, config(expert_alignment=8, minibatch_size=8, macrobatch_size=16))
    # all 80 routed rows are kept (the cuda backend walks its whole static capacity instead)
    assert int(full["saved_rows"]) == 80 or (BACKEND == "cuda" and int(full["saved_rows"]) > 80)
    assert int(ring["saved_rows"]) == 16


def test_wgrad_fp32_is_the_unrounded_accumulator():
    """fp32 weight gradients round to exactly the bf16 ones (one rounding, at the end)."""
    inp = make_inputs(30, 32, 16, 4, 2, 8, "balanced", seed=6)
    bf = run_functional(inp, config(expert_alignment=8))
    f32 = run_functional(inp, config(expert_alignment=8), wgrad_dtype=torch.float32)
    for k in ("dWg", "dWu", "dWd", "dWg_s", "dWu_s", "dWd_s"):
        assert f32[k].dtype == torch.float32
        assert torch.equal(f32[k].to(torch.bfloat16), bf[k]), k


def test_batch_invariance():
    """A token's output does not depend on which other tokens are in the batch."""
    inp = make_inputs(48, 64, 32, 8, 2, 16, "balanced", seed=7)
    whole = run_functional(inp, config(expert_alignment=8))
    for part in (slice(0, 1), slice(5, 22), slice(31, 48)):
        sub = run_functional(inp, config(expert_alignment=8), tokens=part)
        assert torch.equal(sub["y"], whole["y"][part]), part


def test_recompute_forward_context_matches_forward():
    inp = make_inputs(40, 32, 16, 4, 2, 8, "skewed", seed=8).to(DEVICE)
    cfg = config(expert_alignment=8, minibatch_size=8, macrobatch_size=24)
    ws = mok.get_workspace(cfg, None, device=DEVICE, max_tokens=40, hidden_size=32, topk=2, num_experts=4)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    _, ctx = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    again = mok.recompute_forward_context(cfg, ws, sched, inp.x_TH, inp.routed, inp.shared)
    for name in ("x_routed_MH", "a_MI", "b_MI", "shared_a_TIs", "shared_b_TIs"):
        assert torch.equal(getattr(ctx, name), getattr(again, name)), name
    assert ctx.saved_bytes() == again.saved_bytes() > 0
    # backward from the recomputed context gives the same gradients
    g1 = mok.backward(cfg, ws, sched, ctx, inp.dy_TH, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    g2 = mok.backward(cfg, ws, sched, again, inp.dy_TH, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(tuple(g1)), torch.utils._pytree.tree_leaves(tuple(g2)), strict=True
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "T,H,I,E,K,Is,routing", SHAPES + [pytest.param(1, 32, 16, 4, 1, 0, "worst", id="one-token-K1")]
)
def test_schedule_and_forward_is_build_schedule_then_forward(T, H, I, E, K, Is, routing):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + 5)
    assert_fused_forward_is_the_two_calls(inp, config(expert_alignment=8))


@pytest.mark.parametrize(
    "kw", [dict(expert_alignment=8), dict(expert_alignment=8, minibatch_size=8, macrobatch_size=16)]
)
def test_calls_in_flight_eager_and_custom_ops(kw):
    """Two mok.moe calls before either backward (gradient checkpointing, microbatches in flight):
    each call's gradients are its own, and mok.moe's eager path (autograd.Layer) gives the bits of
    the custom ops that torch.compile traces (torch.ops.mok.*, called here as mok.moe does there)."""
    cfg = config(**kw)
    first = make_inputs(30, 32, 16, 4, 2, 8, "skewed", seed=21).to(DEVICE)
    second = make_inputs(30, 32, 16, 4, 2, 8, "balanced", seed=22).to(DEVICE)
    E = 4

    def leaves(inp):
        return [
            t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.router_weights_TK, *inp.routed, *inp.shared)
        ]

    def eager(inp, p):
        return mok.moe(p[0], inp.top_experts_TK, p[1], tuple(p[2:5]), tuple(p[5:8]), config=cfg, max_tokens=30)

    def custom_ops(inp, p):
        H = p[0].shape[1]
        sched = torch.ops.mok.build_schedule(inp.top_experts_TK, "", 30, H, E, cfg.key)
        out = torch.ops.mok.forward(p[0], p[1], *p[2:8], sched, inp.top_experts_TK, "", 30, cfg.key)
        return out[0]

    results = {}
    for name, fn in (("eager", eager), ("custom ops", custom_ops)):
        pa, pb = leaves(first), leaves(second)
        ya, yb = fn(first, pa), fn(second, pb)  # both forwards, then both backwards
        yb.backward(second.dy_TH)
        ya.backward(first.dy_TH)
        results[name] = [ya.detach(), yb.detach()] + [t.grad for t in pa + pb]
    for (name, ref), alone in zip((("first", first), ("second", second)), (0, 1), strict=True):
        p = leaves(ref)
        y = eager(ref, p)
        y.backward(ref.dy_TH)
        got = results["eager"]
        assert torch.equal(got[alone], y.detach()), f"{name} call's y with another call in flight"
        grads = got[2 + 8 * alone : 10 + 8 * alone]
        for i, (g, want) in enumerate(zip(grads, [t.grad for t in p], strict=True)):
            assert g is not None and torch.equal(g, want), f"{name} call's gradient {i} with another call in flight"
    for a, b in zip(results["eager"], results["custom ops"], strict=True):
        assert torch.equal(a, b), "eager mok.moe and the custom ops differ"
