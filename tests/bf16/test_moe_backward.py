"""mok_bf16.moe_backward called directly: the routed experts' backward of a layer call in one call,
from each route's dy and router weight where its source rank keeps them to one dx row and one
d_router value per route there, at one rank and across ranks (each table row's dy and weight read
from its source rank by address, its dx and d_w stored into that rank's arrays: the mirror of
moe_forward's protocol, docs/megakernel.md "Next" 6).

On the CPU: bitwise mok_bf16.grouped_backward on the same rows moved into table order by hand (dx
and d_w taken to their routes, the weight gradients from +0 and carried in), the same bits for any
thread count; nothing written past a source's own routes, nor for padding rows. On "cuda" it is
refused (one rank's backward there is moe_backward_call). Bad arguments are a ValueError naming
them.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch

mok_bf16 = pytest.importorskip("mok_bf16", reason="mok-bf16 is not installed")

from test_moe_forward import CASES, _inputs  # noqa: E402
from test_moe_forward import _call as forward_call  # noqa: E402

BF16 = torch.bfloat16
F32 = torch.float32


def _gradients(Ts, H, K, seed):
    """Each rank's dy [T, H] and router weights [T*K]."""
    gen = torch.Generator().manual_seed(seed)
    dy_R = [torch.randn(T, H, generator=gen).to(BF16) for T in Ts]
    w_R = [torch.rand(T * K, generator=gen) for T in Ts]
    return dy_R, w_R


def _wgrads(El, H, I, fill):
    return [torch.full(s, fill, dtype=F32) for s in ((El, I, H), (El, I, H), (El, H, I))]


def _backward(ctx, table, weights, dy_R, w_R, K, *, limit=None, threads=1, carried=None, d_router=True,
              weighted=True):  # fmt: skip
    """moe_backward over the ranks' dy_R and w_R (at one rank the plain arguments).
    Returns (dx_R, dr_R, wgrads): each rank's dx rows [T_max * K, H] and d_router [T_max * K]
    (NaN-filled first, so a value not written shows) and the fp32 weight gradients (from +0, or
    carried in from `carried`)."""
    x_rows, a, b = ctx
    row_route, row_src, offsets = table
    wg, wu, wd = weights
    El, I, H = wg.shape
    R = len(dy_R)
    across = R > 1
    C = row_route.numel()
    T_max = max(dy.shape[0] for dy in dy_R)
    dx_R = [torch.full((T_max * K, H), float("nan"), dtype=BF16) for _ in range(R)]
    dr_R = [torch.full((T_max * K,), float("nan"), dtype=F32) for _ in range(R)]
    acc = [t.clone() for t in carried] if carried is not None else _wgrads(El, H, I, float("nan"))
    addresses = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    ptrs = {name: addresses(ts) for name, ts in (("dy", dy_R), ("w", w_R), ("dx", dx_R), ("dr", dr_R))}
    kw: dict = dict(world_size=R, row_src=row_src.data_ptr(), dy_ranks=ptrs["dy"].data_ptr(),
                    weights_ranks=ptrs["w"].data_ptr(), out_dx_rows_ranks=ptrs["dx"].data_ptr(),
                    out_d_router_ranks=ptrs["dr"].data_ptr() if d_router else 0)  # fmt: skip
    one = (dy_R[0].data_ptr(), w_R[0].data_ptr() if weighted else 0, dx_R[0].data_ptr(),
           dr_R[0].data_ptr() if d_router else 0)  # fmt: skip
    if across:
        one = (0, 0, 0, 0)
    else:
        kw = {}
    mok_bf16.moe_backward(
        "cpu", x_rows.data_ptr(), a.data_ptr(), b.data_ptr(), row_route.data_ptr(), offsets.data_ptr(),
        wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), *one, *(t.data_ptr() for t in acc), 0, 0, 0,
        carried is not None, C, T_max, H, I, El, K, limit=limit, num_threads=threads, **kw,
    )  # fmt: skip
    return dx_R, dr_R, acc


def _chain(ctx, table, weights, dy_R, w_R, K, *, limit=None, carried=None, weighted=True):
    """The same rows by grouped_backward on the CPU: dy and w moved into table order by hand
    (zeros and weight 0 for padding rows), then each row's dx and d_w taken to its route.
    ({(src, route): (dx row, d_w)}, fp32 weight gradients)."""
    x_rows, a, b = ctx
    row_route, row_src, offsets = table
    wg, wu, wd = weights
    El, I, H = wg.shape
    C = row_route.numel()
    used = int(offsets[-1])
    dy = torch.zeros(C, H, dtype=BF16)
    w = torch.zeros(C, dtype=F32)
    for r in range(used):
        if row_route[r] >= 0:
            src, route = int(row_src[r]), int(row_route[r])
            dy[r] = dy_R[src][route // K]
            w[r] = w_R[src][route]
    dx = torch.zeros(C, H, dtype=BF16)
    d_w = torch.zeros(C, dtype=F32)
    acc = [t.clone() for t in carried] if carried is not None else _wgrads(El, H, I, float("nan"))
    off64 = offsets.to(torch.int64)
    mok_bf16.grouped_backward(
        "cpu", x_rows.data_ptr(), off64.data_ptr(), a.data_ptr(), b.data_ptr(), dy.data_ptr(),
        w.data_ptr() if weighted else 0, wg.data_ptr(), wu.data_ptr(), wd.data_ptr(), dx.data_ptr(),
        d_w.data_ptr(), *(t.data_ptr() for t in acc), 0, 0, 0, carried is not None, 0, 0, 0, C, H, I, El,
        limit=limit,
    )  # fmt: skip
    want = {(int(row_src[r]), int(row_route[r])): (dx[r], d_w[r]) for r in range(used) if row_route[r] >= 0}
    return want, acc


def _case(Ts, H, I, El, K, routing, align, extra, limit, seed=0):
    """The forward's inputs and its context (moe_forward on the CPU), and the ranks' gradients."""
    x_R, table, weights, _ = _inputs(Ts, H, I, El, K, routing, align, extra, seed=seed)
    _, a, b, x_rows = forward_call(x_R, table, weights, K, limit=limit)
    dy_R, w_R = _gradients(Ts, H, K, seed + 7)
    return (x_rows, a, b), table, weights, dy_R, w_R


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == BF16 else torch.int32)


def _assert_routes(Ts, K, dx_R, dr_R, want):
    for src, (T, dx, dr) in enumerate(zip(Ts, dx_R, dr_R, strict=True)):
        for route in range(T * K):  # every route of every source written, with the chain's bits
            want_dx, want_dw = want[(src, route)]
            assert torch.equal(_bits(dx[route]), _bits(want_dx)), (src, route)
            assert torch.equal(_bits(dr[route]), _bits(want_dw)), (src, route)
        assert torch.isnan(dx[T * K :].float()).all() and torch.isnan(dr[T * K :]).all()  # nothing past its routes


@pytest.mark.parametrize("Ts,H,I,El,K,routing,align,extra,limit", CASES)
def test_cpu_moe_backward_is_the_grouped_backward(Ts, H, I, El, K, routing, align, extra, limit):
    ctx, table, weights, dy_R, w_R = _case(Ts, H, I, El, K, routing, align, extra, limit)
    dx_R, dr_R, acc = _backward(ctx, table, weights, dy_R, w_R, K, limit=limit)
    want, acc_want = _chain(ctx, table, weights, dy_R, w_R, K, limit=limit)
    _assert_routes(Ts, K, dx_R, dr_R, want)
    for got, expected in zip(acc, acc_want, strict=True):
        assert torch.equal(_bits(got), _bits(expected))


def test_cpu_moe_backward_carries_the_weight_gradients_in():
    ctx, table, weights, dy_R, w_R = _case((21, 9), 64, 32, 8, 2, "skewed", 4, 2, None, seed=2)
    El, I, H = weights[0].shape
    gen = torch.Generator().manual_seed(9)
    carried = [torch.randn(t.shape, generator=gen) for t in _wgrads(El, H, I, 0.0)]
    _, _, acc = _backward(ctx, table, weights, dy_R, w_R, 2, carried=carried)
    _, acc_want = _chain(ctx, table, weights, dy_R, w_R, 2, carried=carried)
    for got, expected, start in zip(acc, acc_want, carried, strict=True):
        assert torch.equal(_bits(got), _bits(expected))
        assert not torch.equal(got, start)  # the rows added something


def test_cpu_moe_backward_unweighted_and_without_d_router():
    """Without router weights (one rank) every weight is 1: the bits of weights of exactly 1; and
    without out_d_router nothing of d_router is written."""
    ctx, table, weights, dy_R, w_R = _case((37,), 64, 32, 4, 2, "balanced", 1, 0, None, seed=4)
    ones = [torch.ones_like(w) for w in w_R]
    unweighted = _backward(ctx, table, weights, dy_R, w_R, 2, weighted=False, d_router=False)
    with_ones = _backward(ctx, table, weights, dy_R, ones, 2)
    for u, v in zip((*unweighted[0], *unweighted[2]), (*with_ones[0], *with_ones[2]), strict=True):
        assert torch.equal(_bits(u), _bits(v))
    assert torch.isnan(unweighted[1][0]).all()
    weighted = _backward(ctx, table, weights, dy_R, w_R, 2)
    assert not torch.equal(weighted[0][0], with_ones[0][0])  # the weights do reach dx


def test_cpu_moe_backward_bits_do_not_depend_on_threads():
    ctx, table, weights, dy_R, w_R = _case((40, 17), 64, 32, 8, 2, "skewed", 4, 3, None, seed=5)
    one = _backward(ctx, table, weights, dy_R, w_R, 2, threads=1)
    three = _backward(ctx, table, weights, dy_R, w_R, 2, threads=3)
    for u, v in zip((*one[0], *one[1], *one[2]), (*three[0], *three[1], *three[2]), strict=True):
        assert torch.equal(_bits(u), _bits(v))


def test_cpu_moe_backward_bad_source_or_route_is_a_padding_row():
    """A row whose source rank or route is out of range reads nothing and writes nothing: its
    route keeps the NaN fill, and the results are the chain's with that row made padding."""
    ctx, table, weights, dy_R, w_R = _case((21, 9), 64, 32, 8, 2, "skewed", 4, 2, None, seed=6)
    row_route, row_src, offsets = (t.clone() for t in table)
    used = [r for r in range(int(offsets[-1])) if row_route[r] >= 0]
    lost_src = (int(row_src[used[0]]), int(row_route[used[0]]))
    row_src[used[0]] = 5  # no such rank
    lost_route = (int(row_src[used[1]]), int(row_route[used[1]]))
    row_route[used[1]] = 21 * 2 + 1  # past every rank's routes
    bad = (row_route, row_src, offsets)
    dx_R, dr_R, acc = _backward(ctx, bad, weights, dy_R, w_R, 2)
    padded = list(table)
    padded[0] = table[0].clone()
    padded[0][used[0]] = padded[0][used[1]] = -1
    want, acc_want = _chain(ctx, tuple(padded), weights, dy_R, w_R, 2)
    for src, route in (lost_src, lost_route):
        assert torch.isnan(dx_R[src][route].float()).all() and torch.isnan(dr_R[src][route])
    for (src, route), (want_dx, want_dw) in want.items():
        assert torch.equal(_bits(dx_R[src][route]), _bits(want_dx)), (src, route)
        assert torch.equal(_bits(dr_R[src][route]), _bits(want_dw)), (src, route)
    for got, expected in zip(acc, acc_want, strict=True):
        assert torch.equal(_bits(got), _bits(expected))


def _plain_args(**change):
    """Valid one-rank arguments (by keyword) over a small case, with `change` applied."""
    ctx, table, weights, dy_R, w_R = _case((5,), 64, 32, 4, 2, "balanced", 4, 0, None, seed=8)
    x_rows, a, b = ctx
    row_route, _, offsets = table
    wg, wu, wd = weights
    El, I, H = wg.shape
    keep = [x_rows, a, b, row_route, offsets, wg, wu, wd, *dy_R, *w_R]  # alive for the call
    dx = torch.empty(5 * 2, H, dtype=BF16)
    acc = _wgrads(El, H, I, 0.0)
    keep += [dx, *acc]
    kw = dict(device="cpu", x=x_rows.data_ptr(), a=a.data_ptr(), b=b.data_ptr(), row_route=row_route.data_ptr(),
              offsets=offsets.data_ptr(), w_gate=wg.data_ptr(), w_up=wu.data_ptr(), w_down=wd.data_ptr(),
              dy=dy_R[0].data_ptr(), router_weights=w_R[0].data_ptr(), out_dx_rows=dx.data_ptr(), out_d_router=0,
              acc_gate=acc[0].data_ptr(), acc_up=acc[1].data_ptr(), acc_down=acc[2].data_ptr(), out_gate=0,
              out_up=0, out_down=0, carry_in=False, capacity=row_route.numel(), num_tokens=5, hidden=H, inner=I,
              num_experts=El, topk=2)  # fmt: skip
    kw.update(change)
    return kw, keep, offsets


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(device="cuda"), r'device must be "cpu"'),
        (dict(dy=0), "dy must not be 0"),
        (dict(out_dx_rows=0), "out_dx_rows must not be 0"),
        (dict(acc_down=0), "acc_down must not be 0"),
        (dict(topk=0), "topk must be >= 1"),
        (dict(num_tokens=-1), "num_tokens must be >= 0"),
        (dict(world_size=0), "world_size must be >= 1"),
        (dict(world_size=2), "row_src must not be 0"),
        (dict(num_threads=0), "num_threads"),
    ],
    ids=["cuda", "dy", "out_dx_rows", "acc_down", "topk", "num_tokens", "world_size", "ranks", "threads"],
)
def test_moe_backward_raises_naming_the_argument(change, match):
    kw, _keep, _ = _plain_args(**change)
    with pytest.raises(ValueError, match=match):
        mok_bf16.moe_backward(**kw)


def test_moe_backward_bad_offsets_raise():
    kw, _keep, offsets = _plain_args()
    offsets[1] = offsets[2] + 1  # decreasing
    with pytest.raises(ValueError, match=r"offsets\[2\]"):
        mok_bf16.moe_backward(**kw)
