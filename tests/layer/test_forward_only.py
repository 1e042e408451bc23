"""mok.moe where no gradient can be asked for (autograd off, as under torch.no_grad or
inference_mode, or no input that requires one): the forward alone with no context kept
(ops.run_forward_only), y bit for bit the autograd call's. On every backend; the megakernel's
launch without a context is tested in tests/bf16/test_megakernel.py.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import DEVICE, config

import mok_torch as mok
from mok_torch import functional, ops
from mok_torch.backends.native import expert_path, megakernel
from mok_torch.testing import make_inputs

CASES = [
    pytest.param(64, 32, 16, 4, 2, 0, "balanced", id="balanced"),
    pytest.param(1, 32, 16, 4, 1, 0, "worst", id="one-token-K1"),
    pytest.param(37, 32, 16, 8, 2, 16, "skewed", id="odd-T-shared"),
]
MODES = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "no input requires grad": contextlib.nullcontext,
}


@pytest.mark.parametrize("T,H,I,E,K,Is,routing", CASES)
@pytest.mark.parametrize("mode", list(MODES))
def test_moe_without_autograd_is_the_forward_alone(T, H, I, E, K, Is, routing, mode, monkeypatch):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T).to(DEVICE)
    cfg = config(expert_alignment=8)
    leaves = [t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.router_weights_TK, *inp.routed)]
    want = mok.moe(leaves[0], inp.top_experts_TK, leaves[1], tuple(leaves[2:]), inp.shared, config=cfg)
    assert want.grad_fn is not None  # through autograd: a context kept
    calls = []

    def forward_only(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    real = ops.run_forward_only
    monkeypatch.setattr(ops, "run_forward_only", forward_only)
    for _ in range(2):  # the second call is one whose checks passed before (validation.call_signature)
        with MODES[mode]():
            got = mok.moe(inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed, inp.shared, config=cfg)
        assert got.grad_fn is None and not got.requires_grad
        assert torch.equal(got, want.detach()), f"{mode}: y differs from the autograd call's"
    assert len(calls) == 2, "both calls ran the forward alone"
    # Grad on with an input that requires one: through autograd again, not the forward alone.
    again = mok.moe(leaves[0], inp.top_experts_TK, leaves[1], tuple(leaves[2:]), inp.shared, config=cfg)
    assert len(calls) == 2 and again.grad_fn is not None


def test_schedule_and_forward_without_context_returns_none(monkeypatch):
    """The functional call under mok.moe: with context=False no context comes back (a backend may
    skip what only the backward reads), y is the call's with one, and the schedule is that call's
    too, or None where nothing reads it: the native backend's megakernel at one rank issues only
    the table, the megakernel and the combine."""
    inp = make_inputs(40, 32, 16, 4, 2, 0, "skewed", seed=1).to(DEVICE)
    cfg = config(expert_alignment=8)
    ws = mok.create_workspace(cfg, None, device=DEVICE, max_tokens=40, hidden_size=32, topk=2, num_experts=4)
    args = (inp.top_experts_TK, inp.x_TH, inp.router_weights_TK, inp.routed, None, None)
    sched, y, ctx = functional._schedule_and_forward(cfg, ws, *args)
    one_calls = []
    real = megakernel.forward_call
    monkeypatch.setattr(megakernel, "forward_call", lambda *a, **kw: one_calls.append(1) or real(*a, **kw))
    sched2, y2, none = functional._schedule_and_forward(cfg, ws, *args, context=False)
    assert ctx is not None and none is None
    assert torch.equal(y, y2)
    lane = ctx.backend in ("cpu", "cuda") and expert_path(cfg, ws, 16).forward == "megakernel"
    if lane:
        assert sched2 is None, "the megakernel's forward alone makes no schedule"
        assert one_calls == [1], "the table, the megakernel and the combine in one extension call"
    else:
        assert sched2 is not None and torch.equal(sched.expert_offsets_El1, sched2.expert_offsets_El1)
    # The next call's schedule is whole: the table's launch of the call without one left nothing behind.
    sched3, y3, _ = functional._schedule_and_forward(cfg, ws, *args)
    assert torch.equal(y3, y)
    for name in ("expert_offsets_El1", "row_route_C", "route_row_TK", "top_experts_TK"):
        assert torch.equal(getattr(sched3, name), getattr(sched, name)), name
