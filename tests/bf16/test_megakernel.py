"""The forward megakernel (docs/megakernel.md): bitwise the chain of grouped kernels it replaces,
within bf16 tolerance of the float64 loop, the same bits for any grid, capturable in a CUDA graph,
and a dependency that never arrives becomes an error instead of a hang.

GPU tests skip, with the reason, on a machine without an sm_90 GPU; the path-selection tests run
everywhere.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import CONTRACT_KEYS, assert_bitwise, assert_close, assert_fused_forward_is_the_two_calls, run_functional
from reference.moe_loop import moe_loop

import mok_torch as mok
from mok_torch.backends import native
from mok_torch.backends.native import megakernel
from mok_torch.testing import make_inputs

GPU = (
    torch.cuda.is_available()
    and torch.cuda.get_device_capability() == (9, 0)
    and megakernel.available(torch.device("cuda"))
)
needs_gpu = pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU and mok-bf16 built with CUDA; none here")


def cuda_config(**kw) -> mok.MoKConfig:
    kw.setdefault("expert_alignment", 128)
    return mok.MoKConfig(backend="cuda", **kw)


# (T, H, I, E, K, Is, routing, limit): awkward sizes, every routing, empty experts, one expert
# with every row, one token, a prime T, K = 1, H not a multiple of 256, I not of 128, tasks of
# fewer k-blocks than the deferred pieces (I / 64 or H / 64 below 8: 1-3 and 4-7 k-blocks).
CASES = [
    pytest.param(300, 128, 128, 8, 2, 0, "balanced", None, id="balanced"),
    pytest.param(257, 256, 192, 16, 4, 0, "skewed", None, id="skewed-I192"),
    pytest.param(200, 320, 128, 8, 2, 0, "worst", None, id="worst-H320"),
    pytest.param(150, 128, 256, 16, 2, 0, "sparse", 0.5, id="empty-experts-limit"),
    pytest.param(1, 128, 64, 4, 1, 0, "balanced", None, id="one-token-K1"),
    pytest.param(1021, 192, 128, 4, 1, 64, "worst", None, id="prime-T-one-expert-shared"),
    pytest.param(640, 1024, 640, 8, 8, 0, "balanced", None, id="long-K-K8"),
    # Tasks of 4 to 7 k-blocks (gate/up 4, down 6): the pending tile's pieces two a k-block.
    pytest.param(333, 256, 384, 8, 4, 0, "skewed", None, id="skewed-short-tasks"),
]


# ------------------------------------------------------------------ path selection (any machine)


def test_expert_path_is_decided_in_one_place():
    dev = torch.device("cuda" if GPU else "cpu")
    for cfg in (cuda_config() if GPU else mok.MoKConfig(backend="cpu"), mok.MoKConfig(expert_alignment=32)):
        ws = mok.create_workspace(cfg, None, device=dev, max_tokens=64, hidden_size=128, topk=2, num_experts=4)
        path = native.expert_path(cfg, ws, 128)
        assert path.forward in ("megakernel", "tensor-cores", "fp8-cores", "cpu-kernels", "reference")
        if dev.type == "cpu":  # the CPU's megakernel: moe_forward, and moe_backward or the chain after it
            assert path.backward in ("megakernel", "cpu-kernels", "reference")
            assert path.forward in ("megakernel", path.backward)
            assert path.backward != "megakernel" or path.forward == "megakernel"
    assert set(native.describe_expert_paths(dev)) == {"bf16", "mxfp8"}


CPU_MEGAKERNEL = megakernel.available(torch.device("cpu"))


@pytest.mark.skipif(not CPU_MEGAKERNEL, reason="needs mok-bf16's CPU moe_forward (mok-bf16 not installed)")
def test_cpu_takes_moe_forward_where_it_can():
    """On the CPU the forward runs mok_bf16.moe_forward (the megakernel's call, the bits of
    "cpu-kernels") in BF16 without a backward replay; across ranks only with a pull dispatch and
    a push combine (the form that reads x_src and stores into `rows` by address: tests/layer/
    test_native.py runs it at EP 2 and 3). Its backward is mok_bf16.moe_backward where the combine
    pushes, else the chain."""

    def path(**kw):
        cfg = mok.MoKConfig(backend="cpu", **kw)
        ws = mok.create_workspace(cfg, None, device="cpu", max_tokens=64, hidden_size=128, topk=2, num_experts=4)
        return tuple(native.expert_path(cfg, ws, 128))

    assert path() == ("megakernel", "megakernel")  # the backward: mok_bf16.moe_backward, the mirror
    assert path(dispatch="push") == ("megakernel", "megakernel")  # one rank: nothing moves
    assert path(dispatch="push", combine="pull") == ("megakernel", "cpu-kernels")  # the backward's chain
    assert path(megakernel=False) == ("cpu-kernels", "cpu-kernels")
    assert path(macrobatch_size=128) == ("cpu-kernels", "cpu-kernels")  # a replay keeps the chain
    assert path(precision="mxfp8")[0] != "megakernel"
    # across ranks: the decision on a workspace's world size (no group needed to decide)
    cfg = mok.MoKConfig(backend="cpu")
    ws = mok.create_workspace(cfg, None, device="cpu", max_tokens=64, hidden_size=128, topk=2, num_experts=4)
    for kw, want in ((dict(), True), (dict(dispatch="push"), False), (dict(combine="pull"), False)):
        assert native._cpu_megakernel(mok.MoKConfig(backend="cpu", **kw), _Ranks(ws, 2), "cpu-kernels") is want, kw


class _Ranks:
    """A workspace seen as one of `world` ranks (for the path decision only)."""

    def __init__(self, ws, world: int) -> None:
        self.world_size, self.capacity, self.device = world, ws.capacity, ws.device


def test_megakernel_knob_is_checked():
    with pytest.raises(TypeError, match="megakernel"):
        mok.MoKConfig(megakernel=1)


@needs_gpu
def test_megakernel_is_the_default_path_at_one_rank():
    dev = torch.device("cuda")

    def path(hidden=128, **kw):
        cfg = cuda_config(**kw)
        ws = mok.create_workspace(cfg, None, device=dev, max_tokens=64, hidden_size=hidden, topk=2, num_experts=4)
        return native.expert_path(cfg, ws, 128)

    assert path() == ("megakernel", "tensor-cores")
    assert path(hidden=native.MEGAKERNEL_MAX_HIDDEN - 64) == ("megakernel", "tensor-cores")
    assert path(hidden=native.MEGAKERNEL_MAX_HIDDEN) == ("tensor-cores", "tensor-cores")  # the chain is faster
    assert path(megakernel=False) == ("tensor-cores", "tensor-cores")
    assert path(expert_alignment=32) == ("tensor-cores", "reference")  # the backward needs 64-row blocks
    assert path(macrobatch_size=128) == ("tensor-cores", "tensor-cores")  # a replay keeps the chain


def test_megakernel_takes_a_and_b_together():
    """out_a and out_b are both given (the context) or both 0 (a forward no backward follows)."""
    mok_bf16 = pytest.importorskip("mok_bf16", reason="mok-bf16 is not installed")
    args = dict(x=16, row_route=16, offsets=16, w_gate=16, w_up=16, w_down=16, out_a=16, out_b=0, scratch_h=16,
                out_rows=16, task_state=16, error=16, capacity=128, num_tokens=64, hidden=128, inner=64,
                num_experts=4, topk=2)  # fmt: skip
    for a, b in ((16, 0), (0, 16)):
        with pytest.raises(ValueError, match="out_a and out_b must both be given or both be 0"):
            mok_bf16.moe_forward("cpu", **{**args, "out_a": a, "out_b": b})


# ------------------------------------------------------------------ GPU


@needs_gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing,limit", CASES)
def test_megakernel_without_autograd_keeps_no_context(T, H, I, E, K, Is, routing, limit, monkeypatch):
    """mok.moe under torch.no_grad on the megakernel's path launches it without a context (no a, b or
    x rows stored: megakernel.moe_forward, or without a shared expert megakernel.forward_call, gives
    no Outputs) and gives the autograd call's y bit for bit."""
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + 4).to("cuda")
    cfg = cuda_config(swiglu_limit=limit)
    args = (inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed, inp.shared)
    x = inp.x_TH.clone().requires_grad_()
    want = mok.moe(x, *args[1:], config=cfg)
    launches = []
    real_launch, real_call = megakernel.moe_forward, megakernel.forward_call

    def launch(*a, **kw):
        out = real_launch(*a, **kw)
        launches.append(("moe_forward", kw.get("context", True), out))
        return out

    def call(*a, **kw):
        out = real_call(*a, **kw)
        launches.append(("forward_call", kw["context"], out[0]))
        return out

    monkeypatch.setattr(megakernel, "moe_forward", launch)
    monkeypatch.setattr(megakernel, "forward_call", call)
    with torch.no_grad():
        got = mok.moe(*args, config=cfg)
    # One launch, without a context: with a shared expert the megakernel's own call (the shared
    # expert's y is the combine's base), else the one call of the table, megakernel and combine.
    assert launches == [("moe_forward" if Is else "forward_call", False, None)]
    assert torch.equal(got, want.detach())


@needs_gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing,limit", CASES[:3])
def test_megakernel_call_issues_no_send_side(T, H, I, E, K, Is, routing, limit, monkeypatch):
    """mok.moe's forward + backward on the megakernel's path at one rank (the direct backward)
    reads none of the schedule's send side, so none is issued (structs.LazySendSide): no
    build_send_side, no route ranks; the gradients are those of the call that issues it."""
    from mok_torch.backends.native import NativeBackend

    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + 5).to("cuda")
    cfg = cuda_config(swiglu_limit=limit, combine="push")

    def grads() -> list[torch.Tensor]:
        x = inp.x_TH.clone().requires_grad_()
        w = inp.router_weights_TK.clone().requires_grad_()
        routed = tuple(t.clone().requires_grad_() for t in inp.routed)
        mok.moe(x, inp.top_experts_TK, w, routed, None, config=cfg).backward(inp.dy_TH)
        return [t.grad for t in (x, w, *routed)]

    issued: list[int] = []
    real = NativeBackend._issue_source_side
    monkeypatch.setattr(NativeBackend, "_issue_source_side", lambda *a: issued.append(1) or real(*a))
    got = grads()
    assert issued == []
    real_defer = NativeBackend._source_side
    monkeypatch.setattr(  # the send side issued with the table, as build_schedule does
        NativeBackend, "_source_side", lambda self, *a, defer=False: real_defer(self, *a, defer=False)
    )
    want = grads()
    assert len(issued) == 1
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"gradient {i}"


@needs_gpu
@pytest.mark.parametrize(
    "T,H,I,E,K,routing,alignment",
    [
        (300, 256, 192, 8, 4, "skewed", 128),
        (1, 128, 64, 4, 1, "worst", 128),
        (150, 128, 256, 16, 2, "sparse", 128),
        # Several column tiles (the column-0 tile of each row tile stores the x rows with context),
        # and segments cut inside a 64-row half (alignment 16: x rows stored by the threads).
        (333, 256, 384, 8, 4, "skewed", 16),
        (300, 192, 640, 8, 4, "balanced", 128),
    ],
)
def test_megakernel_launch_without_context_writes_the_same_rows(T, H, I, E, K, routing, alignment):
    """megakernel.moe_forward(context=False): no a, b or x rows (null pointers: a store through one
    would fault), every route's output row the full launch's, bit for bit; the state left zero."""
    inp = make_inputs(T, H, I, E, K, 0, routing, seed=5).to("cuda")
    cfg = cuda_config(expert_alignment=alignment)
    ws = mok.create_workspace(cfg, None, device="cuda", max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)

    def launch(context):
        rows = torch.full((T * K, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        error = torch.zeros(4, dtype=torch.int32, device="cuda")
        out = megakernel.moe_forward(
            ws, sched.row_route_C.data_ptr(), sched.expert_offsets_El1.data_ptr(), inp.x_TH, inp.routed, rows, error,
            limit=None, timeout_ns=int(30e9), context=context,
        )  # fmt: skip
        torch.cuda.synchronize()
        return out, rows, error

    full, rows, error = launch(True)
    none, rows_alone, error_alone = launch(False)
    assert full is not None and none is None
    assert int(error[0]) == 0 and int(error_alone[0]) == 0
    assert not bool(megakernel.task_state(ws).any())
    assert not bool(rows_alone.isnan().any()), "every route's row is written"
    assert torch.equal(rows, rows_alone)


@needs_gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing,limit", CASES)
def test_megakernel_is_bitwise_the_chain(T, H, I, E, K, Is, routing, limit):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + H)
    fused = run_functional(inp, cuda_config(swiglu_limit=limit), device="cuda")
    chain = run_functional(inp, cuda_config(swiglu_limit=limit, megakernel=False), device="cuda")
    keys = CONTRACT_KEYS + (("dWg_s", "dWu_s", "dWd_s") if Is else ())
    # The context's routed x too: the rows the megakernel gathered are the chain's pulled rows.
    assert_bitwise(chain, fused, keys + ("saved_rows", "x_routed"), what="megakernel vs chain: ")


@needs_gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing,limit", CASES)
def test_megakernel_issued_with_the_schedule_is_the_two_calls(T, H, I, E, K, Is, routing, limit):
    """mok.moe's eager call issues the megakernel right after the schedule's table (its arrays
    views of one buffer), the rest of the schedule after it: the same schedule and bits."""
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + 3)
    cfg = cuda_config(swiglu_limit=limit)
    ws = mok.create_workspace(cfg, None, device="cuda", max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    assert native.expert_path(cfg, ws, I).forward == "megakernel"
    assert_fused_forward_is_the_two_calls(inp, cfg, device="cuda")


@needs_gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing,limit", CASES)
def test_megakernel_stores_no_x_where_the_backward_gathers_it(T, H, I, E, K, Is, routing, limit, monkeypatch):
    """Where the one-call backward's dW1 gathers x's rows by route (I <= GATHER_X_MAX_INNER, off by
    default: set to 256 here), mok.moe's eager forward keeps no routed x (less saved memory by C x H
    bf16), and its schedule, y and gradients are bitwise those of build_schedule then forward, which
    stores x (assert_fused_forward_is_the_two_calls). With a shared expert the forward is not the
    one-call lane and stores x."""
    from mok_torch import functional

    monkeypatch.setattr(native, "GATHER_X_MAX_INNER", 256)
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + 5)
    cfg = cuda_config(swiglu_limit=limit)
    ws = mok.create_workspace(cfg, None, device="cuda", max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    assert native.NativeBackend._gathers_x(cfg, ws, I) == (I <= 256), "the lane's conditions"
    gathers = I <= 256 and Is == 0
    dev = inp.to("cuda")
    args = (dev.x_TH, dev.router_weights_TK, dev.routed, dev.shared)
    ctx = functional.schedule_and_forward(cfg, ws, dev.top_experts_TK, *args)[2]
    assert (ctx.x_routed_MH is None) == gathers
    if gathers:
        stored = mok.forward(cfg, ws, mok.build_schedule(ws, cfg, dev.top_experts_TK), *args)[1]
        assert stored.saved_bytes() - ctx.saved_bytes() == stored.x_routed_MH.numel() * 2
    assert_fused_forward_is_the_two_calls(inp, cfg, device="cuda")


@needs_gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing,limit", CASES[:4])
def test_megakernel_matches_fp64_loop(T, H, I, E, K, Is, routing, limit):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + 2)
    got = run_functional(inp, cuda_config(swiglu_limit=limit), device="cuda", wgrad_dtype=torch.float32)
    want = moe_loop(inp.x_TH, inp.top_experts_TK, inp.router_weights_TK, inp.routed, inp.shared, inp.dy_TH, limit)
    assert_close("y", got["y"], want.y)
    assert_close("dx", got["dx"], want.dx)
    assert_close("d_router_weights", got["d_router_weights"], want.d_router_weights)
    for name, w in zip(("dWg", "dWu", "dWd"), want.d_routed, strict=True):
        assert_close(name, got[name], w)


def _direct(T, H, I, E, K, routing, *, num_sms=0, inject=False, timeout_s=30.0, seed=0, timers=None):
    """One megakernel launch through megakernel.moe_forward: (a, b, rows, error, state, ws, sched,
    x rows); its outputs poisoned (NaN) before the launch, so every element is one it wrote."""
    inp = make_inputs(T, H, I, E, K, 0, routing, seed=seed).to("cuda")
    cfg = cuda_config()
    ws = mok.create_workspace(cfg, None, device="cuda", max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    rows = torch.full((T * K, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    # The launch allocates a, b and x: blocks of their sizes, poisoned and freed first, are what the
    # caching allocator hands it, so that an element the launch leaves unwritten reads as NaN.
    C = ws.capacity
    poison = [
        torch.full((n, w), float("nan"), dtype=torch.bfloat16, device="cuda") for n, w in ((C, I), (C, I), (C, H))
    ]
    del poison
    out = megakernel.moe_forward(
        ws, sched.row_route_C.data_ptr(), sched.expert_offsets_El1.data_ptr(), inp.x_TH, inp.routed, rows, error,
        limit=None,
        timeout_ns=int(timeout_s * 1e9), num_sms=num_sms, inject_missing_dependency=inject, timers=timers,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out.a, out.b, rows, error, megakernel.task_state(ws), ws, sched, out.x


@needs_gpu
def test_megakernel_bits_do_not_depend_on_the_grid():
    runs = [_direct(500, 256, 192, 8, 4, "skewed", num_sms=n, seed=1) for n in (1, 7, 0)]
    for _, _, rows, error, state, _, _, x in runs:
        assert int(error[0]) == 0
        assert not bool(state.any()), "every launch leaves its task queue and counters zero"
        assert not bool(rows.isnan().any()), "every route's row is written"
        assert not bool(x.isnan().any()), "every table row's x is written"
    for other in runs[1:]:
        for u, v in zip(runs[0][:3] + runs[0][7:], other[:3] + other[7:], strict=True):
            assert torch.equal(u, v)


@needs_gpu
def test_timed_megakernel_gives_the_untimed_bits():
    """The timed instantiation (benchmarks/probes/megakernel_timers.py) computes the same tiles:
    the untimed launch's a, b and rows bit for bit; every CTA's roles account their time."""
    sms, roles, slots = 7, len(megakernel.TIMER_ROLES), len(megakernel.TIMER_SLOTS)
    timers = torch.zeros(sms * roles * slots, dtype=torch.int64, device="cuda")
    plain = _direct(300, 256, 192, 8, 4, "skewed", num_sms=sms, seed=3)
    timed = _direct(300, 256, 192, 8, 4, "skewed", num_sms=sms, seed=3, timers=timers)
    for u, v in zip(plain[:3] + plain[7:], timed[:3] + timed[7:], strict=True):
        assert torch.equal(u, v)
    total = timers.view(sms, roles, slots)[:, :, megakernel.TIMER_SLOTS.index("total")]
    assert bool((total > 0).all()), "every role of every CTA accounted its time"
    with pytest.raises(ValueError, match="timers must hold"):
        _direct(300, 256, 192, 8, 4, "skewed", num_sms=sms, seed=3, timers=timers[:-1])
    with pytest.raises(TypeError, match="timers must be an int64 tensor"):
        _direct(300, 256, 192, 8, 4, "skewed", num_sms=sms, seed=3, timers=timers.int())


@needs_gpu
@pytest.mark.parametrize(
    "T,H,I,E,K,routing",
    [(77, 128, 128, 4, 2, "balanced"), (300, 320, 192, 16, 4, "skewed"), (1, 128, 64, 4, 1, "worst")],
)
def test_megakernel_writes_every_row_of_a_b_and_x(T, H, I, E, K, routing):
    a, b, _, _, _, ws, sched, x = _direct(T, H, I, E, K, routing, seed=2)
    end = int(sched.expert_offsets_El1[-1])
    assert end < ws.capacity
    assert not bool(a[end:].any()) and not bool(b[end:].any()), "the capacity's tail is zero"
    assert not (a.isnan().any() or b.isnan().any() or x.isnan().any()), "every element is written"
    # x: each table row's token row, zeros for padding rows and past the last segment.
    route = sched.row_route_C.long()
    token = torch.where(route >= 0, route // K, 0)
    inp = make_inputs(T, H, I, E, K, 0, routing, seed=2).to("cuda")
    want = torch.where((route >= 0)[:, None], inp.x_TH[token], 0.0)
    want[end:] = 0
    assert torch.equal(x, want)


@needs_gpu
def test_missing_dependency_is_an_error_not_a_hang():
    _, _, _, error, state, *_ = _direct(300, 128, 128, 8, 2, "balanced", inject=True, timeout_s=0.05)
    code, _, stage, _ = error.tolist()
    assert (code, stage) == (1, megakernel.STAGE), f"error words {error.tolist()}"
    assert not bool(state.any()), "the launch still ended and reset its state"
    # The next launch on the same state is right again.
    again = _direct(300, 128, 128, 8, 2, "balanced")
    assert int(again[3][0]) == 0


@needs_gpu
def test_missing_dependency_raises_through_the_api():
    from mok_torch.backends.native.transport import raise_transport_error

    _, _, _, error, *_ = _direct(64, 128, 64, 4, 2, "worst", inject=True, timeout_s=0.02)
    with pytest.raises(RuntimeError, match="megakernel"):
        raise_transport_error(error.tolist(), int(0.02e9))


@needs_gpu
def test_megakernel_in_a_cuda_graph():
    inp = make_inputs(400, 256, 128, 8, 2, 0, "skewed", seed=4).to("cuda")
    cfg = cuda_config()
    ws = mok.get_workspace(cfg, None, device="cuda", max_tokens=400, hidden_size=256, topk=2, num_experts=8)
    eager_sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    eager, _ = mok.forward(cfg, ws, eager_sched, inp.x_TH, inp.router_weights_TK, inp.routed)
    eager = eager.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
            y, _ = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)


# A forward at one rank on the megakernel's path (the megakernel storing the x rows it gathers),
# then with `full` the backward (the g GEMM gathering dy by route and storing its table-ordered
# copy): `python -c SANITIZE [full]`.
SANITIZE = """
import sys, torch, mok_torch as mok
from mok_torch.testing import make_inputs
inp = make_inputs(70, 128, 64, 4, 2, 0, "skewed", seed=1).to("cuda")
cfg = mok.MoKConfig(backend="cuda", expert_alignment=64)
ws = mok.get_workspace(cfg, None, device="cuda", max_tokens=70, hidden_size=128, topk=2, num_experts=4)
sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
y, ctx = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed)
torch.cuda.synchronize()
print("forward ran", tuple(y.shape))
if sys.argv[1:] == ["full"]:
    g = mok.backward(cfg, ws, sched, ctx, inp.dy_TH, inp.x_TH, inp.router_weights_TK, inp.routed)
    torch.cuda.synchronize()
    print("backward ran", tuple(g.dx.shape))
"""


# racecheck faults in a kernel it does not instrument that runs while it instruments others, when
# that kernel is a cluster launch: over the backward, with the megakernel or the grouped GEMMs
# instrumented, the weight-gradient GEMMs (the call's only clusters) fault; on one SM (no
# clusters), or instrumented with the rest, nothing does and racecheck finds no hazard (NOTES.md,
# sessions 20 and 21). So the backward's kernels are instrumented together: every GEMM ("gemm"),
# or every kernel of the run (None).
@needs_gpu
@pytest.mark.parametrize(
    "tool,kernels,full",
    [
        ("memcheck", "moe_forward", False),
        ("racecheck", "moe_forward", False),
        ("synccheck", "moe_forward", False),
        ("memcheck", "gemm", True),
        ("racecheck", "gemm", True),
        ("synccheck", "gemm", True),
        ("racecheck", None, True),
    ],
)
def test_megakernel_is_sanitizer_clean(tool, kernels, full):
    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on PATH")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    script = [sys.executable, "-c", SANITIZE] + (["full"] if full else [])
    which = [] if kernels is None else ["--kernel-name", f"kns={kernels}"]
    out = subprocess.run(
        ["compute-sanitizer", f"--tool={tool}", *which, *script],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    text = out.stdout + out.stderr
    ran = "forward ran (70, 128)" in text and (not full or "backward ran (70, 128)" in text)
    assert out.returncode == 0 and ran, text[:3000]
    # memcheck and synccheck end with "ERROR SUMMARY: 0 errors", racecheck with "(0 errors, 0 warnings)".
    assert "ERROR SUMMARY: 0 errors" in text or "(0 errors, 0 warnings)" in text, text[-3000:]
