"""mok_bf16.moe_backward_call called directly (through grouped.backward_call): one rank's direct
backward in one extension call, the table's offsets widened, the grouped backward reading dy and
the router weights by route with d_w stored by route, and mok-core's combine of dx reached through
mok_core.entry_points() (the host's one crossing per backward, docs/megakernel.md "The host").

Bitwise the separate calls (grouped_backward with the int64 offsets, d_w gathered by each route's
row, mok_core.combine through the route rows) on the same table and context: dx, d_router and the
weight gradients, bf16 and fp32, with and without a base (the shared expert's dx). A bad argument
is a ValueError naming it; a wrong entry-point object a TypeError.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch

mok_bf16 = pytest.importorskip("mok_bf16", reason="mok-bf16 is not installed")
mok_core = pytest.importorskip("mok_core", reason="mok-core is not installed")

from mok_torch.backends.native.grouped import GroupedBackward, backward_call, grouped_backward  # noqa: E402
from mok_torch.backends.native.transport import core_entry_points  # noqa: E402

BF16 = torch.bfloat16
GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_gpu = pytest.mark.skipif(
    not GPU or "cuda" not in mok_bf16.build_info()["backends"],
    reason="needs an sm_90 GPU and mok-bf16 built with CUDA; none here",
)


class Case:
    """One rank's schedule table for routes [T, K] (built by mok-core on the GPU), a context over
    its C rows (x, a, b; zeros past the last segment and in padding rows, as the forward leaves
    them), dy, the router weights and the weights."""

    def __init__(self, T, H, I, El, K, align, routing, seed, bad_route=False):
        gen = torch.Generator().manual_seed(seed)
        if routing == "one-expert":
            routes = torch.zeros(T, K, dtype=torch.int64)
        else:
            routes = torch.stack([torch.randperm(El, generator=gen)[:K] for _ in range(T)]).reshape(T, K).long()
            if routing == "skewed":
                routes = torch.where(torch.rand(T, K, generator=gen) < 0.6, torch.zeros_like(routes), routes)
        if bad_route:  # an id outside [0, El): the table leaves the route out (its row -1)
            routes[T // 2, 0] = El + 3
        dev = self.dev = torch.device("cuda")
        self.T, self.H, self.I, self.El, self.K = T, H, I, El, K
        max_tokens = T + 3
        self.C = C = mok_core.schedule_capacity(1, max_tokens, K, El, align)
        self.routes = routes.to(torch.int32).to(dev)
        self.row_src, self.row_route = (torch.empty(C, dtype=torch.int32, device=dev) for _ in range(2))
        self.offsets = torch.empty(El + 1, dtype=torch.int32, device=dev)
        counts = torch.empty(El, dtype=torch.int32, device=dev)
        recv, tokens = (torch.empty(1, dtype=torch.int64, device=dev) for _ in range(2))
        self.route_row = torch.empty(T, K, dtype=torch.int32, device=dev)
        copy = torch.empty(T * K, dtype=torch.int32, device=dev)
        error = torch.zeros(4, dtype=torch.int32, device=dev)
        scratch = torch.empty(max(mok_core.schedule_scratch_bytes(1, max_tokens, K, El), 4), dtype=torch.uint8,
                              device=dev)  # fmt: skip
        mok_core.build_table(
            "cuda", 0, 0, 1, max_tokens, K, 0, El, align, C, self.row_src.data_ptr(), self.row_route.data_ptr(),
            self.offsets.data_ptr(), counts.data_ptr(), recv.data_ptr(), tokens.data_ptr(), self.stream(),
            scratch=scratch.data_ptr(), error=error.data_ptr(), local_routes=True, routes=self.routes.data_ptr(),
            routes_int64=False, num_tokens=T, route_row=self.route_row.data_ptr(), routes_copy=copy.data_ptr(),
        )  # fmt: skip
        used = (self.row_route >= 0)[:, None]
        rnd = lambda *s: torch.randn(*s, generator=gen).to(BF16).to(dev)  # noqa: E731
        self.a, self.b = (torch.where(used, rnd(C, n), 0) for n in (I, I))
        # x's token rows, and each table row's x (its route's token row; zeros where no route).
        self.x_tokens = rnd(T, H)
        self.x = torch.where(used, self.x_tokens[self.row_route.clamp(min=0).long() // K], 0)
        self.dy = rnd(T, H)
        self.w = torch.rand(T, K, generator=gen).to(dev)
        self.weights = tuple(
            (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(BF16).to(dev)
            for shape in ((El, I, H), (El, I, H), (El, H, I))
        )
        self.base = rnd(T, H)

    def stream(self):
        return torch.cuda.current_stream(self.dev).cuda_stream

    def wgrads(self, dtype):
        El, I, H = self.El, self.I, self.H
        return tuple(torch.full(s, 3.0, dtype=dtype, device=self.dev) for s in ((El, I, H), (El, I, H), (El, H, I)))


def separate_calls(c: Case, dtype, base, limit):
    """grouped_backward on the table (its offsets as int64), d_w gathered by each route's row (0
    for a route no row holds), then mok_core.combine of the dx rows through the route rows."""
    fp32 = dtype == torch.float32
    grads = c.wgrads(dtype)
    rows = torch.full((c.C, c.H), float("nan"), dtype=BF16, device=c.dev)
    out = GroupedBackward(rows, torch.full((c.C,), float("nan"), device=c.dev))
    grouped_backward(
        c.x, c.offsets.long(), c.a, c.b, rows, c.w.reshape(-1), *c.weights, grads if fp32 else None, limit,
        out=out, carry_in=False, wgrad_out=None if fp32 else grads, weight_route=c.row_route, dy_tokens=c.dy,
    )  # fmt: skip
    route_row = c.route_row.reshape(-1)
    d_router = torch.where(route_row >= 0, out.d_w[route_row.clamp(min=0).long()], 0.0).view(c.T, c.K)
    dx = torch.full((c.T, c.H), float("nan"), dtype=BF16, device=c.dev)
    mok_core.combine("cuda", dx.data_ptr(), 0 if base is None else base.data_ptr(), rows.data_ptr(), 0, c.T, c.K,
                     c.H, c.stream(), row_index=route_row.data_ptr(), num_rows=c.C)  # fmt: skip
    return dx, d_router, grads


def one_call(c: Case, dtype, base, limit, gather_x=False):
    """backward_call with x's rows in table order, or (gather_x) gathered by dW1 from the token rows."""
    grads = c.wgrads(dtype)
    dx, d_router = backward_call(
        c.offsets, c.row_route, c.route_row, None if gather_x else c.x, c.a, c.b, c.dy, c.w, c.weights, grads, base,
        x_TH=c.x_tokens if gather_x else None, limit=limit, stream=c.stream(),
    )  # fmt: skip
    return dx, d_router, grads


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


GPU_CASES = [
    pytest.param(512, 128, 64, 8, 2, 128, "balanced", id="balanced"),
    pytest.param(331, 128, 128, 16, 4, 64, "skewed", id="prime-T-skewed"),
    pytest.param(1, 128, 64, 4, 1, 128, "balanced", id="one-token-K1"),
    pytest.param(200, 256, 64, 4, 1, 128, "one-expert", id="one-expert-holds-every-row"),
]


@needs_gpu
@pytest.mark.parametrize("gather_x", [False, True], ids=["x-in-table-order", "x-gathered"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16-wgrads", "fp32-wgrads"])
@pytest.mark.parametrize("with_base", [False, True], ids=["no-base", "base"])
@pytest.mark.parametrize("T,H,I,El,K,align,routing", GPU_CASES)
def test_gpu_moe_backward_call_is_the_separate_calls(T, H, I, El, K, align, routing, with_base, dtype, gather_x):
    """The one call against the separate ones (x in table order there), the call reading x's rows
    in table order or gathering them by route from the token rows in dW1 (no table-ordered x)."""
    c = Case(T, H, I, El, K, align, routing, seed=T)
    base = c.base if with_base else None
    limit = 7.0 if T % 2 else None
    want, got = separate_calls(c, dtype, base, limit), one_call(c, dtype, base, limit, gather_x)
    torch.cuda.synchronize()
    for name, w, g in zip(("dx", "d_router", "dWg", "dWu", "dWd"), (*want[:2], *want[2]), (*got[:2], *got[2]),
                          strict=True):  # fmt: skip
        assert torch.equal(bits(w), bits(g)), f"{name} differs from the separate calls'"
        assert not bool(torch.isnan(g.float()).any()), f"every element of {name} is written"


@needs_gpu
def test_gpu_a_route_no_row_holds_reads_zero():
    """A bad expert id leaves its route out of the table (row -1, and the next call raises): its
    d_router is 0 and dx takes no term from it, never an unwritten value."""
    c = Case(64, 128, 64, 8, 2, 128, "balanced", seed=5, bad_route=True)
    assert int(c.route_row[32, 0]) == -1
    dx, d_router, _ = one_call(c, BF16, None, None)
    want = separate_calls(c, BF16, None, None)
    assert float(d_router[32, 0]) == 0.0
    assert torch.equal(bits(dx), bits(want[0])) and torch.equal(bits(d_router), bits(want[1]))


@needs_gpu
def test_gpu_moe_backward_call_publishes_the_error_words():
    """Given the error words and an ErrorMirror's address, the call's combine copies the words to
    the mirror behind its work (the words as they are: set here by hand)."""
    c = Case(64, 128, 64, 8, 2, 128, "balanced", seed=6)
    mirror = mok_core.ErrorMirror("cuda")
    error = torch.tensor([3, 1, 2, 0], dtype=torch.int32, device="cuda")
    grads = c.wgrads(BF16)
    backward_call(c.offsets, c.row_route, c.route_row, c.x, c.a, c.b, c.dy, c.w, c.weights, grads, None, limit=None,
                  error=error.data_ptr(), mirror=mirror.device_address, stream=c.stream())  # fmt: skip
    torch.cuda.synchronize()
    assert mirror.read() == [3, 1, 2, 0]


def raw_args(**change):
    """moe_backward_call's arguments on the CPU (addresses of small tensors; nothing runs there)."""
    t = torch.zeros(4096, dtype=torch.float32)
    p = t.data_ptr()
    args = dict(
        entry_points=core_entry_points(), device="cuda", offsets32=p, offsets=p, x=p, a=p, b=p, dy=p,
        router_weights=p, weight_route=p, dy_tokens=p, x_tokens=0, num_tokens=4, topk=2, w_gate=p, w_up=p, w_down=p,
        out_d_router=p, acc_gate=0, acc_up=0, acc_down=0, out_gate=p, out_up=p, out_down=p, scratch_g=p,
        scratch_hw=p, scratch_d_ab=p, num_rows=64, hidden=64, inner=64, num_experts=2, limit=None, out=p, base=0,
        route_row=p, error=0, error_mirror=0, stream=0,
    )  # fmt: skip
    args.update(change)
    return list(args.values()), t


def test_moe_backward_call_is_for_cuda_only():
    args, _keep = raw_args(device="cpu")
    with pytest.raises(ValueError, match='device must be "cuda"'):
        mok_bf16.moe_backward_call(*args)


def test_moe_backward_call_refuses_another_object_as_entry_points():
    args, _keep = raw_args(entry_points=object())
    with pytest.raises(TypeError):
        mok_bf16.moe_backward_call(*args)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_rows=0), "num_rows and num_tokens must be >= 1"),
        (dict(num_tokens=0), "num_tokens"),
        (dict(weight_route=0), "read dy and the weights by route"),
        (dict(dy_tokens=0), "read dy and the weights by route"),
        (dict(out_d_router=0), "read dy and the weights by route"),
        (dict(route_row=0), "the combine must sum"),
        (dict(offsets32=0), "offsets32 must not be 0"),
        (dict(offsets=2), "offsets must be aligned to 8"),
        (dict(num_experts=2000), "num_experts must be in"),
        (dict(x=0), "x must not be 0"),
        (dict(x_tokens=2), "x_tokens must be aligned to 16"),
        (dict(error_mirror=4096), "error and error_mirror must both be given"),
    ],
)
def test_moe_backward_call_raises_naming_the_argument(change, match):
    """Checked on the host before any launch (so on a machine without a GPU too)."""
    args, _keep = raw_args(**change)
    with pytest.raises(ValueError, match=match):
        mok_bf16.moe_backward_call(*args)


def test_grouped_backward_d_w_by_route_needs_the_routes():
    """grouped_backward's out_d_w_routes (d_w stored by route) is read through weight_route."""
    t = torch.zeros(1024, dtype=torch.float32)
    offsets = torch.tensor([0, 4, 8], dtype=torch.int64)
    p = t.data_ptr()
    with pytest.raises(ValueError, match="out_d_w_routes needs weight_route"):
        mok_bf16.grouped_backward("cpu", p, offsets.data_ptr(), p, p, p, p, p, p, p, p, p, p, p, p, 0, 0, 0, False,
                                  0, 0, 0, 8, 64, 64, 2, out_d_w_routes=p)  # fmt: skip


def test_backward_call_takes_x_in_table_order_or_by_token_not_both():
    """grouped.backward_call: x_CH (table order) or x_TH (dW1 gathers by route), exactly one."""
    t = torch.zeros(8, 64, dtype=BF16)
    for x_CH, x_TH in ((None, None), (t, t)):
        with pytest.raises(ValueError, match=r"x_CH.*or the token rows .x_TH., one of them"):
            backward_call(t, t, t, x_CH, t, t, t, torch.zeros(4, 2), (t, t, t), (t, t, t), None, x_TH=x_TH,
                          limit=None, stream=0)  # fmt: skip
