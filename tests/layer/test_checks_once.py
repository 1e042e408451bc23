"""A call like one that passed its checks skips the metadata checks (validation.call_signature),
and nothing else: every bad argument still raises as on a first call, values read on the host are
still checked, an unusable or dropped workspace is never used, and the bits are the same."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, config

import mok_torch as mok
from mok_torch import functional
from mok_torch.testing import make_inputs
from mok_torch.validation import call_signature
from mok_torch.workspace import cached_workspaces

T, H, I, E, K = 12, 32, 16, 4, 2


def _moe(inp, cfg, **over):
    args = dict(
        x=inp.x_TH, top_experts=inp.top_experts_TK, router_weights=inp.router_weights_TK, routed=inp.routed, config=cfg
    )
    args.update(over)
    return mok.moe(**args)


def test_call_signature_tells_apart_what_the_checks_read():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    base = call_signature(x, None, (x, x))
    assert base == call_signature(torch.ones(4, 8, dtype=torch.bfloat16), None, [x, x])
    for other in (x.float(), x[:, :4], x.t(), x[:3], x.to("meta")):
        assert call_signature(other, None, (x, x)) != base
    assert call_signature(x, x, (x, x)) != base
    assert call_signature(x, None, (x, x, x)) != base
    assert call_signature(x, None, (x, "w")) is None
    assert call_signature(x.tolist(), None) is None


@pytest.mark.parametrize(
    ("over", "exc", "msg"),
    [
        (lambda i: {"x": i.x_TH.long()}, TypeError, "x must have dtype"),
        (lambda i: {"top_experts": i.top_experts_TK[:-1]}, ValueError, "top_experts must have shape"),
        (lambda i: {"router_weights": i.router_weights_TK[:, :1]}, ValueError, "router_weights must have shape"),
        (lambda i: {"router_weights": i.router_weights_TK.long()}, TypeError, "router_weights must have dtype"),
        (lambda i: {"routed": i.routed[:2]}, TypeError, "routed must be a tuple"),
        (lambda i: {"routed": (i.routed[0], i.routed[1], i.routed[2][:, :, :-1])}, ValueError, "routed"),
        (lambda i: {"top_experts": i.top_experts_TK + E}, ValueError, "outside"),
    ],
)
def test_moe_after_a_good_call_still_rejects(over, exc, msg):
    inp = make_inputs(T, H, I, E, K, 0, seed=0).to(DEVICE)
    cfg = config(expert_alignment=8)
    for _ in range(2):  # the good call's signature is known after the first
        _moe(inp, cfg, max_tokens=T)
    with pytest.raises(exc, match=msg):
        _moe(inp, cfg, max_tokens=T, **over(inp))
        mok.check_errors()  # (a bad id: on a GPU the native schedule kernel finds it, raised here)


def test_functional_after_a_good_call_still_rejects():
    inp = make_inputs(T, H, I, E, K, 0, seed=1).to(DEVICE)
    cfg = config(expert_alignment=8)
    ws = mok.create_workspace(cfg, None, device=DEVICE, max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    args = (inp.top_experts_TK, inp.x_TH, inp.router_weights_TK, inp.routed)
    _, y, _ = functional.schedule_and_forward(cfg, ws, *args)
    _, again, _ = functional.schedule_and_forward(cfg, ws, *args)
    assert torch.equal(again, y)
    with pytest.raises(ValueError, match="outside"):  # a value: read on every call (or on the device)
        functional.schedule_and_forward(cfg, ws, inp.top_experts_TK.clone().fill_(E), *args[1:])
        mok.check_errors(ws)
    with pytest.raises(ValueError, match="expert_alignment"):  # another config: checked in full
        functional.schedule_and_forward(config(expert_alignment=16), ws, *args)
    ws.state["broken"] = "a wait that timed out (a test)"
    with pytest.raises(RuntimeError, match="unusable"):
        functional.schedule_and_forward(cfg, ws, *args)


def test_moe_never_uses_a_dropped_workspace():
    inp = make_inputs(T, H, I, E, K, 0, seed=2).to(DEVICE)
    cfg = config(expert_alignment=8)
    y = _moe(inp, cfg, max_tokens=T)
    (ws,) = [w for w in cached_workspaces() if w.max_tokens == T and w.hidden_size == H]
    mok.clear_workspace_cache()
    assert torch.equal(_moe(inp, cfg, max_tokens=T), y)
    (fresh,) = [w for w in cached_workspaces() if w.max_tokens == T and w.hidden_size == H]
    assert fresh is not ws, "the call after the cache was cleared got its workspace from get_workspace"


def test_backward_after_a_good_call_still_rejects():
    inp = make_inputs(T, H, I, E, K, 0, seed=3).to(DEVICE)
    cfg = config(expert_alignment=8)
    ws = mok.create_workspace(cfg, None, device=DEVICE, max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    _, ctx = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed)
    args = (inp.x_TH, inp.router_weights_TK, inp.routed)
    first = mok.backward(cfg, ws, sched, ctx, inp.dy_TH, *args)
    again = mok.backward(cfg, ws, sched, ctx, inp.dy_TH, *args)
    assert torch.equal(first.dx, again.dx) and torch.equal(first.d_routed[0], again.d_routed[0])
    with pytest.raises(TypeError, match="dy must have dtype"):
        mok.backward(cfg, ws, sched, ctx, inp.dy_TH.float(), *args)
    with pytest.raises(ValueError, match="dy must have shape"):
        mok.backward(cfg, ws, sched, ctx, inp.dy_TH[:, :-1].contiguous(), *args)
    with pytest.raises(ValueError, match="another schedule"):  # identities: checked on every call
        mok.backward(cfg, ws, mok.build_schedule(ws, cfg, inp.top_experts_TK), ctx, inp.dy_TH, *args)
    short = mok.build_schedule(ws, cfg, inp.top_experts_TK[:-1])  # another T: the same signature is no pass
    with pytest.raises(ValueError, match="x must have shape"):
        mok.backward(cfg, ws, short, ctx, inp.dy_TH, *args)
    ws.state["broken"] = "a wait that timed out (a test)"
    with pytest.raises(RuntimeError, match="unusable"):
        mok.backward(cfg, ws, sched, ctx, inp.dy_TH, *args)


def test_int64_routes_past_int32_stay_bad_ids():
    """The native backend's int32 routes (the transport's field across ranks, the schedule's
    top_experts): an int64 id past int32 reads as the nearest int32, an id of no expert, never one
    wrapped onto a valid expert (2^32 + 1 would wrap to 1)."""
    from mok_torch.backends.native import _int32_routes

    top = torch.tensor([[0, 2**32 + 1], [-(2**40), 3]], dtype=torch.int64)
    assert _int32_routes(top).tolist() == [[0, 2**31 - 1], [-(2**31), 3]]
    assert _int32_routes(top).dtype == torch.int32
    same = torch.tensor([[1, 2]], dtype=torch.int32)
    assert _int32_routes(same) is same
