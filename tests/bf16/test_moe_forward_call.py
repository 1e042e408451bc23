"""mok_bf16.moe_forward_call called directly: one rank's schedule table, the routed experts and the
combine in one extension call, mok-core's two steps reached through mok_core.entry_points() (the
host's one crossing per forward, docs/megakernel.md "The host").

Bitwise the three calls one after another (mok_core.build_table, mok_bf16.moe_forward,
mok_core.combine) on the same inputs: every array of the table, y, and on an sm_90 GPU the
context (a, b and the routed x rows). A bad argument of any step is the ValueError that step's own
call raises, carried across the two modules; a wrong entry-point object a TypeError.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch

mok_bf16 = pytest.importorskip("mok_bf16", reason="mok-bf16 is not installed")
mok_core = pytest.importorskip("mok_core", reason="mok-core is not installed")

BF16 = torch.bfloat16
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_gpu = pytest.mark.skipif(
    not GPU or "cuda" not in mok_bf16.build_info()["backends"],
    reason="needs an sm_90 GPU and mok-bf16 built with CUDA; none here",
)
STAGE = 9


class Case:
    """The inputs and the arrays of one call: routes [T, K] (global ids, one rank holds all El),
    token rows, weights, router weights, and freshly NaN-/garbage-filled outputs."""

    def __init__(self, device, T, H, I, El, K, align, routing, int64, seed, context, limit=None):
        gen = torch.Generator().manual_seed(seed)
        if routing == "one-expert" or T == 0:
            routes = torch.zeros(T, K, dtype=torch.int64)
        else:
            routes = torch.stack([torch.randperm(El, generator=gen)[:K] for _ in range(T)]).reshape(T, K).long()
            if routing == "skewed":
                routes = torch.where(torch.rand(T, K, generator=gen) < 0.6, torch.zeros_like(routes), routes)
        self.dev, self.T, self.H, self.I, self.El, self.K, self.align = torch.device(device), T, H, I, El, K, align
        self.max_tokens = max(T, 1) + 3  # the workspace's bound, above T
        self.C = mok_core.schedule_capacity(1, self.max_tokens, K, El, align)
        self.routes = routes.to(torch.int64 if int64 else torch.int32).to(self.dev)
        self.x = (torch.randn(T, H, generator=gen)).to(BF16).to(self.dev)
        self.w = torch.rand(T, K, generator=gen).to(self.dev)
        self.weights = tuple(
            (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(BF16).to(self.dev)
            for shape in ((El, I, H), (El, I, H), (El, H, I))
        )
        self.context, self.limit = context, limit

    def arrays(self):
        """Fresh outputs: the table's eight arrays (int32 words, garbage), the routes' rows, y, h,
        the context (NaN: a row not written shows), the task state and error words (zero)."""
        C, T, K, El, dev = self.C, self.T, self.K, self.El, self.dev
        sizes = [2, 2, C, C, El + 1, El, T * K, T * K]
        table = [torch.full((n,), -7, dtype=torch.int32, device=dev) for n in sizes]
        nan = lambda *s: torch.full(s, float("nan"), dtype=BF16, device=dev)  # noqa: E731
        out = dict(
            table=table,
            rows=nan(max(T, 1) * K, self.H),
            y=nan(T, self.H),
            h=torch.empty(C, self.I, dtype=BF16, device=dev),
            a=nan(C, self.I) if self.context else None,
            b=nan(C, self.I) if self.context else None,
            x_rows=nan(C, self.H) if self.context else None,
            error=torch.zeros(4, dtype=torch.int32, device=dev),
        )
        if dev.type == "cuda":
            nbytes = mok_bf16.moe_forward_state_bytes(C, El)
            out["state"] = torch.zeros(-(-nbytes // 8), dtype=torch.int64, device=dev)
            scratch = mok_core.schedule_scratch_bytes(1, self.max_tokens, K, El)
            out["scratch"] = torch.empty(max(scratch, 4), dtype=torch.uint8, device=dev)
        return out

    def stream(self):
        return torch.cuda.current_stream(self.dev).cuda_stream if self.dev.type == "cuda" else 0


def ptr(t):
    return 0 if t is None else t.data_ptr()


def three_calls(c: Case):
    """build_table, moe_forward and combine, each its own call."""
    o = c.arrays()
    t, cuda = o["table"], c.dev.type == "cuda"
    mok_core.build_table(
        c.dev.type, 0, 0, 1, c.max_tokens, c.K, 0, c.El, c.align, c.C, t[2].data_ptr(), t[3].data_ptr(),
        t[4].data_ptr(), t[5].data_ptr(), t[0].data_ptr(), t[1].data_ptr(), c.stream(),
        scratch=ptr(o.get("scratch")), error=o["error"].data_ptr(), local_routes=True, routes=c.routes.data_ptr(),
        routes_int64=c.routes.dtype == torch.int64, num_tokens=c.T, route_row=t[6].data_ptr(),
        routes_copy=t[7].data_ptr(),
    )  # fmt: skip
    # On the CPU the experts run the table's rows in use (what the native backend reads on the host).
    rows = c.C if cuda else int(t[4][-1])
    wg, wu, wd = c.weights
    mok_bf16.moe_forward(
        c.dev.type, c.x.data_ptr(), t[3].data_ptr(), t[4].data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(),
        ptr(o["a"]), ptr(o["b"]), o["h"].data_ptr(), o["rows"].data_ptr(), ptr(o.get("state")), o["error"].data_ptr(),
        rows, c.T, c.H, c.I, c.El, c.K, limit=c.limit, timeout_ns=int(30e9), stage=STAGE, stream=c.stream(),
        out_x=ptr(o["x_rows"]),
    )  # fmt: skip
    w = c.w.float().reshape(-1).contiguous()
    mok_core.combine(c.dev.type, o["y"].data_ptr(), 0, o["rows"].data_ptr(), w.data_ptr(), c.T, c.K, c.H, c.stream())
    return o


def one_call(c: Case, **change):
    """moe_forward_call on the same inputs (keyword `change` replaces an argument by name)."""
    o = c.arrays()
    t = o["table"]
    wg, wu, wd = c.weights
    w = c.w.float().reshape(-1).contiguous()
    args = dict(
        entry_points=mok_core.entry_points(), device=c.dev.type, routes=c.routes.data_ptr(),
        routes_int64=c.routes.dtype == torch.int64, num_tokens=c.T, max_tokens=c.max_tokens, topk=c.K,
        alignment=c.align, capacity=c.C, row_src_rank=t[2].data_ptr(), row_route=t[3].data_ptr(),
        expert_offsets=t[4].data_ptr(), expert_counts=t[5].data_ptr(), recv_counts=t[0].data_ptr(),
        tokens_per_rank=t[1].data_ptr(), route_row=t[6].data_ptr(), routes_copy=t[7].data_ptr(),
        table_scratch=ptr(o.get("scratch")), x=c.x.data_ptr(), w_gate=wg.data_ptr(), w_up=wu.data_ptr(),
        w_down=wd.data_ptr(), out_a=ptr(o["a"]), out_b=ptr(o["b"]), out_x=ptr(o["x_rows"]), scratch_h=o["h"].data_ptr(),
        rows=o["rows"].data_ptr(), task_state=ptr(o.get("state")), error=o["error"].data_ptr(), hidden=c.H,
        inner=c.I, num_experts=c.El, limit=c.limit, timeout_ns=int(30e9), stage=STAGE,
        num_threads=1, out=o["y"].data_ptr(), weights=w.data_ptr(), error_mirror=0, stream=c.stream(),
    )  # fmt: skip
    args.update(change)
    mok_bf16.moe_forward_call(*args.values())
    return o


def assert_same(c: Case, want, got):
    if c.dev.type == "cuda":
        torch.cuda.synchronize(c.dev)
        assert int(got["error"][0]) == 0, got["error"].tolist()
        assert not bool(got["state"].any()), "every launch leaves its task queue and counters zero"
    for i, (w, g) in enumerate(zip(want["table"], got["table"], strict=True)):
        assert torch.equal(w, g), f"the table's array {i} differs"
    assert torch.equal(want["y"], got["y"]), "y differs from the three calls'"
    assert not bool(torch.isnan(got["y"]).any()), "every token's y is written"
    if c.context:
        for name in ("a", "b", "x_rows"):
            assert torch.equal(want[name], got[name]), f"{name} differs from the three calls'"


CASES = [
    pytest.param(64, 64, 32, 8, 2, 8, "balanced", False, id="balanced-int32"),
    pytest.param(37, 64, 32, 8, 2, 16, "skewed", True, id="odd-T-skewed-int64"),
    pytest.param(1, 64, 32, 4, 1, 8, "balanced", False, id="one-token-K1"),
    pytest.param(23, 64, 32, 4, 1, 8, "one-expert", True, id="one-expert-holds-every-row"),
    pytest.param(0, 64, 32, 4, 2, 8, "balanced", False, id="no-tokens"),
]


@pytest.mark.parametrize("T,H,I,El,K,align,routing,int64", CASES)
def test_cpu_moe_forward_call_is_the_three_calls(T, H, I, El, K, align, routing, int64):
    c = Case("cpu", T, H, I, El, K, align, routing, int64, seed=T, context=False)
    assert_same(c, three_calls(c), one_call(c))


def test_cpu_moe_forward_call_with_limit():
    c = Case("cpu", 40, 64, 32, 8, 2, 8, "skewed", False, seed=3, context=False, limit=0.75)
    assert_same(c, three_calls(c), one_call(c))


GPU_CASES = [
    pytest.param(512, 128, 64, 8, 2, 128, "balanced", False, id="balanced-int32"),
    pytest.param(331, 128, 128, 16, 4, 64, "skewed", True, id="prime-T-skewed-int64"),
    pytest.param(1, 128, 64, 4, 1, 128, "balanced", False, id="one-token-K1"),
    pytest.param(200, 256, 64, 4, 1, 128, "one-expert", True, id="one-expert-holds-every-row"),
    pytest.param(0, 128, 64, 4, 2, 128, "balanced", False, id="no-tokens"),
]


@needs_gpu
@pytest.mark.parametrize("context", [True, False], ids=["context", "no-context"])
@pytest.mark.parametrize("T,H,I,El,K,align,routing,int64", GPU_CASES)
def test_gpu_moe_forward_call_is_the_three_calls(T, H, I, El, K, align, routing, int64, context):
    c = Case("cuda", T, H, I, El, K, align, routing, int64, seed=T, context=context, limit=7.0 if T % 2 else None)
    assert_same(c, three_calls(c), one_call(c))


def test_moe_forward_call_refuses_another_object_as_entry_points():
    c = Case("cpu", 8, 64, 32, 4, 2, 8, "balanced", False, seed=0, context=False)
    with pytest.raises(TypeError):
        one_call(c, entry_points=object())


def test_moe_forward_call_raises_each_steps_value_error():
    """A bad argument of the table (alignment), of the experts (num_threads) or of the combine's
    shape is that step's ValueError, naming the argument, across the modules' boundary."""
    c = Case("cpu", 8, 64, 32, 4, 2, 8, "balanced", False, seed=0, context=False)
    with pytest.raises(ValueError, match="alignment"):
        one_call(c, alignment=3)
    with pytest.raises(ValueError, match="num_threads"):
        one_call(c, num_threads=0)
    with pytest.raises(ValueError, match="out_a, out_b and out_x"):
        o = torch.empty(c.C, c.I, dtype=BF16)
        one_call(c, out_a=o.data_ptr(), out_b=o.data_ptr())
    with pytest.raises(ValueError, match="topk"):
        one_call(c, topk=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("T", [23, 0], ids=["tokens", "no-tokens"])
def test_moe_forward_call_publishes_the_error_words(device, T):
    """Given an ErrorMirror's address, the call's combine copies the error words there behind its
    work (with no tokens too, where no combine kernel runs): a bad expert id's words as the table
    recorded them, then a clean call's zeros once the device's words are cleared."""
    H, I, align = (64, 32, 8) if device == "cpu" else (128, 64, 64)
    c = Case(device, T, H, I, 4, 2, align, "balanced", False, seed=2, context=False)
    mirror = mok_core.ErrorMirror(device)
    if T:
        c.routes[T // 2, 1] = c.El + 5
    o = one_call(c, error_mirror=mirror.device_address)
    if device == "cuda":
        torch.cuda.synchronize()
    assert mirror.read() == o["error"].tolist()
    assert (mirror.read()[0] != 0) == (T > 0), "a bad id's route is recorded and published"
    c.routes[:] = 0
    o = one_call(c, error_mirror=mirror.device_address)
    if device == "cuda":
        torch.cuda.synchronize()
    assert mirror.read() == [0, 0, 0, 0] == o["error"].tolist()
