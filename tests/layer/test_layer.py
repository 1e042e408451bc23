"""MoELayer: the router, the layer against the float64 loop, router replay, dtypes."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, assert_close, config
from reference.moe_loop import moe_loop

import mok_torch as mok


def _layer(**kw):
    torch.manual_seed(0)
    kw.setdefault("config", config(expert_alignment=8))
    return mok.MoELayer(32, 16, 8, 2, device=DEVICE, **kw)


def test_stable_topk_breaks_ties_by_lower_id():
    scores = torch.tensor([[0.5, 0.2, 0.5, 0.5], [0.1, 0.1, 0.1, 0.1]])
    assert mok.stable_topk(scores, 2).tolist() == [[0, 2], [0, 1]]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("Is", [0, 8])
def test_layer_matches_loop(score_func, Is):
    layer = _layer(score_func=score_func, shared_intermediate_size=Is)
    x = torch.randn(3, 7, 32, device=DEVICE, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    # the float64 loop runs on the CPU
    top = layer.last_top_experts.reshape(-1, 2).cpu()
    x_cpu, router_cpu = x.detach().reshape(-1, 32).cpu(), layer.router.weight.detach().cpu()
    _, w = mok.route(torch.nn.functional.linear(x_cpu, router_cpu), 2, score_func=score_func, top_experts_TK=top)
    bf = lambda t: t.detach().to(torch.bfloat16).cpu()  # noqa: E731
    shared = None if Is == 0 else tuple(bf(p) for p in layer.shared_weights)
    routed = tuple(bf(p) for p in layer.routed_weights)
    want = moe_loop(bf(x).reshape(-1, 32), top, w, routed, shared, bf(dy).reshape(-1, 32))
    assert_close("y", y.reshape(-1, 32), want.y)
    # x also reaches the loss through the router: add that path, in float64, by autograd
    x64 = x_cpu.double().requires_grad_()
    _, w64 = mok.route(
        torch.nn.functional.linear(x64, router_cpu.double()), 2, score_func=score_func, top_experts_TK=top
    )
    (router_dx,) = torch.autograd.grad(w64.double(), x64, want.d_router_weights)
    assert_close("dx", x.grad.reshape(-1, 32), want.dx + router_dx)
    for p, g in zip(layer.routed_weights, want.d_routed, strict=True):
        assert p.grad.dtype == torch.float32  # fp32 parameters get fp32 gradients
        assert_close("dW", p.grad, g)
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_router_replay():
    layer = _layer()
    x = torch.randn(20, 32, device=DEVICE)
    y = layer(x)
    recorded = layer.last_top_experts.clone()
    assert torch.equal(layer(x, top_experts=recorded), y)
    # perturb the router: the live choice changes, the replayed one does not
    with torch.no_grad():
        layer.router.weight.add_(torch.randn_like(layer.router.weight))
    layer(x)
    assert not torch.equal(layer.last_top_experts, recorded)
    layer.zero_grad()
    replayed = layer(x, top_experts=recorded)
    assert torch.equal(layer.last_top_experts, recorded)
    replayed.sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0  # gradients still reach the router


def test_bf16_parameters_and_empty_batch():
    layer = _layer(dtype=torch.bfloat16)
    x = torch.randn(0, 32, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert layer.gate_proj.grad.dtype == torch.bfloat16
    assert layer.gate_proj.grad.abs().sum() == 0


def test_repr_and_parameters():
    layer = _layer(shared_intermediate_size=8)
    assert "num_experts=8 (8 local)" in repr(layer)
    names = {n for n, _ in layer.named_parameters()}
    assert names == {
        "router.weight",
        "gate_proj",
        "up_proj",
        "down_proj",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
    }


class _TwoMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        cfg = config(expert_alignment=8)
        self.a = mok.MoELayer(32, 16, 8, 2, config=cfg, device=DEVICE)
        self.b = mok.MoELayer(32, 16, 8, 2, config=cfg, score_func="sigmoid", device=DEVICE)

    def forward(self, x):
        h = x + self.a(x)
        return h + self.b(h) + self.b(h * 0.5)  # layer b is called twice per forward


def test_record_and_replay_whole_model():
    model = _TwoMoE()
    x = torch.randn(12, 32, device=DEVICE)
    with mok.record_routing(model) as record:
        y = model(x)
    assert [len(record["a"]), len(record["b"])] == [1, 2]
    with mok.replay_routing(model, record):
        assert torch.equal(model(x), y)  # same weights, same choice: same bits
    with torch.no_grad():  # the router drifts (as it does between a rollout and training)
        for layer in (model.a, model.b):
            layer.router.weight.add_(torch.randn_like(layer.router.weight))
    model(x)
    assert not torch.equal(model.a.last_top_experts, record["a"][0])
    model.zero_grad()
    with mok.replay_routing(model, record):
        out = model(x)
        assert torch.equal(model.a.last_top_experts, record["a"][0])
        assert torch.equal(model.b.last_top_experts, record["b"][1])
    out.sum().backward()
    assert model.a.router.weight.grad.abs().sum() > 0 and model.b.router.weight.grad.abs().sum() > 0
    assert model.a._replay is None  # the context cleaned up
    with pytest.raises(ValueError, match="called more often"), mok.replay_routing(model, {"a": [], "b": []}):
        model(x)
    with pytest.raises(ValueError, match="no routing for layer"), mok.replay_routing(model, {"a": record["a"]}):
        pass
