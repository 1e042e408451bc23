"""mok_bf16.moe_forward called directly: the whole routed forward of a layer call in one call, from
the token rows to one output row per route, at one rank and across ranks (each table row read from
its source rank's token rows and its output stored into that rank's rows, by address: the protocol
the megakernel's EP > 1 path takes, docs/megakernel.md).

On the CPU: bitwise the CPU's grouped forward on the same rows moved into table order by hand,
within bf16 tolerance of a float64 loop, the same bits for any thread count. On an sm_90 GPU (R
ranks' buffers on the one device): bitwise the one-rank kernel on every rank's rows stacked, for
any grid, a source rank or route out of range a padding row. Bad arguments are a ValueError naming
them on either device (checked before anything is launched).

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


GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_gpu = pytest.mark.skipif(
    not GPU or "cuda" not in mok_bf16.build_info()["backends"],
    reason="needs an sm_90 GPU and mok-bf16 built with CUDA; none here",
)


def _call(x_R, table, weights, K, *, limit=None, threads=1, context=True, num_sms=0, ranks=None):
    """moe_forward over the ranks' token rows x_R on their device (at one rank: the plain
    arguments, unless `ranks` is True). Returns (rows_R, a, b, x_rows): each rank's output rows
    [T_max * K, H] (NaN-filled first, so a row not written shows), and the context."""
    row_route, row_src, offsets = table
    wg, wu, wd = weights
    El, I, H = wg.shape
    dev = x_R[0].device
    R = len(x_R)
    across = R > 1 if ranks is None else ranks
    C = row_route.numel()
    T_max = max(x.shape[0] for x in x_R)

    def nan(*shape):
        return torch.full(shape, float("nan"), dtype=BF16, device=dev)

    rows_R = [nan(T_max * K, H) for _ in range(R)]
    a, b, x_rows = (nan(C, I), nan(C, I), nan(C, H)) if context else (None, None, None)
    h = torch.empty(C, I, dtype=BF16, device=dev)
    x_ptrs = torch.tensor([x.data_ptr() for x in x_R], dtype=torch.int64, device=dev)
    out_ptrs = torch.tensor([r.data_ptr() for r in rows_R], dtype=torch.int64, device=dev)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    kw: dict = dict(
        world_size=R, row_src=row_src.data_ptr(), x_ranks=x_ptrs.data_ptr(), out_rows_ranks=out_ptrs.data_ptr()
    )
    state = error = None
    if dev.type == "cuda":
        state_bytes = mok_bf16.moe_forward_state_bytes(C, El)
        state = torch.zeros(-(-state_bytes // 8), dtype=torch.int64, device=dev)
        error = torch.zeros(4, dtype=torch.int32, device=dev)
        kw.update(stream=torch.cuda.current_stream(dev).cuda_stream, num_sms=num_sms, timeout_ns=int(30e9))
    else:
        kw.update(num_threads=threads)
    if not across:
        del kw["world_size"], kw["row_src"], kw["x_ranks"], kw["out_rows_ranks"]
    mok_bf16.moe_forward(
        dev.type, 0 if across else x_R[0].data_ptr(), row_route.data_ptr(), offsets.data_ptr(), wg.data_ptr(),
        wu.data_ptr(), wd.data_ptr(), ptr(a), ptr(b), h.data_ptr(), 0 if across else rows_R[0].data_ptr(),
        ptr(state), ptr(error), C, T_max, H, I, El, K, limit=limit, out_x=ptr(x_rows), **kw,
    )  # fmt: skip
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        assert int(error[0]) == 0, error.tolist()
        assert not bool(state.any()), "every launch leaves its task queue and counters zero"
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


# ------------------------------------------------------------------ GPU: R ranks' rows on one device

# (T per rank, H, I, El, K, routing, align, extra): a rank with no tokens, one token, K = 1 and
# K = 8, segments of any length (align 1) and of 128 rows, one expert holding every row, H not a
# multiple of 256, tasks of one k-block (I = 64).
GPU_CASES = [
    pytest.param((300, 77), 128, 128, 8, 2, "skewed", 128, 5, id="two-ranks-skewed"),
    pytest.param((1, 0, 130, 33), 192, 64, 16, 1, "balanced", 1, 3, id="four-ranks-one-empty-K1-unaligned"),
    pytest.param((257, 250, 3), 256, 384, 4, 1, "one-expert", 128, 0, id="three-ranks-one-expert"),
    pytest.param((64, 200), 320, 128, 8, 8, "balanced", 8, 2, id="two-ranks-K8-H320"),
]


def _to(device, x_R, table, weights):
    return [x.to(device) for x in x_R], tuple(t.to(device) for t in table), tuple(w.to(device) for w in weights)


def _stacked(x_R, table, K):
    """The same rows as one rank's call: every rank's token rows stacked (rank s's at s * T_max),
    each row's route moved by its source's T_max * K. A row whose source or route is out of range
    becomes a padding row (route -1), as the call across ranks must treat it."""
    row_route, row_src, offsets = table
    R, T_max = len(x_R), max(x.shape[0] for x in x_R)
    x_all = torch.zeros(R * T_max, x_R[0].shape[1], dtype=BF16, device=x_R[0].device)
    for s, x in enumerate(x_R):
        x_all[s * T_max : s * T_max + x.shape[0]] = x
    used = torch.arange(row_route.numel(), device=row_route.device) < offsets[-1]
    known = (row_route >= 0) & (row_route < T_max * K) & (row_src >= 0) & (row_src < R)
    moved = torch.where(known, row_src * (T_max * K) + row_route, torch.full_like(row_route, -1))
    return [x_all], (torch.where(used, moved, row_route).to(torch.int32), torch.zeros_like(row_src), offsets)


def _assert_ranks_are_the_stacked_call(x_R, table, weights, K, num_sms=0):
    rows_R, a, b, x_rows = _call(x_R, table, weights, K, num_sms=num_sms)
    x_all, table_all = _stacked(x_R, table, K)
    (rows_all,), a_all, b_all, x_rows_all = _call(x_all, table_all, weights, K, num_sms=num_sms, ranks=False)
    bits = lambda t: t.view(torch.int16)  # noqa: E731 (NaN-filled rows compare by their bits)
    assert torch.equal(bits(x_rows), bits(x_rows_all)), "the gathered x rows"
    assert torch.equal(bits(a), bits(a_all)) and torch.equal(bits(b), bits(b_all)), "the pre-activations"
    T_max = max(x.shape[0] for x in x_R)
    for s, (x, rows) in enumerate(zip(x_R, rows_R, strict=True)):
        mine = rows_all[s * T_max * K : s * T_max * K + x.shape[0] * K]
        assert torch.equal(bits(rows[: x.shape[0] * K]), bits(mine)), f"rank {s}'s output rows"
        assert bool(rows[x.shape[0] * K :].isnan().all()), f"nothing past rank {s}'s own routes"
    return rows_R


@needs_gpu
@pytest.mark.parametrize("Ts,H,I,El,K,routing,align,extra", GPU_CASES)
def test_gpu_moe_forward_across_ranks_is_the_one_rank_kernel(Ts, H, I, El, K, routing, align, extra):
    """Each row read from its source rank's token rows and stored into its output rows by address:
    the bits of one rank's launch on every rank's rows stacked; every route written; the same for
    any grid."""
    x_R, table, weights = _to("cuda", *_inputs(Ts, H, I, El, K, routing, align, extra, seed=7)[:3])
    rows_R = _assert_ranks_are_the_stacked_call(x_R, table, weights, K)
    for x, rows in zip(x_R, rows_R, strict=True):
        assert not bool(rows[: x.shape[0] * K].isnan().any()), "every route's row is written"
    again = _call(x_R, table, weights, K, num_sms=5)[0]
    for want, got in zip(rows_R, again, strict=True):
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), "5 CTAs against every SM"


@needs_gpu
def test_gpu_moe_forward_across_ranks_skips_rows_out_of_range():
    """A segment row whose source rank is outside [0, R) or whose route is outside [0, T_max * K)
    is a padding row: no token row read (x and a, b from zeros), nothing stored."""
    x_R, table, weights = _to("cuda", *_inputs((90, 41), 128, 128, 4, 2, "balanced", 128, 0, seed=11)[:3])
    row_route, row_src, offsets = (t.clone() for t in table)
    live = (row_route >= 0).nonzero().flatten().tolist()
    bad_src, bad_route = live[3], live[-2]
    lost = [(int(row_src[bad_src]), int(row_route[bad_src])), (int(row_src[bad_route]), int(row_route[bad_route]))]
    row_src[bad_src] = 2  # R = 2: no such rank
    row_route[bad_route] = 90 * 2 + 5  # past T_max * K
    rows_R = _assert_ranks_are_the_stacked_call(x_R, (row_route, row_src, offsets), weights, 2)
    for src, route in lost:
        assert bool(rows_R[src][route].isnan().all()), (src, route)


def test_moe_forward_across_ranks_checks_its_arguments_on_cuda():
    """Checked before any launch (so on any machine): the per-rank arguments' alignment, timers
    refused across ranks, x and out_rows not needed across ranks."""
    base = dict(x=0, row_route=16, offsets=16, w_gate=16, w_up=16, w_down=16, out_a=0, out_b=0, scratch_h=16,
                out_rows=0, task_state=16, error=16, capacity=128, num_tokens=64, hidden=128, inner=64,
                num_experts=4, topk=2, world_size=2, row_src=16, x_ranks=16, out_rows_ranks=16)  # fmt: skip
    for name, bad in (("row_src", 18), ("x_ranks", 20), ("out_rows_ranks", 12)):
        with pytest.raises(ValueError, match=f"{name} must be aligned"):
            mok_bf16.moe_forward("cuda", **{**base, name: bad})
    with pytest.raises(ValueError, match="world_size must be <= 65536 on cuda"):
        mok_bf16.moe_forward("cuda", **{**base, "world_size": 65537})
    with pytest.raises(ValueError, match="timers must be 0 when world_size > 1"):
        mok_bf16.moe_forward("cuda", **base, timers=16)
    with pytest.raises(ValueError, match="x must not be 0"):
        mok_bf16.moe_forward("cuda", **{**base, "world_size": 1})


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
