"""The MXFP8 layer mode (docs/mxfp8.md): quantization points, accuracy, determinism, EP invariance.

- Against a float64 per-route loop that quantizes the same operands at the same points (x and
  dy before they travel, h before the down GEMM, [d_a, d_b] before the input-gradient GEMM,
  weight-gradient operands along rows in 32-row blocks per expert): bf16 tolerances, since
  only the accumulation order and precision differ.
- Against the BF16 layer on the same inputs: gradient cosine >= 0.996 (MoK's bar), with the
  error table printed; the shared expert stays bf16, so its gradients are bitwise the bf16 ones.
- Bitwise: run to run, across minibatch/macrobatch configurations, across EP 1, 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BACKEND, CONTRACT_KEYS, DEVICE, assert_bitwise, assert_close, cosine, rel_l2, run_functional
from multiproc import run_ranks

import mok_torch as mok
from mok_torch.mxfp8 import fake_quantize
from mok_torch.testing import LayerInputs, make_inputs

BF16 = torch.bfloat16


def mx_config(**kw) -> mok.MoKConfig:
    """A config for precision mxfp8 on the backend under test (skips where it has none)."""
    cfg = mok.MoKConfig(precision="mxfp8", backend=BACKEND, **kw)
    backend = mok.backends.registered_backends().get(BACKEND)
    why = None if backend is None else backend.unavailable_reason("mxfp8", torch.device(DEVICE))
    if why is not None:
        pytest.skip(f"backend {BACKEND!r} has no mxfp8: {why}")
    return cfg


# ---------------------------------------------------------------- the float64 loop


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).double()


def _q(t: torch.Tensor, dim: int) -> torch.Tensor:
    """MXFP8 values of t along dim (padded with zero rows to a multiple of 32), float64."""
    extra = -t.shape[dim] % 32
    if extra:
        shape = list(t.shape)
        shape[dim] = extra
        t = torch.cat([t, t.new_zeros(shape)], dim=dim)
    return fake_quantize(t.float(), dim).double()


def mxfp8_loop(inp: LayerInputs) -> dict[str, torch.Tensor]:
    """y, dx, d_router_weights and routed weight gradients of the MXFP8 layer (no shared expert)."""
    x, dy, top, w = inp.x_TH, inp.dy_TH, inp.top_experts_TK, inp.router_weights_TK.double()
    wg, wu, wd = inp.routed
    T, K = top.shape
    E, inner, H = wg.shape
    xq, dyq = _q(x, -1), _q(dy, -1)
    wg_h, wu_h, wd_i = _q(wg, -1), _q(wu, -1), _q(wd, -1)  # forward copies
    wg_i, wu_i, wd_h = _q(wg, -2), _q(wu, -2), _q(wd, -2)  # backward copies
    y = torch.zeros(T, H, dtype=torch.float64)
    dx = torch.zeros(T, H, dtype=torch.float64)
    d_w = torch.zeros(T, K, dtype=torch.float64)
    rows = {e: [] for e in range(E)}  # per expert, in (t, k) order: (x_q, h, wdy, d_ab)
    for t in range(T):
        for k in range(K):
            e = int(top[t, k])
            a, b = _bf16(xq[t] @ wg_h[e].T), _bf16(xq[t] @ wu_h[e].T)
            s = torch.sigmoid(a)
            h = _bf16(a * s * b)
            y[t] += w[t, k] * _bf16(_q(h[None], -1)[0] @ wd_i[e].T)
            g = dyq[t] @ wd_h[e]
            d_w[t, k] = (g * h).sum()
            d_h = w[t, k] * g
            d_ab = _bf16(torch.cat([d_h * b * s * (1 + a * (1 - s)), d_h * a * s]))
            dx[t] += _bf16(_q(d_ab[None], -1)[0] @ torch.cat([wg_i[e], wu_i[e]]))
            rows[e].append((xq[t], h, _bf16(w[t, k] * dyq[t]), d_ab))
    d_gate_up = torch.zeros(E, 2 * inner, H, dtype=torch.float64)
    d_down = torch.zeros(E, H, inner, dtype=torch.float64)
    for e, rs in rows.items():
        if not rs:
            continue
        xs, hs, wdys, dabs = (torch.stack(c) for c in zip(*rs, strict=True))
        d_down[e] = _q(wdys, 0).T @ _q(hs, 0)
        d_gate_up[e] = _q(dabs, 0).T @ _q(xs, 0)
    return {
        "y": y.to(BF16),
        "dx": dx.to(BF16),
        "d_router_weights": d_w.float(),
        "dWg": d_gate_up[:, :inner].to(BF16),
        "dWu": d_gate_up[:, inner:].to(BF16),
        "dWd": d_down.to(BF16),
    }


SHAPES = [
    pytest.param(40, 64, 32, 4, 2, "balanced", id="balanced"),
    pytest.param(33, 32, 64, 8, 3, "skewed", id="skewed-oddT"),
    pytest.param(17, 64, 32, 4, 1, "worst", id="worst-K1"),
    pytest.param(1, 32, 32, 4, 2, "balanced", id="one-token"),
]


@pytest.mark.parametrize("T,H,I,E,K,routing", SHAPES)
def test_matches_the_float64_loop_with_the_same_quantization(T, H, I, E, K, routing):
    inp = make_inputs(T, H, I, E, K, 0, routing, seed=5)
    got = run_functional(inp, mx_config(expert_alignment=32, minibatch_size=32))
    want = mxfp8_loop(inp)
    for key, ref in want.items():
        assert_close(key, got[key], ref)


def _error_table(got: dict, want: dict, keys: tuple[str, ...]) -> str:
    lines = [f"{'tensor':<18}{'rel L2':>10}{'cosine':>12}"]
    lines += [f"{k:<18}{rel_l2(got[k], want[k]):>10.4f}{cosine(got[k], want[k]):>12.6f}" for k in keys]
    return "\n".join(lines)


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_against_the_bf16_layer(routing, capsys):
    inp = make_inputs(64, 128, 64, 8, 2, 32, routing, seed=6)
    mx = run_functional(inp, mx_config(expert_alignment=32))
    bf = run_functional(inp, mok.MoKConfig(backend="reference", expert_alignment=32))
    keys = ("y", "dx", "d_router_weights", "dWg", "dWu", "dWd")
    table = _error_table(mx, bf, keys)
    with capsys.disabled():
        print(f"\nMXFP8 vs BF16 layer ({routing}):\n{table}")
    for k in keys:
        assert cosine(mx[k], bf[k]) >= 0.996, f"{k}: cosine below 0.996\n{table}"
        assert rel_l2(mx[k], bf[k]) <= 0.1, f"{k}: relative L2 above 0.1\n{table}"
    for k in ("dWg_s", "dWu_s", "dWd_s"):  # the shared expert is bf16 in both
        assert torch.equal(mx[k], bf[k]), k


def test_prequantized_weights_give_the_same_bits():
    """The user's MXFP8Tensor weights (either quantizer) equal bf16 weights quantized inside."""
    inp = make_inputs(24, 64, 32, 4, 2, 0, "skewed", seed=7).to(DEVICE)
    cfg = mx_config(expert_alignment=32)
    base = run_functional(inp, cfg)
    for compiled in (False, True):
        q = tuple(mok.mxfp8_quantize(w, compiled=compiled) for w in inp.routed)
        ws = mok.get_workspace(cfg, None, device=DEVICE, max_tokens=24, hidden_size=64, topk=2, num_experts=4)
        sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
        y, ctx = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, q)
        g = mok.backward(cfg, ws, sched, ctx, inp.dy_TH, inp.x_TH, inp.router_weights_TK, q)
        assert torch.equal(y.cpu(), base["y"]) and torch.equal(g.dx.cpu(), base["dx"])  # base: CPU copies
        assert torch.equal(g.d_router_weights.cpu(), base["d_router_weights"])
        for got, key in zip(g.d_routed, ("dWg", "dWu", "dWd"), strict=True):
            assert torch.equal(got.cpu(), base[key]), key
            assert got.dtype == BF16


def test_saved_activations_are_mxfp8_rows():
    """x is kept as it travelled: H E4M3 bytes and H/32 scale bytes per row (about half of bf16)."""
    inp = make_inputs(20, 64, 32, 4, 2, 0, "balanced", seed=8).to(DEVICE)
    cfg = mx_config(expert_alignment=32)
    ws = mok.get_workspace(cfg, None, device=DEVICE, max_tokens=20, hidden_size=64, topk=2, num_experts=4)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    _, ctx = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed)
    assert ctx.x_routed_MH.dtype == torch.uint8 and ctx.x_routed_MH.shape[1] == 64 + 2
    assert ctx.a_MI.dtype == BF16


CONFIGS = [
    dict(expert_alignment=32),
    dict(expert_alignment=32, minibatch_size=32),
    dict(expert_alignment=32, minibatch_size=32, macrobatch_size=64),
    dict(expert_alignment=64, minibatch_size=64, macrobatch_size=128),
    dict(expert_alignment=128),
    dict(expert_alignment=32, minibatch_size=32, macrobatch_size=64, dispatch="push", combine="pull"),
]


@pytest.mark.parametrize("routing", ["balanced", "worst"])
def test_bitwise_run_to_run_and_across_configs(routing):
    inp = make_inputs(45, 64, 32, 4, 2, 16, routing, seed=9)
    base = run_functional(inp, mx_config(**CONFIGS[0]))
    assert_bitwise(base, run_functional(inp, mx_config(**CONFIGS[0])), tuple(base), what="run to run: ")
    for kw in CONFIGS[1:]:
        assert_bitwise(base, run_functional(inp, mx_config(**kw)), what=f"{kw}: ")


# ---------------------------------------------------------------- expert parallelism

T_GLOBAL = 45
SPLITS = {1: [45], 2: [20, 25], 4: [10, 0, 20, 15]}
EP_SHAPE = dict(num_tokens=T_GLOBAL, hidden_size=64, intermediate_size=32, num_experts=4, topk=2)


def ep_scenario(rank: int, world: int, group, device: str) -> dict:
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    start = sum(SPLITS[world][:rank])
    inp = make_inputs(**EP_SHAPE, routing="skewed", seed=10)
    cfg = mok.MoKConfig(precision="mxfp8", backend=BACKEND, expert_alignment=32, minibatch_size=32)
    return run_functional(
        inp,
        cfg,
        group=group,
        rank=rank,
        world=world,
        tokens=slice(start, start + SPLITS[world][rank]),
        max_tokens=T_GLOBAL,
        device=dev,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_ep_invariance(world):
    mx_config()  # skips on a backend without mxfp8
    if DEVICE == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"EP {world} on CUDA needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    base = ep_scenario(0, 1, None, DEVICE)
    per_rank = run_ranks(world, "test_mxfp8_layer.ep_scenario", DEVICE, device=DEVICE)
    merged = {k: torch.cat([r[k] for r in per_rank]) for k in ("y", "dx", "d_router_weights", "dWg", "dWu", "dWd")}
    assert_bitwise(base, merged, what=f"MXFP8 EP {world}: ")


# ---------------------------------------------------------------- autograd, module, compile


def test_moe_autograd_matches_the_functional_api():
    inp = make_inputs(19, 64, 32, 4, 2, 32, "skewed", seed=12)
    cfg = mx_config(expert_alignment=32)
    base = run_functional(inp, cfg)

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().to(DEVICE).requires_grad_()

    x, w = leaf(inp.x_TH), leaf(inp.router_weights_TK)
    routed, shared = tuple(leaf(t) for t in inp.routed), tuple(leaf(t) for t in inp.shared)
    y = mok.moe(x, inp.top_experts_TK.to(DEVICE), w, routed, shared, config=cfg)
    y.backward(inp.dy_TH.to(DEVICE))
    got = {
        "y": y.detach(),
        "dx": x.grad,
        "d_router_weights": w.grad,
        "dWg": routed[0].grad,
        "dWu": routed[1].grad,
        "dWd": routed[2].grad,
        "dWg_s": shared[0].grad,
    }
    assert_bitwise(base, {k: v.cpu() for k, v in got.items()}, tuple(got), what="moe() vs functional: ")


def test_moe_layer_in_mxfp8_is_bitwise_repeatable():
    cfg = mx_config(expert_alignment=32)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = mok.MoELayer(64, 32, 4, 2, shared_intermediate_size=32, config=cfg, device=DEVICE, dtype=BF16)
        x = torch.randn(19, 64, device=DEVICE).to(BF16).requires_grad_()
        y = layer(x)
        y.float().square().sum().backward()
        runs.append([y.detach(), x.grad, layer.gate_proj.grad, layer.down_proj.grad, layer.router.weight.grad])
    for a, b in zip(*runs, strict=True):
        assert a is not None and torch.isfinite(a.float()).all() and torch.equal(a, b)


def test_compile_fullgraph_mxfp8():
    cfg = mx_config(expert_alignment=32)
    torch.manual_seed(1)
    layer = mok.MoELayer(64, 32, 4, 2, config=cfg, device=DEVICE)
    x = torch.randn(12, 64, device=DEVICE).to(BF16)
    eager = layer(x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")(x)
    assert torch.equal(eager, compiled)


# ---------------------------------------------------------------- bad input


def test_bad_mxfp8_arguments():
    with pytest.raises(ValueError, match="expert_alignment must be a multiple of 32"):
        mok.MoKConfig(precision="mxfp8", expert_alignment=16)
    cfg = mx_config(expert_alignment=32)
    inp = make_inputs(8, 64, 48, 4, 2, 0, "balanced", seed=11).to(DEVICE)  # I = 48: not a multiple of 32
    ws = mok.get_workspace(cfg, None, device=DEVICE, max_tokens=8, hidden_size=64, topk=2, num_experts=4)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    with pytest.raises(ValueError, match=r"intermediate size I \(48\) must be a multiple of 32"):
        mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed)
    good = make_inputs(8, 64, 32, 4, 2, 0, "balanced", seed=11).to(DEVICE)
    q = tuple(mok.mxfp8_quantize(w) for w in good.routed)
    with pytest.raises(TypeError, match="not a mix"):
        mok.forward(cfg, ws, sched, good.x_TH, good.router_weights_TK, (q[0], good.routed[1], q[2]))
    normal_only = (mok.mxfp8_quantize(good.routed[0], transposed=False), q[1], q[2])
    with pytest.raises(ValueError, match="normal and the transposed copy"):
        mok.forward(cfg, ws, sched, good.x_TH, good.router_weights_TK, normal_only)
    swapped = (q[2], q[1], q[0])
    with pytest.raises(ValueError, match=r"routed\[0\] \(gate\) must have shape"):
        mok.forward(cfg, ws, sched, good.x_TH, good.router_weights_TK, swapped)
    bf_cfg = mok.MoKConfig(backend="reference", expert_alignment=32)
    ws_bf = mok.get_workspace(bf_cfg, None, device=DEVICE, max_tokens=8, hidden_size=64, topk=2, num_experts=4)
    sched_bf = mok.build_schedule(ws_bf, bf_cfg, good.top_experts_TK)
    with pytest.raises(TypeError, match="precision is 'bf16'"):
        mok.forward(bf_cfg, ws_bf, sched_bf, good.x_TH, good.router_weights_TK, q)
    odd_h = mok.MoKConfig(precision="mxfp8", backend="reference", expert_alignment=32)
    ws_h = mok.get_workspace(odd_h, None, device=DEVICE, max_tokens=8, hidden_size=48, topk=2, num_experts=4)
    small = make_inputs(8, 48, 32, 4, 2, 0, "balanced", seed=11).to(DEVICE)
    sched_h = mok.build_schedule(ws_h, odd_h, small.top_experts_TK)
    with pytest.raises(ValueError, match=r"hidden_size \(48\) must be a multiple of 32"):
        mok.forward(odd_h, ws_h, sched_h, small.x_TH, small.router_weights_TK, small.routed)


@pytest.mark.parametrize(
    "per_row,kernels", [(False, True), (False, False), (True, True), (True, False)],
    ids=["grouped-kernels", "grouped-pytorch", "per-row-kernels", "per-row-pytorch"],
)  # fmt: skip
def test_cpu_backend_in_mxfp8_is_bitwise_the_reference(per_row, kernels, monkeypatch):
    """mok-core's transport moving MXFP8 rows; the experts in mok-mxfp8's CPU entry points
    (kernels) or in PyTorch: the reference's bits.

    per-row: the GPU's plan (every row of the capacity in static minibatches, each row with its
    expert, no host read), run on the CPU; with the PyTorch experts it is the cuda backend's
    MXFP8 path, covered here.
    """
    if "cpu" not in mok.backends.registered_backends():
        pytest.skip("the native cpu backend is not installed (mok-core missing)")
    import mok_torch.backends.native as native

    if kernels and native._mxfp8_kernels("cpu") is None:
        pytest.skip("the installed mok-mxfp8 has no CPU expert entry points")
    if not kernels:
        monkeypatch.setattr(native, "_mxfp8_kernels", lambda device_type: None)

    if per_row:  # the GPU's walk itself
        gpu_plan = lambda self, cfg, ws, sched, inner: native.static_ring_plan(cfg, ws, inner)  # noqa: E731
        monkeypatch.setattr(native.NativeBackend, "_rows_plan", gpu_plan)
    inp = make_inputs(37, 64, 32, 4, 2, 32, "skewed", seed=13)
    for kw in (
        dict(expert_alignment=32),
        dict(expert_alignment=32, minibatch_size=32, macrobatch_size=64),
        # MXFP8 rows pushed into bf16-sized table rows, outputs pulled back
        dict(expert_alignment=32, minibatch_size=32, macrobatch_size=64, dispatch="push", combine="pull"),
    ):
        ref = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend="reference", **kw), device="cpu")
        got = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend="cpu", **kw), device="cpu")
        keys = ("y", "dx", "d_router_weights", "dWg", "dWu", "dWd", "dWg_s", "dWu_s", "dWd_s")
        assert_bitwise(ref, got, keys + (() if per_row else ("saved_rows",)), what=f"cpu backend MXFP8 {kw}: ")


def test_fp8_forward_plan_on_the_cpu_is_bitwise_the_reference(monkeypatch):
    """The cuda backend's MXFP8 path with the FP8 grouped forward (padded MXFP8 rows pulled or read
    where pushed, a macrobatch per call, the backward's replays on the same entry point), run by
    the cpu backend, whose mok_mxfp8.grouped_forward is the reference arithmetic: the
    reference's bits, so the plumbing around the GPU kernels is checked on any machine."""
    if "cpu" not in mok.backends.registered_backends():
        pytest.skip("the native cpu backend is not installed (mok-core missing)")
    import mok_torch.backends.native as native

    if not hasattr(pytest.importorskip("mok_mxfp8"), "grouped_forward"):
        pytest.skip("the installed mok-mxfp8 has no grouped_forward")
    calls = {"n": 0}
    real = native.mxfp8_grouped_forward

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(native, "gpu_mxfp8_forward_kernels", lambda *a: True)
    monkeypatch.setattr(native, "mxfp8_grouped_forward", counted)
    monkeypatch.setattr(native, "_mxfp8_kernels", lambda device_type: None)  # the GPU's path, not per row
    inp = make_inputs(37, 64, 64, 4, 2, 32, "skewed", seed=17)
    for kw in CONFIGS:
        ref = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend="reference", **kw), device="cpu")
        got = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend="cpu", **kw), device="cpu")
        keys = ("y", "dx", "d_router_weights", "dWg", "dWu", "dWd", "dWg_s", "dWu_s", "dWd_s")
        assert_bitwise(ref, got, keys, what=f"FP8 plan on the cpu backend {kw}: ")
    assert calls["n"] >= len(CONFIGS), "the FP8 grouped forward did not run"


def test_auto_picks_the_native_backend_for_mxfp8_too():
    if "cpu" not in mok.backends.registered_backends():
        pytest.skip("the native cpu backend is not installed (mok-core missing)")
    assert mok.resolve_backend(mok.MoKConfig(precision="mxfp8"), torch.device("cpu")).name == "cpu"


def _count_calls(monkeypatch, module, name: str) -> dict[str, int]:
    """Replaces module.name by a wrapper that counts its calls; returns the counter."""
    calls = {"n": 0}
    real = getattr(module, name)

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, counted)
    return calls


def _assert_within(ref: dict, got: dict, keys: tuple[str, ...], tol: float = 1e-2) -> None:
    """Every tensor of `keys` within a relative L2 error `tol` of the reference backend's."""
    for key in keys:
        want, have = ref[key].double(), got[key].double()
        rel = ((have - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert rel <= tol, f"{key}: relative L2 error {rel:.2e} against the reference backend"


def _assert_bitwise_across_configs_and_near_the_reference(inp, backend: str) -> None:
    """The native `backend`'s MXFP8 layer: every contract key bitwise the same across CONFIGS,
    and within 1 % of the reference backend's."""
    ref = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend="reference", expert_alignment=32), device="cpu")
    first = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend=backend, **CONFIGS[0]), device=backend)
    for kw in CONFIGS[1:]:
        got = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend=backend, **kw), device=backend)
        assert_bitwise(first, got, CONTRACT_KEYS, what=f"{backend} backend MXFP8 {kw}: ")
    _assert_within(ref, first, CONTRACT_KEYS)


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_fp8_kernel_path_on_the_cpu_entry_points(routing, monkeypatch):
    """The native backend's FP8-kernel path (forward and backward a macrobatch per call: grouped
    forward, input-gradient GEMMs, weight gradients carried in fp32) run on the CPU entry points of
    the same kernels, so CI walks it: every contract key bitwise the same across the batching
    configs, and within 1 % of the reference backend (the kernels' CPU loops sum in 32-blocks as
    the reference does, in their own grouping)."""
    from mok_torch.backends import native

    monkeypatch.setattr(native, "gpu_mxfp8_forward_kernels", lambda cfg, *a: cfg.precision == "mxfp8")
    monkeypatch.setattr(native, "_mxfp8_kernels", lambda device_type: None)  # not the per-row entry points
    calls = {name: _count_calls(monkeypatch, native, name) for name in ("mxfp8_grouped_gemm", "mxfp8_grouped_wgrad")}
    _assert_bitwise_across_configs_and_near_the_reference(make_inputs(96, 128, 64, 8, 2, 0, routing, seed=13), "cpu")
    assert all(c["n"] for c in calls.values()), f"the FP8 backward did not run: {calls}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
@pytest.mark.parametrize("routing", ["balanced", "skewed"])
@pytest.mark.parametrize("I", [128, 64], ids=["I128", "I64"])
def test_cuda_backend_runs_the_fp8_gemms(routing, I, monkeypatch):
    """The cuda backend's MXFP8 layer on mok-mxfp8's FP8 tensor-core GEMMs (H and I multiples of
    64), forward and backward: every contract key bitwise the same across the batching configs
    (macrobatch splits replay the pre-activations on the same kernels and carry the weight
    gradients in fp32), within 1 % of the reference backend's MXFP8 layer. I = 64 splits dx's K
    off the kernel's 128-deep stages (the split A layout)."""
    from mok_torch.backends import native

    H = 128
    if not native.gpu_mxfp8_forward_kernels(mok.MoKConfig(precision="mxfp8"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-mxfp8's FP8 grouped forward needs an sm_90 GPU and a CUDA build of mok-mxfp8")
    calls = _count_calls(monkeypatch, native, "mxfp8_grouped_forward")
    backward = {name: _count_calls(monkeypatch, native, name) for name in ("mxfp8_grouped_gemm", "mxfp8_grouped_wgrad")}
    _assert_bitwise_across_configs_and_near_the_reference(make_inputs(96, H, I, 8, 2, 0, routing, seed=13), "cuda")
    assert calls["n"], "the FP8 GEMMs did not run"
    assert all(c["n"] for c in backward.values()), f"the FP8 backward did not run: {backward}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_backward_from_a_saved_copy_of_packed_rows(device, monkeypatch):
    """The autograd op saves the context's MXFP8 x rows as a clone: packed, H + H/32 bytes a row
    (198 at H = 192, not the 16-byte stride the GPU's element pass reads). The FP8 backward
    realigns them: every gradient bitwise that of the context as the forward left it."""
    import dataclasses

    from mok_torch.backends import native

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    H, I = 192, 64
    if device == "cpu":  # the FP8 path on the kernels' CPU loops, as in the test above
        monkeypatch.setattr(native, "gpu_mxfp8_forward_kernels", lambda cfg, *a: cfg.precision == "mxfp8")
        monkeypatch.setattr(native, "_mxfp8_kernels", lambda device_type: None)
    elif not native.gpu_mxfp8_forward_kernels(mok.MoKConfig(precision="mxfp8"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-mxfp8's FP8 grouped forward needs an sm_90 GPU and a CUDA build of mok-mxfp8")
    calls = _count_calls(monkeypatch, native, "mxfp8_swiglu_backward")
    inp = make_inputs(96, H, I, 8, 2, 0, "skewed", seed=15)
    cfg = mok.MoKConfig(precision="mxfp8", backend=device, expert_alignment=32)
    view = run_functional(inp, cfg, device=device)
    cloned = run_functional(
        inp, cfg, device=device, saved=lambda c: dataclasses.replace(c, x_routed_MH=c.x_routed_MH.clone())
    )
    assert calls["n"], "the FP8 backward did not run"
    assert_bitwise(view, cloned, CONTRACT_KEYS, what=f"{device}: saved clone vs view: ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_cuda_backend_runs_the_shared_expert_on_the_bf16_kernels(monkeypatch):
    """In MXFP8 mode the shared expert stays bf16 and runs mok-bf16's tensor-core kernels, as in the
    BF16 mode: its weight gradients are bitwise those of the BF16 cuda layer on the same inputs (they
    depend only on x, dy and the shared weights), and the layer stays within 1 % of the reference."""
    from mok_torch.backends import native

    H, I, Is = 128, 64, 64
    if not native.gpu_shared_kernels(torch.device("cuda"), H, Is):
        pytest.skip("mok-bf16's grouped GEMMs need an sm_90 GPU and a CUDA build of mok-bf16")
    calls = _count_calls(monkeypatch, native, "grouped_forward")
    inp = make_inputs(96, H, I, 8, 2, Is, "skewed", seed=14)
    mx = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend="cuda", expert_alignment=64), device="cuda")
    assert calls["n"], "the shared expert did not run on mok-bf16's kernels"
    bf = run_functional(inp, mok.MoKConfig(backend="cuda", expert_alignment=64), device="cuda")
    for key in ("dWg_s", "dWu_s", "dWd_s"):
        assert torch.equal(mx[key], bf[key]), f"{key}: the shared expert differs from the BF16 layer's"
    ref = run_functional(inp, mok.MoKConfig(precision="mxfp8", backend="reference", expert_alignment=64), device="cpu")
    _assert_within(ref, mx, CONTRACT_KEYS + ("dWg_s", "dWu_s", "dWd_s"))
