"""torch.compile(fullgraph=True) over MoELayer, and opcheck of every mok custom op."""

from __future__ import annotations

import pytest
import torch
from helpers import BACKEND, DEVICE, assert_close, config

import mok_torch as mok
from mok_torch.testing import make_inputs

T, H, I, E, K, Is = 10, 32, 16, 4, 2, 8


def _op_args(requires_grad: bool):
    inp = make_inputs(T, H, I, E, K, Is, seed=3).to(DEVICE)
    cfg = config(expert_alignment=8, minibatch_size=8, macrobatch_size=16)
    grad = lambda t: t.detach().clone().requires_grad_(requires_grad)  # noqa: E731
    sched = torch.ops.mok.build_schedule(inp.top_experts_TK, "", 16, H, E, cfg.key)
    fwd = (
        grad(inp.x_TH),
        grad(inp.router_weights_TK),
        *(grad(w) for w in inp.routed),
        *(grad(w) for w in inp.shared),
        sched,
        inp.top_experts_TK,
        "",
        16,
        cfg.key,
    )
    return inp, cfg, sched, fwd


def test_opcheck_build_schedule():
    inp, cfg, _, _ = _op_args(False)
    torch.library.opcheck(torch.ops.mok.build_schedule.default, (inp.top_experts_TK, "", 16, H, E, cfg.key))


def test_opcheck_forward_with_autograd():
    _, _, _, fwd = _op_args(True)
    torch.library.opcheck(torch.ops.mok.forward.default, fwd)


def test_opcheck_forward_only():
    inp, cfg, _, fwd = _op_args(False)
    torch.library.opcheck(torch.ops.mok.forward_only.default, (*fwd[:8], inp.top_experts_TK, "", 16, cfg.key))


def test_opcheck_backward():
    inp, cfg, _, fwd = _op_args(False)
    outs = torch.ops.mok.forward(*fwd)
    args = (inp.dy_TH, *fwd[:9], inp.top_experts_TK, outs[1:], "", 16, cfg.key)
    torch.library.opcheck(torch.ops.mok.backward.default, args)


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = config(expert_alignment=8)
        self.norm = torch.nn.LayerNorm(H, device=DEVICE)
        self.moe1 = mok.MoELayer(H, I, E, K, shared_intermediate_size=Is, config=cfg, device=DEVICE)
        self.moe2 = mok.MoELayer(H, I, E, K, config=cfg, score_func="sigmoid", device=DEVICE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.moe1(self.norm(x))
        return h + self.moe2(h)


def _step(model, x, fn=None):
    model.zero_grad(set_to_none=True)
    y = (model if fn is None else fn)(x)
    (y.float().square().mean()).backward()
    return y.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    model = TwoLayers()
    x = torch.randn(3, 5, H, device=DEVICE)
    y_eager, g_eager = _step(model, x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y1, g1 = _step(model, x, compiled)
    y2, g2 = _step(model, x, compiled)
    assert torch.equal(y1, y2) and all(torch.equal(g1[n], g2[n]) for n in g1)  # compiled: bitwise repeatable
    if backend == "aot_eager":  # same kernels as eager: same bits
        assert torch.equal(y1, y_eager) and all(torch.equal(g1[n], g_eager[n]) for n in g1)
    else:  # inductor fuses the non-MoE ops differently: compare within tolerance
        assert_close("y", y1, y_eager.double())
        for n in g1:
            assert_close(n, g1[n], g_eager[n].double())


def test_compile_without_fullgraph_has_no_graph_break():
    """torch.compile without fullgraph=True (the usual call) traces two MoE layers, forward and
    backward, into one graph: no op of mok's has a data-dependent output shape (mok::forward's
    context has the table's capacity of rows), at which dynamo would break the graph (session 30:
    seven breaks for two layers, and a compiled step slower than the eager one)."""
    model = TwoLayers()
    x = torch.randn(3, 5, H, device=DEVICE)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1
    y_eager, g_eager = _step(model, x)
    y, g = _step(model, x, torch.compile(model, backend="aot_eager"))
    assert torch.equal(y, y_eager) and all(torch.equal(g[n], g_eager[n]) for n in g)


def test_compile_without_autograd_keeps_no_context(monkeypatch):
    """Compiled and called under torch.no_grad, each layer runs `mok::forward_only` (the schedule
    and the forward in one op, no context kept: what mok.moe runs eagerly without autograd), not
    `mok::forward`; y bitwise the eager call's, with and without autograd."""
    from mok_torch import ops

    model = TwoLayers()
    x = torch.randn(3, 5, H, device=DEVICE)
    y_grad = model(x).detach()
    with torch.no_grad():
        y_eager = model(x)
    calls = {"forward_only": 0, "forward": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(ops, "run_forward_only", counted("forward_only", ops.run_forward_only))
    monkeypatch.setattr(ops, "run_forward", counted("forward", ops.run_forward))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        y = compiled(x)
    assert calls == {"forward_only": 2, "forward": 0}
    assert torch.equal(y, y_eager) and torch.equal(y, y_grad)


@pytest.mark.skipif(
    DEVICE != "cuda" or BACKEND == "reference",
    reason="CUDA graphs need a CUDA device and the native backend (MOK_TEST_DEVICE=cuda, MOK_TEST_BACKEND=cuda): "
    "the reference backend reads the routes on the host, which no capture allows",
)
def test_compile_cudagraphs_replays_the_eager_bits():
    """torch.compile(backend="cudagraphs"): AOT autograd's forward and backward graphs of two MoE
    layers replayed as CUDA graphs (cudagraph trees: no host work per step beyond the replays).
    Every step after the warm-up and the recording gives the eager step's y and gradients, bit for
    bit (the custom ops' kernels are the eager ones, replayed on the same addresses)."""
    model = TwoLayers()
    x = torch.randn(3, 5, H, device=DEVICE)
    y_eager, g_eager = _step(model, x)
    compiled = torch.compile(model, backend="cudagraphs")
    for step in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        y, g = _step(model, x, compiled)
        assert torch.equal(y, y_eager), f"step {step}: y"
        for n in g:
            assert torch.equal(g[n], g_eager[n]), f"step {step}: {n}"
