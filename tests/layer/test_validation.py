"""Bad input raises TypeError/ValueError naming the argument, before any work is done."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, config

import mok_torch as mok
from mok_torch.testing import make_inputs

T, H, I, E, K, Is = 12, 32, 16, 4, 2, 8


@pytest.fixture
def setup():
    inp = make_inputs(T, H, I, E, K, Is, seed=0).to(DEVICE)
    cfg = config(expert_alignment=8)
    ws = mok.get_workspace(cfg, None, device=DEVICE, max_tokens=16, hidden_size=H, topk=K, num_experts=E)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    return inp, cfg, ws, sched


def _fwd(setup, **over):
    inp, cfg, ws, sched = setup
    args = dict(
        cfg=cfg,
        ws=ws,
        sched=sched,
        x=inp.x_TH,
        router_weights=inp.router_weights_TK,
        routed=inp.routed,
        shared=inp.shared,
    )
    args.update(over)
    return mok.forward(**args)


def _wg(inp):
    return inp.routed[0]


FORWARD_CASES = [
    ("x", lambda i: i.x_TH.float(), TypeError, "x must have dtype bfloat16"),
    ("x", lambda i: i.x_TH[:, :-1].contiguous(), ValueError, "x must have shape [T, H]"),
    ("x", lambda i: i.x_TH[:-1].contiguous(), ValueError, "x must have shape"),
    ("x", lambda i: i.x_TH.t().contiguous().t(), ValueError, "x must be contiguous"),
    ("x", lambda i: i.x_TH.to("meta"), ValueError, "x must be on"),
    ("x", lambda i: i.x_TH.tolist(), TypeError, "x must be a torch.Tensor"),
    (
        "router_weights",
        lambda i: i.router_weights_TK[:, :1].contiguous(),
        ValueError,
        "router_weights must have shape [T, K]",
    ),
    ("router_weights", lambda i: i.router_weights_TK.long(), TypeError, "router_weights must have dtype"),
    ("routed", lambda i: i.routed[:2], TypeError, "routed must be a tuple (gate"),
    ("routed", lambda i: i.routed[:2], TypeError, "got tuple of length 2"),
    ("routed", lambda i: list(i.routed) + [i.routed[0]], TypeError, "got list of length 4"),
    ("routed", lambda i: i.routed[0], TypeError, "got Tensor"),
    ("routed", lambda i: (i.routed[0].float(),) + i.routed[1:], TypeError, "routed[0] (gate) must have dtype bfloat16"),
    ("routed", lambda i: (i.routed[0], i.routed[1][:, :-1].contiguous(), i.routed[2]), ValueError, "routed[1] (up)"),
    (
        "routed",
        lambda i: (i.routed[0], i.routed[1], i.routed[2][:, :, :-1].contiguous()),
        ValueError,
        "routed[2] (down)",
    ),
    ("routed", lambda i: tuple(w[:-1].contiguous() for w in i.routed), ValueError, "El differs"),
    ("shared", lambda i: (i.shared[0], i.shared[1], i.shared[2][:-1].contiguous()), ValueError, "shared[2] (down)"),
    ("shared", lambda i: i.shared[0], TypeError, "shared must be None or a tuple"),
    ("shared", lambda i: i.shared[:2], TypeError, "got tuple of length 2"),
    ("shared", lambda i: list(i.shared[:1]), TypeError, "got list of length 1"),
]


@pytest.mark.parametrize("arg,make,exc,msg", FORWARD_CASES)
def test_forward_rejects(setup, arg, make, exc, msg):
    with pytest.raises(exc, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        _fwd(setup, **{arg: make(setup[0])})


@pytest.mark.parametrize(
    "make,exc,msg",
    [
        (lambda te: te.float(), TypeError, "top_experts must have dtype"),
        (
            lambda te: torch.where(te == te[3, 1], torch.full_like(te, E), te),
            ValueError,
            "top_experts holds expert id 4",
        ),
        (
            lambda te: torch.where(te == te[0, 0], torch.full_like(te, -1), te),
            ValueError,
            "top_experts holds expert id -1",
        ),
        (lambda te: te[:, :1].contiguous(), ValueError, "top_experts must have shape"),
        # any layout is taken, but its ids are still checked
        (lambda te: (te + E).t().contiguous().t(), ValueError, "top_experts holds expert id"),
        (lambda te: torch.cat([te, te]), ValueError, "max_tokens"),
    ],
)
def test_build_schedule_rejects(setup, make, exc, msg):
    inp, cfg, ws, _ = setup
    with pytest.raises(exc, match=msg):
        mok.build_schedule(ws, cfg, make(inp.top_experts_TK))
        mok.check_errors(ws)  # on a GPU the native schedule kernel finds a bad id, raised here


def test_build_schedule_takes_the_top_experts_of_route(setup):
    """route() returns a strided view of a sort: build_schedule takes it as the contiguous copy."""
    inp, cfg, ws, _ = setup
    top, weights = mok.route(torch.randn(T, E, device=DEVICE), K)
    assert not top.is_contiguous()
    y, _ = mok.forward(cfg, ws, mok.build_schedule(ws, cfg, top), inp.x_TH, weights, inp.routed, inp.shared)
    want, _ = mok.forward(
        cfg, ws, mok.build_schedule(ws, cfg, top.contiguous()), inp.x_TH, weights, inp.routed, inp.shared
    )
    assert torch.equal(y, want)


def test_backward_rejects(setup):
    inp, cfg, ws, sched = setup
    _y, ctx = _fwd(setup)
    args = (cfg, ws, sched, ctx, inp.dy_TH, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    with pytest.raises(ValueError, match="dy must have shape"):
        mok.backward(*args[:4], inp.dy_TH[:-1].contiguous(), *args[5:])
    with pytest.raises(TypeError, match="dy must have dtype"):
        mok.backward(*args[:4], inp.dy_TH.float(), *args[5:])
    with pytest.raises(TypeError, match="ctx must be the ForwardContext"):
        mok.backward(*args[:3], "ctx", *args[4:])
    with pytest.raises(ValueError, match="shared must be given to backward"):
        mok.backward(*args[:8], None)
    other = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    with pytest.raises(ValueError, match="ctx was made by forward"):
        mok.backward(cfg, ws, other, *args[3:])
    with pytest.raises(TypeError, match="wgrad_dtype"):
        mok.backward(*args, wgrad_dtype=torch.float16)


def test_workspace_and_schedule_mismatches(setup):
    inp, cfg, ws, sched = setup
    other_ws = mok.create_workspace(cfg, None, device=DEVICE, max_tokens=16, hidden_size=H, topk=K, num_experts=E)
    with pytest.raises(ValueError, match="sched was built for another workspace"):
        mok.forward(cfg, other_ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    with pytest.raises(ValueError, match="expert_alignment"):
        mok.forward(
            cfg.replace(expert_alignment=16), ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared
        )
    with pytest.raises(TypeError, match="cfg must be a MoKConfig"):
        mok.forward({}, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    with pytest.raises(TypeError, match="sched must be a Schedule"):
        mok.forward(cfg, ws, None, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)


@pytest.mark.parametrize(
    "kw,exc,msg",
    [
        (dict(topk=5), ValueError, r"topk \(5\) must be <= num_experts \(4\)"),
        (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
        (dict(hidden_size=32.0), TypeError, "hidden_size must be an int"),
        (dict(num_experts=-2), ValueError, "num_experts must be >= 1"),
    ],
)
def test_workspace_rejects(kw, exc, msg):
    args = dict(device="cpu", max_tokens=16, hidden_size=H, topk=K, num_experts=E)
    args.update(kw)
    with pytest.raises(exc, match=msg):
        mok.create_workspace(mok.MoKConfig(), None, **args)


def test_group_without_distributed():
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        mok.create_workspace(
            mok.MoKConfig(), object(), device="cpu", max_tokens=4, hidden_size=8, topk=1, num_experts=2
        )


def test_moe_rejects():
    inp = make_inputs(T, H, I, E, K, 0, seed=1).to(DEVICE)  # (the cuda backend refuses CPU tensors first)
    cfg = config(expert_alignment=8)
    with pytest.raises(TypeError, match="x must have dtype"):
        mok.moe(inp.x_TH.long(), inp.top_experts_TK, inp.router_weights_TK, inp.routed, config=cfg)
    with pytest.raises(ValueError, match="top_experts must have shape"):
        mok.moe(inp.x_TH, inp.top_experts_TK[:-1], inp.router_weights_TK, inp.routed, config=cfg)
    with pytest.raises(TypeError, match="routed must be a tuple"):
        mok.moe(inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed[0], config=cfg)
    with pytest.raises(TypeError, match=r"routed must be a tuple .* got tuple of length 2"):
        mok.moe(inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed[:2], config=cfg)
    with pytest.raises(TypeError, match="config must be a MoKConfig"):
        mok.moe(inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed, config="bf16")
    where = inp.top_experts_TK.device
    with pytest.raises(ValueError, match=f"x is on meta, top_experts on {where}"):  # x is the one misplaced
        mok.moe(inp.x_TH.to("meta"), inp.top_experts_TK, inp.router_weights_TK, inp.routed, config=cfg)
    with pytest.raises(ValueError, match="top_experts holds expert id"):
        mok.moe(inp.x_TH, inp.top_experts_TK + E, inp.router_weights_TK, inp.routed, config=cfg)
        mok.check_errors()  # on a GPU the native schedule kernel finds it, raised here
    with pytest.raises(TypeError, match=r"routed\[1\] must be a float tensor"):
        mok.moe(
            inp.x_TH,
            inp.top_experts_TK,
            inp.router_weights_TK,
            (inp.routed[0], inp.routed[1].long(), inp.routed[2]),
            config=cfg,
        )


@pytest.mark.parametrize(
    "kw,exc,msg",
    [
        (dict(precision="fp4"), ValueError, "MoKConfig.precision"),
        (dict(backend="tpu"), ValueError, "MoKConfig.backend"),
        (dict(fwd_num_comm_sms=7), ValueError, "MoKConfig.fwd_num_comm_sms must be even"),
        (dict(bwd_num_comm_sms=0), ValueError, "MoKConfig.bwd_num_comm_sms must be >= 2"),
        (dict(expert_alignment=48), ValueError, "MoKConfig.expert_alignment must be a power of two"),
        (dict(minibatch_size=100), ValueError, "MoKConfig.minibatch_size"),
        (dict(minibatch_size=256, macrobatch_size=384), ValueError, "must be a multiple of minibatch_size"),
        (dict(swiglu_limit=-1.0), ValueError, "MoKConfig.swiglu_limit"),
        (dict(swiglu_limit="7"), TypeError, "MoKConfig.swiglu_limit"),
        (dict(minibatch_size=1.5), TypeError, "MoKConfig.minibatch_size must be an int"),
        (dict(timeout_s=0), ValueError, "MoKConfig.timeout_s"),
        (dict(dispatch="broadcast"), ValueError, "MoKConfig.dispatch must be one of"),
        (dict(combine=None), ValueError, "MoKConfig.combine must be one of"),
    ],
)
def test_config_rejects(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        mok.MoKConfig(**kw)


def test_layer_rejects():
    with pytest.raises(ValueError, match="topk"):
        mok.MoELayer(16, 8, 4, 5)
    with pytest.raises(ValueError, match="score_func"):
        mok.MoELayer(16, 8, 4, 2, score_func="relu")
    with pytest.raises(ValueError, match="hidden_size"):
        mok.MoELayer(0, 8, 4, 2)
    layer = mok.MoELayer(16, 8, 4, 2, config=config(expert_alignment=8))
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(3, 15))
    with pytest.raises(ValueError, match="top_experts must have shape"):
        layer(torch.randn(3, 16), top_experts=torch.zeros(3, 3, dtype=torch.long))
    # ids outside [0, E) are named as mok.moe names them, before the router's gather sees them
    with pytest.raises(ValueError, match=r"top_experts holds expert id 4 at position \[1, 1, 1\]"):
        layer(torch.randn(2, 3, 16), top_experts=torch.tensor([[[0, 1]] * 3, [[1, 2], [0, 4], [2, 3]]]))
    with pytest.raises(ValueError, match="top_experts holds expert id -1"):
        layer(torch.randn(3, 16), top_experts=torch.tensor([[0, 1], [-1, 2], [2, 3]]))
