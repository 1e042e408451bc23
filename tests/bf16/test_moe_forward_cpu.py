"""mok_bf16.moe_forward on the CPU: the whole routed forward of a layer call in one call, from the
token rows to one output row per route, at one rank and across ranks (each table row read from its
source rank's token rows and its output stored into that rank's rows, by address: the protocol the
megakernel's EP > 1 path takes, docs/megakernel.md). Bitwise the CPU's grouped forward on the same
rows moved into table order by hand, within bf16 tolerance of a float64 loop, the same bits for any
thread count; bad arguments are a ValueError naming them.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch

mok_bf16 = pytest.importorskip("mok_bf16", reason="mok-bf16 is not installed")

BF16 = torch.bfloat16


def _table(routes_R, El: int, K: int, align: int, extra: int, seed: int):
    """A schedule table over the ranks' routes (routes_R[s]: int64 [T_s, K] local expert ids, -1:
    not routed here): each expert's rows by (source, route) ascending, padded to `align` rows with
    route -1, then `extra` rows past the last segment. (row_route, row_src, offsets) int32."""
    rows: list[list[tuple[int, int]]] = [[] for _ in range(El)]
    for src, routes in enumerate(routes_R):
        for route, e in enumerate(routes.reshape(-1).tolist()):
            if e >= 0:
                rows[e].append((src, route))
    row_route, row_src, offsets = [], [], [0]
    for e in range(El):
        pad = -len(rows[e]) % align
        for src, route in rows[e] + [(0, -1)] * pad:
            row_src.append(src)
            row_route.append(route)
        offsets.append(len(row_route))
    gen = torch.Generator().manual_seed(seed)
    # Rows past the last segment hold garbage routes: they must be neither read nor stored.
    row_route += torch.randint(0, 4, (extra,), generator=gen).tolist()
    row_src += [0] * extra
    i32 = torch.int32
    return torch.tensor(row_route, dtype=i32), torch.tensor(row_src, dtype=i32), torch.tensor(offsets, dtype=i32)


def _weights(El: int, H: int, I: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wg = (torch.randn(El, I, H, generator=gen) / H**0.5).to(BF16)
    wu = (torch.randn(El, I, H, generator=gen) / H**0.5).to(BF16)
    wd = (torch.randn(El, H, I, generator=gen) / I**0.5).to(BF16)
    return wg, wu, wd


def _routes(T: int, K: int, El: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    if routing == "one-expert":  # every route to expert 0 (K distinct experts impossible: K = 1)
        return torch.zeros(T, K, dtype=torch.int64)
    if routing == "skewed":
        picks = torch.stack([torch.randperm(El, generator=gen)[:K] for _ in range(T)])
        return torch.where(torch.rand(T, K, generator=gen) < 0.6, torch.zeros_like(picks), picks).long()
    return torch.stack([torch.randperm(El, generator=gen)[:K] for _ in range(T)]).long().reshape(T, K)


def _call(x_R, table, weights, K, *, limit=None, threads=1, context=True):
    """moe_forward over the ranks' token rows x_R (at one rank: the plain arguments). Returns
    (rows_R, a, b, x_rows): each rank's output rows [T_max * K, H] (NaN-filled first, so a row not
    written shows), and the context."""
    row_route, row_src, offsets = table
    wg, wu, wd = weights
    El, I, H = wg.shape
    R = len(x_R)
    C = row_route.numel()
    T_max = max(x.shape[0] for x in x_R)
    rows_R = [torch.full((T_max * K, H), float("nan"), dtype=BF16) for _ in range(R)]
    a = torch.full((C, I), float("nan"), dtype=BF16) if context else None
    b = torch.full((C, I), float("nan"), dtype=BF16) if context else None
    x_rows = torch.full((C, H), float("nan"), dtype=BF16) if context else None
    h = torch.empty(C, I, dtype=BF16)
    x_ptrs = torch.tensor([x.data_ptr() for x in x_R], dtype=torch.int64)
    out_ptrs = torch.tensor([r.data_ptr() for r in rows_R], dtype=torch.int64)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    across = dict(
        world_size=R, row_src=row_src.data_ptr(), x_ranks=x_ptrs.data_ptr(), out_rows_ranks=out_ptrs.data_ptr()
    )
    mok_bf16.moe_forward(
        "cpu", x_R[0].data_ptr() if R == 1 else 0, row_route.data_ptr(), offsets.data_ptr(), wg.data_ptr(),
        wu.data_ptr(), wd.data_ptr(), ptr(a), ptr(b), h.data_ptr(), rows_R[0].data_ptr() if R == 1 else 0, 0, 0,
        C, T_max, H, I, El, K, limit=limit, out_x=ptr(x_rows), num_threads=threads, **(across if R > 1 else {}),
    )  # fmt: skip
    return rows_R, a, b, x_rows


def _chain(x_R, table, weights, K, limit=None):
    """The same rows by the CPU's grouped forward: x moved into table order by hand, then each
    row's y taken to its route. (rows_R as a dict {(src, route): y row}, a, b, x_rows)."""
    row_route, row_src, offsets = table
    wg, wu, wd = weights
    El, I, H = wg.shape
    C = row_route.numel()
    used = int(offsets[-1])
    x_rows = torch.zeros(C, H, dtype=BF16)
    for r in range(used):
        if row_route[r] >= 0:
            x_rows[r] = x_R[int(row_src[r])][int(row_route[r]) // K]
    a, b, h = (torch.zeros(C, I, dtype=BF16) for _ in range(3))
    y = torch.zeros(C, H, dtype=BF16)
    off64 = offsets.to(torch.int64)
    ptrs = (t.data_ptr() for t in (x_rows, off64, wg, wu, wd, a, b, h, y))
    mok_bf16.grouped_forward("cpu", *ptrs, C, H, I, El, limit=limit)
    want = {(int(row_src[r]), int(row_route[r])): y[r] for r in range(used) if row_route[r] >= 0}
    return want, a, b, x_rows


# (T per rank, H, I, El, K, routing, align, extra, limit): one token, K = 1, one expert with every
# row, empty experts, odd T, padding rows inside the segments and past the last one.
CASES = [
    pytest.param((37,), 64, 32, 4, 2, "balanced", 1, 0, None, id="one-rank"),
    pytest.param((1,), 32, 16, 4, 1, "balanced", 8, 5, None, id="one-token-K1-padded"),
    pytest.param((29,), 48, 24, 8, 1, "one-expert", 4, 3, 0.25, id="one-expert-limit"),
    pytest.param((21, 9), 64, 32, 8, 2, "skewed", 4, 2, None, id="two-ranks-skewed"),
    pytest.param((5, 0, 13, 1), 32, 16, 16, 3, "balanced", 2, 1, None, id="four-ranks-one-empty"),
]


def _inputs(Ts, H, I, El, K, routing, align, extra, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_R = [torch.randn(T, H, generator=gen).to(BF16) for T in Ts]
    routes_R = [_routes(T, K, El, routing, gen) for T in Ts]
    return x_R, _table(routes_R, El, K, align, extra, seed), _weights(El, H, I, seed + 1), routes_R


@pytest.mark.parametrize("Ts,H,I,El,K,routing,align,extra,limit", CASES)
def test_cpu_moe_forward_is_the_grouped_forward(Ts, H, I, El, K, routing, align, extra, limit):
    x_R, table, weights, _ = _inputs(Ts, H, I, El, K, routing, align, extra)
    rows_R, a, b, x_rows = _call(x_R, table, weights, K, limit=limit)
    want, a_want, b_want, x_want = _chain(x_R, table, weights, K, limit=limit)
    assert torch.equal(x_rows.view(torch.int16), x_want.view(torch.int16))
    assert torch.equal(a.view(torch.int16), a_want.view(torch.int16))
    assert torch.equal(b.view(torch.int16), b_want.view(torch.int16))
    for src, (T, rows) in enumerate(zip(Ts, rows_R, strict=True)):
        for route in range(T * K):  # every route of every source written, with the chain's bits
            assert torch.equal(rows[route].view(torch.int16), want[(src, route)].view(torch.int16)), (src, route)
        assert torch.isnan(rows[T * K :].float()).all()  # nothing past the source's own routes


@pytest.mark.parametrize("Ts,H,I,El,K,routing,align,extra,limit", CASES[3:])
def test_cpu_moe_forward_matches_fp64_loop(Ts, H, I, El, K, routing, align, extra, limit):
    """Each route's output against a float64 SwiGLU of its token row (bf16 tolerance)."""
    x_R, table, weights, routes_R = _inputs(Ts, H, I, El, K, routing, align, extra, seed=3)
    rows_R, *_ = _call(x_R, table, weights, K, limit=limit)
    wg, wu, wd = (w.double() for w in weights)
    for x, routes, rows in zip(x_R, routes_R, rows_R, strict=True):
        for route, e in enumerate(routes.reshape(-1).tolist()):
            xt = x[route // K].double()
            h = torch.nn.functional.silu(wg[e] @ xt) * (wu[e] @ xt)
            torch.testing.assert_close(rows[route].double(), wd[e] @ h, atol=3e-2, rtol=3e-2)


def test_cpu_moe_forward_bits_do_not_depend_on_threads_or_context():
    x_R, table, weights, _ = _inputs((40, 17), 64, 32, 8, 2, "skewed", 4, 3, seed=5)
    one = _call(x_R, table, weights, 2, threads=1)
    for got in (_call(x_R, table, weights, 2, threads=3), _call(x_R, table, weights, 2, threads=2, context=False)):
        for want_rows, got_rows in zip(one[0], got[0], strict=True):
            assert torch.equal(want_rows.view(torch.int16), got_rows.view(torch.int16))
    threaded = _call(x_R, table, weights, 2, threads=3)
    for want, got in zip(one[1:], threaded[1:], strict=True):
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))


def test_cpu_moe_forward_rejects_bad_arguments():
    x_R, table, weights, _ = _inputs((8, 8), 32, 16, 4, 2, "balanced", 2, 0)
    row_route, _, offsets = table
    wg, wu, wd = weights
    C = row_route.numel()
    h, rows = torch.empty(C, 16, dtype=BF16), torch.empty(16, 32, dtype=BF16)
    base = dict(device="cpu", x=x_R[0].data_ptr(), row_route=row_route.data_ptr(), offsets=offsets.data_ptr(),
                w_gate=wg.data_ptr(), w_up=wu.data_ptr(), w_down=wd.data_ptr(), out_a=0, out_b=0,
                scratch_h=h.data_ptr(), out_rows=rows.data_ptr(), task_state=0, error=0, capacity=C, num_tokens=8,
                hidden=32, inner=16, num_experts=4, topk=2)  # fmt: skip
    with pytest.raises(ValueError, match="row_src, x_ranks and out_rows_ranks are required"):
        mok_bf16.moe_forward(**base, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        mok_bf16.moe_forward(**base, world_size=0)
    with pytest.raises(ValueError, match="num_threads"):
        mok_bf16.moe_forward(**base, num_threads=0)
    with pytest.raises(ValueError, match="x must be given"):
        mok_bf16.moe_forward(**{**base, "x": 0})
    bad = offsets.clone()
    bad[1] = int(offsets[2]) + 1  # above offsets[2]: decreasing
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing within \[0, capacity"):
        mok_bf16.moe_forward(**{**base, "offsets": bad.data_ptr()})
    past = offsets.clone()
    past[-1] = C + 1
    with pytest.raises(ValueError, match="offsets"):
        mok_bf16.moe_forward(**{**base, "offsets": past.data_ptr()})
