"""The native backends (mok-core runtime): bitwise the reference, across processes, on GPUs,
in a CUDA graph, and a rank that never arrives raises instead of hanging."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from helpers import CONTRACT_KEYS, assert_bitwise, assert_fused_forward_is_the_two_calls, config, run_functional
from multiproc import run_ranks

import mok_torch as mok
from mok_torch.backends import native
from mok_torch.testing import make_inputs

pytestmark = pytest.mark.multiprocess

SHAPES = [
    pytest.param(37, 64, 32, 8, 2, 16, "balanced", id="balanced-shared"),
    pytest.param(30, 32, 48, 8, 3, 0, "skewed", id="skewed"),
    pytest.param(20, 32, 16, 4, 2, 0, "worst", id="worst"),
    pytest.param(1, 32, 16, 4, 1, 8, "balanced", id="one-token-K1"),
]
CONFIGS = [
    dict(expert_alignment=8),
    dict(expert_alignment=8, minibatch_size=8, macrobatch_size=16),
    dict(expert_alignment=1, minibatch_size=5, macrobatch_size=15, fwd_num_comm_sms=2, bwd_num_comm_sms=4),
    # the other directions: sources push their rows into the tables, pull their outputs back
    dict(expert_alignment=8, dispatch="push", combine="pull"),
    dict(expert_alignment=4, minibatch_size=8, macrobatch_size=16, dispatch="push"),
    dict(expert_alignment=1, minibatch_size=5, macrobatch_size=15, combine="pull"),
]
# Where the GPU GEMMs run, an expert alignment that is a multiple of 64 also puts the backward on
# mok-bf16's kernels (their weight gradients take 64-row blocks from each segment start).
GPU_BACKWARD_CONFIGS = [
    dict(expert_alignment=64),
    dict(expert_alignment=64, minibatch_size=64, macrobatch_size=128),
    dict(expert_alignment=128, minibatch_size=128, macrobatch_size=256, fwd_num_comm_sms=2, bwd_num_comm_sms=4),
    dict(expert_alignment=64, minibatch_size=64, macrobatch_size=128, dispatch="push", combine="pull"),
    # one rank on the chain in one macrobatch: x (and, with a pull combine, dy) scattered into the
    # table (Transport.scatter_local) instead of copied into the transport and pulled
    dict(expert_alignment=64, megakernel=False),
    dict(expert_alignment=64, megakernel=False, combine="pull"),
]
ALL_KEYS = CONTRACT_KEYS + ("dWg_s", "dWu_s", "dWd_s")


def _keys(Is: int) -> tuple[str, ...]:
    return ALL_KEYS if Is else CONTRACT_KEYS


@pytest.mark.parametrize("T,H,I,E,K,Is,routing", SHAPES)
def test_cpu_backend_is_bitwise_the_reference(T, H, I, E, K, Is, routing):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T)
    for kw in CONFIGS:
        ref = run_functional(inp, config(backend="reference", **kw), device="cpu")
        got = run_functional(inp, config(backend="cpu", **kw), device="cpu")
        assert_bitwise(ref, got, _keys(Is) + ("saved_rows",), what=f"cpu backend {kw}: ")


T_GLOBAL, SPLITS = 45, {2: [20, 25], 3: [10, 0, 35]}


def _slice(world: int, rank: int) -> slice:
    start = sum(SPLITS[world][:rank])
    return slice(start, start + SPLITS[world][rank])


# (H, I, Is) of the EP scenarios: "small", and "kernels" where the GPU forward GEMMs run.
DIMS = {"small": (32, 16, 8), "kernels": (128, 64, 64)}


def scenario_configs(dims: str) -> list[dict]:
    return CONFIGS + GPU_BACKWARD_CONFIGS if dims == "kernels" else CONFIGS


def native_scenario(rank: int, world: int, group, device: str, dims: str = "small") -> dict:
    backend, dev = ("cuda", f"cuda:{rank}") if device == "cuda" else ("cpu", "cpu")
    H, I, Is = DIMS[dims]
    out = {}
    for routing in ("balanced", "worst"):
        inp = make_inputs(T_GLOBAL, H, I, 6, 2, Is, routing, seed=5)
        for i, kw in enumerate(scenario_configs(dims)):
            cfg = config(backend=backend, **kw)
            out[(routing, i)] = run_functional(
                inp,
                cfg,
                group=group,
                rank=rank,
                world=world,
                tokens=_slice(world, rank),
                max_tokens=T_GLOBAL,
                device=dev,
            )
    return out


def _check_ep(results: list[dict], world: int) -> None:
    for routing in ("balanced", "worst"):
        inp = make_inputs(T_GLOBAL, 32, 16, 6, 2, 8, routing, seed=5)
        for i, kw in enumerate(CONFIGS):
            ref = run_functional(inp, config(backend="reference", **kw), device="cpu", max_tokens=T_GLOBAL)
            merged = {k: torch.cat([r[(routing, i)][k] for r in results]) for k in CONTRACT_KEYS}
            assert_bitwise(ref, merged, CONTRACT_KEYS, what=f"EP {world} {routing} {kw}: ")


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_backend_across_processes(world):
    _check_ep(run_ranks(world, "test_native.native_scenario", "cpu"), world)


def cpu_megakernel_scenario(rank: int, world: int, group, device: str) -> dict:
    """Each config at EP `world` through the native CPU backend, counting the calls of moe_forward
    across ranks (the megakernel's form that reads every rank's x_src and stores into its `rows`
    by address), of the chain's ring and of moe_backward (the backward's mirror): {config index:
    (results, calls across ranks, ring calls, backward calls)}."""
    from mok_torch.backends.native import NativeBackend, megakernel

    calls = {"ranks": 0, "ring": 0, "backward": 0}
    real_launch, real_ring = megakernel.moe_forward, NativeBackend._routed_forward
    real_backward = megakernel.moe_backward

    def launch(*a, **k):
        calls["ranks"] += k.get("ranks") is not None
        return real_launch(*a, **k)

    def ring(self, *a, **k):
        calls["ring"] += 1
        return real_ring(self, *a, **k)

    def backward(*a, **k):
        calls["backward"] += 1
        return real_backward(*a, **k)

    megakernel.moe_forward = launch  # this worker process only
    megakernel.moe_backward = backward
    NativeBackend._routed_forward = ring  # type: ignore[method-assign]
    inp = make_inputs(T_GLOBAL, 32, 16, 6, 2, 8, "skewed", seed=9)
    out = {}
    for i, kw in enumerate(MEGAKERNEL_EP_CONFIGS):
        calls.update(ranks=0, ring=0, backward=0)
        res = run_functional(inp, config(backend="cpu", **kw), group=group, rank=rank, world=world,
                             tokens=_slice(world, rank), max_tokens=T_GLOBAL, device="cpu")  # fmt: skip
        out[i] = (res, calls["ranks"], calls["ring"], calls["backward"])
    return out


# The megakernel's form across ranks (pull dispatch, push combine, no replay), the chain beside it.
MEGAKERNEL_EP_CONFIGS = [
    dict(expert_alignment=8),
    dict(expert_alignment=1, fwd_num_comm_sms=2, bwd_num_comm_sms=4),
    dict(expert_alignment=8, megakernel=False),
    dict(expert_alignment=8, dispatch="push"),
]


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_megakernel_across_processes(world):
    """At EP 2 and 3 (one rank without tokens at 3) the CPU forward runs moe_forward across ranks
    where the config allows it (once a forward: the ring never runs) and its backward
    moe_backward's mirror (once), the chain elsewhere; every rank's y, dx and gradients bitwise
    the reference's."""
    if not native.megakernel.available(torch.device("cpu")):
        pytest.skip("needs mok-bf16's CPU moe_forward (mok-bf16 not installed)")
    results = run_ranks(world, "test_native.cpu_megakernel_scenario", "cpu")
    inp = make_inputs(T_GLOBAL, 32, 16, 6, 2, 8, "skewed", seed=9)
    for i, kw in enumerate(MEGAKERNEL_EP_CONFIGS):
        fused = kw.get("megakernel", True) and kw.get("dispatch", "pull") == "pull"
        for rank, r in enumerate(results):
            _, across, ring, backward = r[i]
            want = (1, 0, 1) if fused else (0, 1, 0)
            assert (across, ring, backward) == want, (world, rank, kw, across, ring, backward)
        ref = run_functional(inp, config(backend="reference", **kw), device="cpu", max_tokens=T_GLOBAL)
        merged = {k: torch.cat([r[i][0][k] for r in results]) for k in CONTRACT_KEYS}
        assert_bitwise(ref, merged, CONTRACT_KEYS, what=f"EP {world} {kw}: ")


@pytest.mark.parametrize(
    "kw, calls",
    [(dict(expert_alignment=4), 1), (dict(expert_alignment=1, dispatch="push"), 1),
     (dict(expert_alignment=4, combine="pull"), 0), (dict(expert_alignment=4, megakernel=False), 0)],
    ids=["push", "push-dispatch-align1", "pull-combine", "chain"],
)  # fmt: skip
def test_cpu_backward_at_one_rank_is_moe_backward_where_the_forward_is_moe_forward(kw, calls, monkeypatch):
    """At one rank the CPU backward after moe_forward's call is moe_backward's (once, dy and the
    weights read where the caller has them, dx and d_w into the push combine's fields); with a
    pull combine or without the megakernel the chain runs. Bitwise the reference either way."""
    if not native.megakernel.available(torch.device("cpu")):
        pytest.skip("needs mok-bf16's CPU moe_forward and moe_backward (mok-bf16 not installed)")
    seen = []
    real = native.megakernel.moe_backward
    monkeypatch.setattr(native.megakernel, "moe_backward", lambda *a, **k: seen.append(1) or real(*a, **k))
    inp = make_inputs(37, 32, 16, 6, 2, 8, "skewed", seed=12)
    got = run_functional(inp, config(backend="cpu", **kw), device="cpu")
    assert len(seen) == calls
    ref = run_functional(inp, config(backend="reference", **kw), device="cpu")
    assert_bitwise(ref, got, CONTRACT_KEYS, what=f"one rank {kw}: ")


def route_rows_scenario(rank: int, world: int, group, device: str) -> bool:
    """The native schedule's route (rank, row) arrays equal the reference's, bitwise."""
    backend, dev = ("cuda", f"cuda:{rank}") if device == "cuda" else ("cpu", "cpu")
    inp = make_inputs(T_GLOBAL, 32, 16, 6, 2, 0, "skewed", seed=3)
    top = inp.top_experts_TK[_slice(world, rank)]
    got = {}
    for name in ("reference", backend):
        cfg = config(backend=name, expert_alignment=4)
        ws = mok.get_workspace(cfg, group, device=dev, max_tokens=T_GLOBAL, hidden_size=32, topk=2, num_experts=6)
        sched = mok.build_schedule(ws, cfg, top.to(dev))
        got[name] = (sched.route_rank_TK.cpu(), sched.route_row_TK.cpu())
    (a_rank, a_row), (b_rank, b_row) = got["reference"], got[backend]
    return torch.equal(a_rank, b_rank) and torch.equal(a_row, b_row) and a_row.numel() == top.numel()


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_route_rows_match_the_reference(world):
    assert all(run_ranks(world, "test_native.route_rows_scenario", "cpu"))


def straggler_scenario(rank: int, world: int, group, device: str) -> str:
    """Both ranks make one forward; then rank 1 builds the schedule (a collective) and never calls
    forward. Rank 0's transport gives up within timeout_s, and its workspace is refused after."""
    backend, dev = ("cuda", f"cuda:{rank}") if device == "cuda" else ("cpu", "cpu")
    cfg = config(backend=backend, expert_alignment=8, timeout_s=1.0)
    inp = make_inputs(16, 32, 16, 4, 2, 0, seed=1).to(dev)
    ws = mok.get_workspace(cfg, group, device=dev, max_tokens=16, hidden_size=32, topk=2, num_experts=4)
    routed = tuple(w.to(dev) for w in inp.local_routed(rank, world))
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, routed)  # the settings agreed once
    mok.check_errors(ws)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    result = "skipped"
    if rank == 0:
        try:
            mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, routed)
            mok.check_errors(ws)
            result = "no error"
        except RuntimeError as exc:
            result = str(exc)
        try:  # the workspace's group is out of step now: refused, not run
            mok.build_schedule(ws, cfg, inp.top_experts_TK)
            result += " | the next call ran"
        except RuntimeError as exc:
            result += f" | the next call: {exc}"
    # rank 1 stays alive (its memory mapped) until rank 0 is done with it
    torch.distributed.barrier(group)
    return result


def test_rank_that_never_arrives_times_out():
    msg = run_ranks(2, "test_native.straggler_scenario", "cpu")[0]
    assert "rank 0 waited more than 1 s for rank 1" in msg and "forward: inputs written" in msg, msg
    assert "the next call: mok: this workspace is unusable" in msg, msg


def test_bad_expert_words_name_the_route():
    """The error words the table build leaves for a bad id (mok-core, on the CPU here) decode to
    the ValueError the native GPU backend raises: the id and its [t, k]."""
    import mok_core
    from mok_torch.backends.native.transport import raise_transport_error

    T, K, E = 5, 3, 4
    ws = mok.create_workspace(config(), None, device="cpu", max_tokens=T, hidden_size=8, topk=K, num_experts=E)
    for value, (t, k) in ((-9, (0, 0)), (E, (4, 2)), (2**31 - 1, (2, 1))):
        routes = torch.zeros(T, K, dtype=torch.int32)
        routes[t, k] = value
        routes[4, 2] = E + 1 if (t, k) != (4, 2) else routes[4, 2]  # a later bad route: not named
        tokens = torch.tensor([T], dtype=torch.int64)
        ptr = lambda *ts: torch.tensor([x.data_ptr() for x in ts], dtype=torch.int64)  # noqa: E731
        rows = torch.empty(ws.capacity, dtype=torch.int32)
        out = [torch.empty(ws.capacity, dtype=torch.int32), torch.empty(E + 1, dtype=torch.int32)]
        out += [torch.empty(E, dtype=torch.int32), torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int64)]
        words = torch.zeros(4, dtype=torch.int32)
        routes_ptrs, tokens_ptrs = ptr(routes), ptr(tokens)
        mok_core.build_table(
            "cpu", routes_ptrs.data_ptr(), tokens_ptrs.data_ptr(), 1, T, K, 0, E, 1, ws.capacity, rows.data_ptr(),
            *(o.data_ptr() for o in out), error=words.data_ptr(),
        )  # fmt: skip
        note = r" \(or an int64 id beyond int32\)" if value == 2**31 - 1 else ""  # (where such ids read)
        named = rf"top_experts holds expert id {value}{note} at position \[{t}, {k}\], outside"
        with pytest.raises(ValueError, match=named):
            raise_transport_error(words.tolist(), 10**9, ws)
        assert "broken" not in ws.state  # at R = 1 the workspace serves on


# ---------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing", SHAPES)
def test_cuda_backend_is_bitwise_the_reference(T, H, I, E, K, Is, routing):
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T)
    for kw in CONFIGS:
        ref = run_functional(inp, config(backend="reference", **kw), device="cpu")
        got = run_functional(inp, config(backend="cuda", **kw), device="cuda")
        assert_bitwise(ref, got, _keys(Is), what=f"cuda backend {kw}: ")


@two_gpus
def test_cuda_backend_across_gpus():
    _check_ep(run_ranks(2, "test_native.native_scenario", "cuda", device="cuda"), 2)


@two_gpus
def test_cuda_rank_that_never_arrives_times_out():
    msg = run_ranks(2, "test_native.straggler_scenario", "cuda", device="cuda")[0]
    assert "rank 0 waited more than 1 s for rank 1" in msg and "forward: inputs written" in msg, msg
    assert "the next call: mok: this workspace is unusable" in msg, msg


def graph_scenario(rank: int, world: int, group, device: str, dims: str = "small", directions: str = "") -> dict:
    """Capture schedule + forward + backward in one CUDA graph; replay it on new inputs.
    dims "kernels": H, I, Is multiples of 64 and the alignment 64, so the forward and the backward
    run mok-bf16's GPU kernels (a macrobatch smaller than the table: the backward replays).
    directions "push-pull": push dispatch and pull combine."""
    dev = torch.device("cuda", torch.cuda.current_device())
    moves = dict(dispatch="push", combine="pull") if directions == "push-pull" else {}
    if dims == "kernels":
        cfg = config(backend="cuda", expert_alignment=64, minibatch_size=64, macrobatch_size=128, **moves)
    else:
        cfg = config(backend="cuda", expert_alignment=8, minibatch_size=16, macrobatch_size=32, **moves)
    T, H, I, E, K, Is = (24, 32, 16, 4 * world, 2, 8) if dims == "small" else (24, 128, 64, 4 * world, 2, 64)
    first = make_inputs(T * world, H, I, E, K, Is, seed=1)
    second = make_inputs(T * world, H, I, E, K, Is, "skewed", seed=2)
    part = slice(rank * T, (rank + 1) * T)
    ws = mok.get_workspace(cfg, group, device=dev, max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    routed = tuple(w.to(dev) for w in first.local_routed(rank, world))
    shared = tuple(w.to(dev) for w in first.shared)
    static = {
        n: getattr(first, n)[part].contiguous().to(dev)
        for n in ("x_TH", "top_experts_TK", "router_weights_TK", "dy_TH")
    }

    def step():
        sched = mok.build_schedule(ws, cfg, static["top_experts_TK"])
        y, ctx = mok.forward(cfg, ws, sched, static["x_TH"], static["router_weights_TK"], routed, shared)
        g = mok.backward(
            cfg, ws, sched, ctx, static["dy_TH"], static["x_TH"], static["router_weights_TK"], routed, shared
        )
        return [y, g.dx, g.d_router_weights, *g.d_routed, *g.d_shared]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: allocates the workspace's (and the directions') buffers outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for n in static:  # new inputs, same tensors
        static[n].copy_(getattr(second, n)[part])
    graph.replay()
    replayed = [t.clone().cpu() for t in outs]
    eager = [t.cpu() for t in step()]
    mok.check_errors(ws)
    return {"replayed": replayed, "eager": eager}


def assert_replays_match(results: list[dict]) -> None:
    """Every rank's graph replay gave the eager call's bits."""
    assert results
    for res in results:
        assert len(res["replayed"]) == len(res["eager"]) > 0
        for a, b in zip(res["replayed"], res["eager"], strict=True):
            assert torch.equal(a, b)


def _gpu_layer_call(dims: str, seed: int):
    """(inputs on the GPU, call(top) -> mok.moe's y, the config, (T, H, I, E, K)) of a small layer on
    the cuda backend; dims "kernels": H, I multiples of 64 (mok-bf16's GEMMs, the megakernel on
    sm_90)."""
    T, H, I, E, K = (24, 32, 16, 4, 2) if dims == "small" else (40, 128, 128, 4, 2)
    cfg = config(backend="cuda", expert_alignment=8 if dims == "small" else 128)
    inp = make_inputs(T, H, I, E, K, 0, seed=seed).to(torch.device("cuda"))

    def call(top: torch.Tensor) -> torch.Tensor:
        return mok.moe(inp.x_TH, top, inp.router_weights_TK, inp.routed, config=cfg, max_tokens=T)

    return inp, call, cfg, (T, H, I, E, K)


@gpu
@pytest.mark.parametrize("dims", ["small", "kernels"])
def test_cuda_bad_expert_id_is_raised_by_the_next_call(dims):
    """On a GPU the schedule kernel checks the expert ids, so the host reads nothing: a call with
    an id outside [0, E) returns; mok.check_errors, or the next call once the device is done,
    raises the ValueError naming the first bad route; at EP 1 the workspace then serves on with
    the bits of a fresh call. The layer's router replay and a CUDA graph replay report alike.
    dims "kernels": H, I multiples of 64 (mok-bf16's GEMMs, the megakernel on sm_90)."""
    inp, call, cfg, (T, H, I, E, K) = _gpu_layer_call(dims, seed=5)
    good = call(inp.top_experts_TK)
    mok.check_errors()
    bad = inp.top_experts_TK.clone()
    bad[7, 1], bad[9, 0], bad[20, 1] = E + 3, -2, E
    first = rf"top_experts holds expert id {E + 3} at position \[7, 1\], outside \[0, {E}\)"
    with pytest.raises(ValueError, match=first):
        call(bad)  # may raise itself, if its forward finds the schedule kernel done
        mok.check_errors()
    assert torch.equal(call(inp.top_experts_TK), good)
    with pytest.raises(ValueError, match=first):
        call(bad)
        torch.cuda.synchronize()
        call(inp.top_experts_TK)  # the next call finds the finished call's words
    assert torch.equal(call(inp.top_experts_TK), good)
    mok.check_errors()

    layer = mok.MoELayer(H, I, E, K, config=cfg, max_tokens=T).to(inp.x_TH.device)
    layer(inp.x_TH, top_experts=inp.top_experts_TK)
    mok.check_errors()
    with pytest.raises(ValueError, match=first):
        layer(inp.x_TH, top_experts=bad)  # the router's gather reads clamped ids: no device assert
        mok.check_errors()

    static = inp.top_experts_TK.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = call(static)
    graph.replay()
    mok.check_errors()
    assert torch.equal(replayed, good)
    static.copy_(bad)
    graph.replay()
    with pytest.raises(ValueError, match=first):
        mok.check_errors()
    static.copy_(inp.top_experts_TK)
    graph.replay()
    mok.check_errors()
    assert torch.equal(replayed, good)
    # A replay's error words reach the next eager call too: the copy to the host's mirror is part
    # of the captured call.
    static.copy_(bad)
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=first):
        call(inp.top_experts_TK)
    assert torch.equal(call(inp.top_experts_TK), good)
    mok.check_errors()


@gpu
@pytest.mark.parametrize("dims", ["small", "kernels"])
def test_cuda_bad_expert_id_in_forward_and_backward(dims):
    """A bad id, int32 or an int64 past int32 (which a copy into int32 would wrap onto a valid
    expert), leaves its route out of the forward and of the backward: both run (no row read or
    written out of bounds: the CUDA context serves on), mok.check_errors raises the ValueError
    naming the first bad route, and a good call after gives a fresh call's bits and gradients."""
    inp, _, cfg, (T, _, _, E, _) = _gpu_layer_call(dims, seed=6)
    x = inp.x_TH.detach().clone().requires_grad_()

    def forward_backward(top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        y = mok.moe(x, top, inp.router_weights_TK, inp.routed, config=cfg, max_tokens=T)
        y.backward(inp.dy_TH.to(y.dtype))
        assert x.grad is not None
        return y.detach(), x.grad

    good = forward_backward(inp.top_experts_TK.long())
    mok.check_errors()
    bad = inp.top_experts_TK.long().clone()
    bad[7, 1], bad[9, 0], bad[20, 1] = 2**32 + 1, -(2**40), E
    with pytest.raises(ValueError, match=r"expert id 2147483647 \(or an int64 id beyond int32\) at position \[7, 1\]"):
        forward_backward(bad)
        mok.check_errors()
    again = forward_backward(inp.top_experts_TK.long())
    mok.check_errors()
    assert torch.equal(again[0], good[0]) and torch.equal(again[1], good[1])


@gpu
def test_cuda_bad_expert_id_is_raised_across_streams():
    """A call's published error words are read by a later call whichever streams they run on: calls that
    alternate between two streams (each stream waiting for the other's last call: a workspace's
    buffers serve one call at a time), the device behind the host, the bad one among them, raise
    its ValueError by a later call, and the calls that are not bad keep the bits of a fresh call."""
    inp, call, _, (_, _, _, E, _) = _gpu_layer_call("kernels", seed=7)
    good = call(inp.top_experts_TK)
    mok.check_errors()
    bad = inp.top_experts_TK.clone()
    bad[3, 1] = E + 1
    first = rf"top_experts holds expert id {E + 1} at position \[3, 1\], outside \[0, {E}\)"
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    with pytest.raises(ValueError, match=first):
        for i, top in enumerate([inp.top_experts_TK] * 3 + [bad] + [inp.top_experts_TK] * 3):
            streams[i % 2].wait_stream(streams[(i + 1) % 2])
            with torch.cuda.stream(streams[i % 2]):
                outs.append(call(top))
        torch.cuda.synchronize()
        call(inp.top_experts_TK)  # the next call finds the finished calls' words
    torch.cuda.synchronize()
    for y in outs[:3]:
        assert torch.equal(y, good)
    assert torch.equal(call(inp.top_experts_TK), good)
    mok.check_errors()


@gpu
def test_cuda_calls_on_alternating_streams_never_wait():
    """Calls that alternate between two streams while the device is far behind (each stream first
    sleeps ~0.1 s on the device) all return before the device has done any of them: the error
    words' copies to the host's mirror are queued behind each call's work, and reading the mirror
    never waits while it shows no error. Their y are a fresh call's."""
    inp, call, _, _ = _gpu_layer_call("kernels", seed=8)
    good = call(inp.top_experts_TK)
    mok.check_errors()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs, ends = [], []
    for i in range(6):
        s = streams[i % 2]
        s.wait_stream(streams[(i + 1) % 2])
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)
            outs.append(call(inp.top_experts_TK))
            end = torch.cuda.Event()
            end.record(s)
            ends.append(end)
    assert not ends[0].query(), "the host waited for the device while it issued the calls"
    torch.cuda.synchronize()
    for y in outs:
        assert torch.equal(y, good)
    mok.check_errors()


@gpu
def test_cuda_first_call_on_a_workspace_inside_a_capture_is_refused():
    """A workspace's first call makes its transport (with the error words' pinned host mirror),
    which no CUDA graph capture allows: inside one it is a RuntimeError saying to run one call
    first, and outside the capture the workspace then serves."""
    inp = make_inputs(24, 32, 16, 4, 2, 0, seed=12).to(torch.device("cuda"))
    cfg = config(backend="cuda", expert_alignment=8)
    dev = torch.device("cuda")
    ws = mok.create_workspace(cfg, None, device=dev, max_tokens=24, hidden_size=32, topk=2, num_experts=4)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run one call before capturing"):
        with torch.cuda.graph(graph):
            mok.build_schedule(ws, cfg, inp.top_experts_TK)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    assert int(sched.expert_offsets_El1[-1]) >= 24 * 2
    mok.check_errors(ws)


@gpu
@pytest.mark.parametrize("dims", ["small", "kernels"])
def test_cuda_call_never_waits_for_the_device(dims):
    """A layer call's forward and backward on a GPU issue no synchronizing CUDA call (torch's sync
    debug mode turns one into an error), once the first call has set up the workspace."""
    dev = torch.device("cuda")
    T, H, I, E, K, Is = (24, 32, 16, 4, 2, 8) if dims == "small" else (40, 128, 128, 4, 2, 64)
    cfg = config(backend="cuda", expert_alignment=8 if dims == "small" else 128)
    inp = make_inputs(T, H, I, E, K, Is, seed=6).to(dev)
    weights = [w.detach().clone().requires_grad_() for w in (*inp.routed, *inp.shared)]
    x = inp.x_TH.detach().clone().requires_grad_()

    def step() -> None:
        y = mok.moe(
            x, inp.top_experts_TK, inp.router_weights_TK, tuple(weights[:3]), tuple(weights[3:]),
            config=cfg, max_tokens=T,
        )  # fmt: skip
        y.backward(inp.dy_TH)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mok.check_errors()


@gpu
def test_cuda_graph_capture_one_gpu():
    assert_replays_match(run_ranks(1, "test_native.graph_scenario", "cuda", device="cuda"))


@gpu
def test_cuda_graph_capture_with_gpu_gemms():
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), 128, 64, 1):
        pytest.skip("mok-bf16's grouped forward needs an sm_90 GPU and a CUDA build of mok-bf16")
    assert_replays_match(run_ranks(1, "test_native.graph_scenario", "cuda", "kernels", device="cuda"))


# (T, H, I, E, K, Is, routing): H, I and Is multiples of 64, so the forward's GEMMs run on the
# tensor cores (mok-bf16's grouped forward).
KERNEL_SHAPES = [
    pytest.param(40, 128, 64, 8, 2, 64, "balanced", id="balanced-shared"),
    pytest.param(33, 64, 128, 8, 3, 0, "skewed", id="skewed"),
    pytest.param(20, 64, 64, 4, 2, 0, "worst", id="worst"),
    pytest.param(1, 64, 64, 4, 1, 64, "balanced", id="one-token-K1-shared"),
]


@gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing", KERNEL_SHAPES)
@pytest.mark.parametrize("backward", ["reference-backward", "gpu-backward"])
def test_cuda_backend_with_gpu_gemms(T, H, I, E, K, Is, routing, backward, monkeypatch):
    """The GEMMs on the tensor cores (the forward's; the backward's too with an alignment that is
    a multiple of 64): every contract key bitwise the same across the batching configs, and
    within bf16 rounding of the reference backend (not bitwise: the tensor cores sum in their own
    fixed order)."""
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-bf16's grouped forward needs an sm_90 GPU and a CUDA build of mok-bf16")
    calls: dict[str, int] = {"forward": 0, "backward": 0}
    real_fwd = native.grouped_forward

    def forward(*a, **k):
        calls["forward"] += 1
        return real_fwd(*a, **k)

    def counted(real):
        def backward(*a, **k):  # the routed experts' calls (the shared expert's has no router weights)
            calls["backward"] += a[5] is not None
            return real(*a, **k)

        return backward

    monkeypatch.setattr(native, "grouped_forward", forward)
    # The routed backward launches without the checked wrapper (launch_backward), or calls it
    # for a macrobatch without rows.
    monkeypatch.setattr(native, "grouped_backward", counted(native.grouped_backward))
    monkeypatch.setattr(native, "launch_backward", counted(native.launch_backward))
    # ... or, one rank's direct backward, in one extension call (backward_call).
    real_call = native.backward_call
    monkeypatch.setattr(native, "backward_call", lambda *a, **k: calls.update(backward=calls["backward"] + 1)
                        or real_call(*a, **k))  # fmt: skip
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + H)
    ref = run_functional(inp, config(backend="reference", expert_alignment=8), device="cpu")
    configs = GPU_BACKWARD_CONFIGS if backward == "gpu-backward" else CONFIGS
    first = None
    for kw in configs:
        got = run_functional(inp, config(backend="cuda", **kw), device="cuda")
        if first is None:
            first = got
        else:
            assert_bitwise(first, got, _keys(Is), what=f"cuda backend {kw} vs {configs[0]}: ")
    assert calls["forward"], "the GPU GEMMs did not run"
    if backward == "gpu-backward":
        assert calls["backward"], "the GPU backward did not run"
    else:
        assert not calls["backward"], "alignment < 64 must keep the routed experts' reference backward"
    for key in _keys(Is):
        want, have = ref[key].double(), first[key].double()
        rel = ((have - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert rel <= 1e-2, f"{key}: relative L2 error {rel:.2e} against the reference backend"


@gpu
@pytest.mark.parametrize("T,H,I,E,K,Is,routing", KERNEL_SHAPES)
@pytest.mark.parametrize("wgrad_dtype", [torch.bfloat16, torch.float32], ids=["bf16-wgrads", "fp32-wgrads"])
def test_cuda_one_rank_backward_in_one_call(T, H, I, E, K, Is, routing, wgrad_dtype, monkeypatch):
    """One rank's direct backward (one macrobatch, a push combine, dy gathered by the g GEMM) is
    issued as one extension call (grouped.backward_call: the offsets widened, the routed kernels, d_router
    by route, the combine onto the shared expert's dx), with the bits of the backend's walk over
    the same kernels (the lane switched off): dx, d_router and every weight gradient."""
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-bf16's grouped kernels need an sm_90 GPU and a CUDA build of mok-bf16")
    calls: list[int] = []
    real = native.backward_call
    monkeypatch.setattr(native, "backward_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + 3)
    got = run_functional(inp, config(backend="cuda", expert_alignment=64), device="cuda", wgrad_dtype=wgrad_dtype)
    assert calls == [1], "the direct backward was not one call"
    monkeypatch.setattr(native.NativeBackend, "_backward_lane", staticmethod(lambda *a: False))
    want = run_functional(inp, config(backend="cuda", expert_alignment=64), device="cuda", wgrad_dtype=wgrad_dtype)
    assert calls == [1]
    assert got["dWg"].dtype == wgrad_dtype
    assert_bitwise(want, got, _keys(Is), what="one call vs the walk: ")


@gpu
@pytest.mark.parametrize("combine", ["push", "pull"])
def test_cuda_one_rank_scatters_token_rows(combine, monkeypatch):
    """At one rank on the chain in one macrobatch the token rows go into table order by
    scatter_local: x in the forward; dy in the backward where the g GEMM does not gather it (a
    pull combine here; above H 4096 always). The bits are those of the pulls (the configs of
    test_cuda_backend_with_gpu_gemms hold them to each other); here: that it ran, and where."""
    T, H, I, E, K = 45, 128, 64, 8, 3
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-bf16's grouped forward needs an sm_90 GPU and a CUDA build of mok-bf16")
    from mok_torch.backends.native.transport import Transport

    scattered: list[int] = []
    real = Transport.scatter_local

    def scatter_local(self, src_TH, dst, *a, **k):
        scattered.append(src_TH.shape[0])
        return real(self, src_TH, dst, *a, **k)

    monkeypatch.setattr(Transport, "scatter_local", scatter_local)
    inp = make_inputs(T, H, I, E, K, 0, "skewed", seed=9)
    cfg = config(backend="cuda", expert_alignment=64, megakernel=False, combine=combine)
    got = run_functional(inp, cfg, device="cuda")
    assert scattered == ([T] if combine == "push" else [T, T]), scattered
    pulled = run_functional(inp, config(backend="cuda", expert_alignment=64, megakernel=False, macrobatch_size=128,
                                        minibatch_size=64, combine=combine), device="cuda")  # fmt: skip
    assert len(scattered) == (1 if combine == "push" else 2), "more than one macrobatch must not scatter"
    assert_bitwise(pulled, got, CONTRACT_KEYS, what=f"scattered vs pulled rows ({combine} combine): ")


@gpu
@pytest.mark.parametrize("combine", ["push", "pull"])
def test_cuda_one_rank_recompute_scatters_token_rows(combine, monkeypatch):
    """The recompute of a forward's context at one rank on the chain in one macrobatch runs the
    experts as the forward does (_scattered_experts: x scattered by the table's addresses, then the
    GEMMs without outputs) and gives the forward's context bitwise, and the same gradients."""
    T, H, I, E, K = 45, 128, 64, 8, 3
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-bf16's grouped forward needs an sm_90 GPU and a CUDA build of mok-bf16")
    calls: list[bool] = []
    real = native.NativeBackend._scattered_experts

    def scattered_experts(self, *a, **k):
        calls.append(a[-1] is not None)  # whether y rows were asked for (the forward) or not (a recompute)
        return real(self, *a, **k)

    monkeypatch.setattr(native.NativeBackend, "_scattered_experts", scattered_experts)
    inp = make_inputs(T, H, I, E, K, 16, "skewed", seed=12).to("cuda")
    cfg = config(backend="cuda", expert_alignment=64, megakernel=False, combine=combine)
    ws = mok.get_workspace(cfg, None, device="cuda", max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    _, ctx = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    again = mok.recompute_forward_context(cfg, ws, sched, inp.x_TH, inp.routed, inp.shared)
    assert calls == [True, False], calls
    for name in ("x_routed_MH", "a_MI", "b_MI", "shared_a_TIs", "shared_b_TIs"):
        assert torch.equal(getattr(ctx, name), getattr(again, name)), name
    args = (inp.dy_TH, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    g1 = mok.backward(cfg, ws, sched, ctx, *args)
    g2 = mok.backward(cfg, ws, sched, again, *args)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(tuple(g1)), torch.utils._pytree.tree_leaves(tuple(g2)), strict=True
    ):
        assert torch.equal(a, b)


@two_gpus
def test_cuda_backend_with_gpu_gemms_across_gpus():
    """EP 2 on two GPUs gives EP 1's bits with the tensor-core GEMMs (every contract key), with
    the reference backward (alignment < 64) and with the GPU backward."""
    H, I, Is = DIMS["kernels"]
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-bf16's grouped forward needs an sm_90 GPU and a CUDA build of mok-bf16")
    results = run_ranks(2, "test_native.native_scenario", "cuda", "kernels", device="cuda")
    for routing in ("balanced", "worst"):
        inp = make_inputs(T_GLOBAL, H, I, 6, 2, Is, routing, seed=5)
        for i, kw in enumerate(scenario_configs("kernels")):
            one = run_functional(inp, config(backend="cuda", **kw), device="cuda", max_tokens=T_GLOBAL)
            merged = {k: torch.cat([r[(routing, i)][k] for r in results]) for k in CONTRACT_KEYS}
            assert_bitwise(one, merged, CONTRACT_KEYS, what=f"EP 2 vs EP 1, GPU GEMMs, {routing} {kw}: ")


@two_gpus
@pytest.mark.parametrize("directions", ["", "push-pull"])
def test_cuda_graph_capture_two_gpus(directions):
    assert_replays_match(run_ranks(2, "test_native.graph_scenario", "cuda", "small", directions, device="cuda"))


@two_gpus
def test_cuda_graph_capture_two_gpus_gpu_gemms_push_pull():
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), 128, 64, 1):
        pytest.skip("mok-bf16's grouped forward needs an sm_90 GPU and a CUDA build of mok-bf16")
    assert_replays_match(run_ranks(2, "test_native.graph_scenario", "cuda", "kernels", "push-pull", device="cuda"))


@two_gpus
def test_cuda_route_rows_match_the_reference():
    assert all(run_ranks(2, "test_native.route_rows_scenario", "cuda", device="cuda"))


def _send_side_order(monkeypatch, experts: str) -> list[str]:
    """Record, in order, the entries of the routed experts (`experts`: the method that runs them),
    the Schedule's making (_source_side) and its send side's issue."""
    from mok_torch.backends.native import NativeBackend

    order: list[str] = []
    for name in (experts, "_source_side", "_issue_source_side"):
        real = getattr(NativeBackend, name)
        if isinstance(inspect.getattr_static(NativeBackend, name), staticmethod):

            def wrap_static(*a, _real=real, _name=name, **k):
                order.append(_name)
                return _real(*a, **k)

            monkeypatch.setattr(NativeBackend, name, staticmethod(wrap_static))
            continue

        def wrap(self, *a, _real=real, _name=name, **k):
            order.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(NativeBackend, name, wrap)
    return order


@pytest.mark.parametrize("kw", CONFIGS)
@pytest.mark.parametrize("routes", [torch.int64, torch.int32])
def test_cpu_send_side_issued_at_its_first_read(kw, routes, monkeypatch):
    """mok.moe's eager call at one rank issues the schedule's send side at its first read: a pull
    dispatch's forward reads none of it (issued by the backward's moves or the test's reads, after
    the experts), a push dispatch's row moves read it before the experts; on the megakernel's path
    (moe_forward, which moves no rows) the Schedule's tensors are made after the experts too;
    either way the schedule, y, context and gradients are those of build_schedule then forward."""
    inp = make_inputs(30, 32, 48, 8, 3, 8, "skewed", seed=6)
    inp = dataclasses.replace(inp, top_experts_TK=inp.top_experts_TK.to(routes))
    cfg = config(backend="cpu", **kw)
    ws = mok.get_workspace(cfg, None, device="cpu", max_tokens=30, hidden_size=32, topk=3, num_experts=8)
    fused_path = native.expert_path(cfg, ws, 48).forward == "megakernel"
    experts = "_megakernel_launch" if fused_path else "_routed_forward"
    order = _send_side_order(monkeypatch, experts)
    assert_fused_forward_is_the_two_calls(inp, cfg, device="cpu")
    # build_schedule, then forward (its routed forward), then schedule_and_forward
    assert order[:3] == ["_source_side", "_issue_source_side", experts], order
    push = kw.get("dispatch", "pull") == "push"
    if fused_path:
        fused = [experts, "_source_side"]
    else:
        fused = ["_source_side"] + (["_issue_source_side", experts] if push else [experts])
    assert order[3 : 3 + len(fused)] == fused, order
    assert order.count("_issue_source_side") == 2, order  # once a schedule


def test_cpu_send_side_test_sees_both_paths():
    """The test above covers the megakernel's order and the chain's (CONFIGS hold both at one rank)."""
    paths = set()
    for kw in CONFIGS:
        cfg = config(backend="cpu", **kw)
        ws = mok.get_workspace(cfg, None, device="cpu", max_tokens=30, hidden_size=32, topk=3, num_experts=8)
        paths.add(native.expert_path(cfg, ws, 48).forward)
    if not native.megakernel.available(torch.device("cpu")):
        pytest.skip("needs mok-bf16's CPU moe_forward (mok-bf16 not installed)")
    assert paths == {"megakernel", "cpu-kernels"}, paths


@pytest.mark.parametrize("routes", [torch.int64, torch.int32])
def test_cpu_deferred_send_side_is_the_routes_at_the_call(routes, monkeypatch):
    """At one rank schedule_and_forward issues no send side; its first read issues it once, on
    the routes as they were at the call (the Schedule's own int32 copy), whatever the caller wrote
    into its routes since: the values build_schedule gives for them."""
    from mok_torch import functional
    from mok_torch.backends.native import NativeBackend
    from mok_torch.structs import PENDING_SEND_SIDE, SEND_SIDE, LazySendSide

    inp = make_inputs(30, 32, 48, 8, 3, 8, "skewed", seed=7)
    top = inp.top_experts_TK.to(routes)
    cfg = config(backend="cpu")
    ws = mok.get_workspace(cfg, None, device="cpu", max_tokens=30, hidden_size=32, topk=3, num_experts=8)
    want = mok.build_schedule(ws, cfg, top.clone())
    issued: list[int] = []
    real = NativeBackend._issue_source_side
    monkeypatch.setattr(NativeBackend, "_issue_source_side", lambda *a: issued.append(1) or real(*a))
    sched, _, _ = functional.schedule_and_forward(cfg, ws, top, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    assert isinstance(sched, LazySendSide) and PENDING_SEND_SIDE in sched.aux and not issued
    top.copy_(top.flip(0))  # the caller reuses its routes' storage
    for name in SEND_SIDE:
        assert torch.equal(getattr(sched, name), getattr(want, name)), name
    assert issued == [1] and PENDING_SEND_SIDE not in sched.aux
    assert torch.equal(sched.top_experts_TK, want.top_experts_TK)


@gpu
@pytest.mark.parametrize("combine", ["push", "pull"])
@pytest.mark.parametrize("routes", [torch.int64, torch.int32])
def test_cuda_chain_issues_the_send_side_after_the_gemms(combine, routes, monkeypatch):
    """At one rank on the chain of GPU kernels the token rows are scattered into the table and the
    GEMMs issued right after it (the scatter reads no route ranks); with a push combine the
    Schedule's tensors are made after them too; the send side is issued at its first read, after
    the GEMMs (the direct backward reads none of it: the test's reads of the fields issue it): the
    same schedule and bits as build_schedule then forward."""
    T, H, I, E, K = 45, 128, 64, 8, 3
    if not native.gpu_forward_kernels(config(backend="cuda"), torch.device("cuda"), H, I, 1):
        pytest.skip("mok-bf16's grouped forward needs an sm_90 GPU and a CUDA build of mok-bf16")
    inp = make_inputs(T, H, I, E, K, 16, "skewed", seed=10)
    inp = dataclasses.replace(inp, top_experts_TK=inp.top_experts_TK.to(routes))
    order = _send_side_order(monkeypatch, "_scattered_experts")
    cfg = config(backend="cuda", expert_alignment=64, megakernel=False, combine=combine)
    assert_fused_forward_is_the_two_calls(inp, cfg, device="cuda")
    # build_schedule's Schedule and send side; forward's experts; then schedule_and_forward's
    assert order[:3] == ["_source_side", "_issue_source_side", "_scattered_experts"], order
    fused = ["_scattered_experts", "_source_side"] if combine == "push" else ["_source_side", "_scattered_experts"]
    assert order[3:] == fused + ["_issue_source_side"], order


def test_cpu_backend_without_expert_kernels_is_bitwise_the_reference(monkeypatch):
    """The PyTorch expert path the cuda backend runs (no mok-bf16 kernels there yet), on the CPU."""
    import mok_torch.backends.native as native

    monkeypatch.setattr(native, "_expert_kernels", lambda device_type: None)
    inp = make_inputs(37, 64, 32, 8, 2, 16, "skewed", seed=4)
    for kw in CONFIGS:
        ref = run_functional(inp, config(backend="reference", **kw), device="cpu")
        got = run_functional(inp, config(backend="cpu", **kw), device="cpu")
        assert_bitwise(ref, got, ALL_KEYS + ("saved_rows",), what=f"cpu backend, PyTorch experts, {kw}: ")


def no_numpy_scenario(rank: int, world: int, group, device: str) -> bool:
    """The CPU transport's rendezvous without numpy (the demo's environment has none)."""

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    torch.Tensor.numpy = no_numpy  # type: ignore[method-assign]  # this worker process only
    inp = make_inputs(8 * world, 32, 16, 4, 2, 0, seed=3)
    res = run_functional(inp, config(backend="cpu", expert_alignment=8), group=group, rank=rank, world=world,
                         tokens=slice(8 * rank, 8 * (rank + 1)), max_tokens=8, device="cpu")  # fmt: skip
    return bool(res["y"].isfinite().all())


def test_cpu_transport_rendezvous_needs_no_numpy():
    assert all(run_ranks(2, "test_native.no_numpy_scenario", "cpu"))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_context_without_routed_x_outside_its_lane_raises(backend):
    """A context whose forward kept no routed x (the one-call lane's, where dW1 gathers x) handed
    to a backward that reads the saved rows is a ValueError saying so, not a crash."""
    inp = make_inputs(24, 32, 16, 4, 2, 0, "balanced", seed=4)
    cfg = config(backend=backend, expert_alignment=8)
    ws = mok.get_workspace(cfg, None, device="cpu", max_tokens=24, hidden_size=32, topk=2, num_experts=4)
    sched = mok.build_schedule(ws, cfg, inp.top_experts_TK)
    _, ctx = mok.forward(cfg, ws, sched, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
    ctx = dataclasses.replace(ctx, x_routed_MH=None)
    with pytest.raises(ValueError, match="keeps no routed x rows"):
        mok.backward(cfg, ws, sched, ctx, inp.dy_TH, inp.x_TH, inp.router_weights_TK, inp.routed, inp.shared)
