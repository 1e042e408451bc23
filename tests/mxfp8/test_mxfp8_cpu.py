"""mok-mxfp8's CPU expert entry points (swiglu_forward / swiglu_backward) against the reference.

The reference is mok-torch's own MXFP8 expert arithmetic (mok_torch/spec/experts.py) on
the same flat rows; the entry points must give its bits: outputs, router-weight gradients and
the weight-gradient accumulators, for any thread count and any split of the rows into calls
at 32-row boundaries.
"""

from __future__ import annotations

import pytest
import torch

from mok_torch.mxfp8 import mxfp8_quantize, pack_rows, unpack_rows
from mok_torch.spec.experts import (
    ExpertWeights,
    PerRow,
    accumulate_wgrads,
    down,
    gate_up,
    row_backward,
    swiglu,
)

mok_mxfp8 = pytest.importorskip("mok_mxfp8", reason="mok-mxfp8 is not installed")
if not hasattr(mok_mxfp8, "swiglu_forward"):
    pytest.skip("the installed mok-mxfp8 has no expert entry points", allow_module_level=True)

BF16 = torch.bfloat16
H, I, El = 64, 32, 3
# 32-row blocks: expert 0 with 5 padding rows at the end, expert 2, all padding, expert 0, 1.
EXPERTS = [0] * 27 + [-1] * 5 + [2] * 32 + [-1] * 32 + [0] * 32 + [1] * 20
M = len(EXPERTS)


def _inputs(seed: int = 0, limit: float | None = None):
    g = torch.Generator().manual_seed(seed)
    e = torch.tensor(EXPERTS, dtype=torch.int64)
    pad = e < 0
    x = (torch.randn(M, H, generator=g) * 2).to(BF16)
    dy = torch.randn(M, H, generator=g).to(BF16)
    x[pad], dy[pad] = 0, 0
    w = torch.rand(M, generator=g).masked_fill(pad, 0.0)
    weights = [(torch.randn(El, I, H, generator=g) / 8).to(BF16) for _ in range(2)]
    weights.append((torch.randn(El, H, I, generator=g) / 6).to(BF16))
    return e, pack_rows(x), pack_rows(dy), w, [mxfp8_quantize(t) for t in weights]


def _quad(q):
    return tuple(t.view(torch.uint8).data_ptr() for t in (q.data, q.scales, q.data_t, q.scales_t))


def _run(e, x, dy, w, q, rows: slice, limit=None, threads=1, acc=None):
    """The entry points on rows[rows]; returns outputs and the accumulators (continued from acc)."""
    e, x, dy, w = e[rows].contiguous(), x[rows].contiguous(), dy[rows].contiguous(), w[rows].contiguous()
    n = e.shape[0]
    a, b = torch.empty(n, I, dtype=BF16), torch.empty(n, I, dtype=BF16)
    y = torch.empty(n, H, dtype=BF16)
    quads = [_quad(t) for t in q]
    mok_mxfp8.swiglu_forward("cpu", x.data_ptr(), e.data_ptr(), *quads, a.data_ptr(), b.data_ptr(), y.data_ptr(),
                             n, H, I, El, limit, threads)  # fmt: skip
    dx, d_w = torch.empty(n, H, dtype=BF16), torch.empty(n)
    d_gu, d_d = acc if acc is not None else (torch.zeros(El, 2 * I, H), torch.zeros(El, H, I))
    mok_mxfp8.swiglu_backward("cpu", x.data_ptr(), a.data_ptr(), b.data_ptr(), dy.data_ptr(), w.data_ptr(),
                              e.data_ptr(), *quads, dx.data_ptr(), d_w.data_ptr(), d_gu.data_ptr(), d_d.data_ptr(),
                              n, H, I, El, limit, threads)  # fmt: skip
    return {"a": a, "b": b, "y": y, "dx": dx, "d_w": d_w, "d_gate_up": d_gu, "d_down": d_d}


def _reference(e, x, dy, w, q, limit=None):
    weights = ExpertWeights.from_mxfp8(*q)
    layout = PerRow(e.clamp(min=0))  # padding rows are zero rows: they add nothing anywhere
    xv, dyv = unpack_rows(x, H), unpack_rows(dy, H)
    a, b = gate_up(xv, weights, layout)
    y = down(swiglu(a, b, limit), weights, layout)
    rg = row_backward(xv, a, b, dyv, w, weights, limit, layout)
    d_gu, d_d = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    accumulate_wgrads(xv, dyv, w, rg, d_gu, d_d, layout, weights=weights)
    return {"a": a, "b": b, "y": y, "dx": rg.dx, "d_w": rg.d_w, "d_gate_up": d_gu, "d_down": d_d}


def _assert_same(got, want):
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: {int((got[k] != want[k]).sum())} elements differ"


@pytest.mark.parametrize("limit", [None, 1.5])
def test_entry_points_are_bitwise_the_reference(limit):
    e, x, dy, w, q = _inputs(1)
    want = _reference(e, x, dy, w, q, limit)
    _assert_same(_run(e, x, dy, w, q, slice(None), limit), want)
    assert bool((want["y"][e < 0] == 0).all()) and bool((want["d_w"][e < 0] == 0).all())


def test_threads_and_splits_do_not_change_bits():
    e, x, dy, w, q = _inputs(2)
    one = _run(e, x, dy, w, q, slice(None))
    for threads in (2, 5):
        _assert_same(_run(e, x, dy, w, q, slice(None), threads=threads), one)
    # rows split into calls at 32-row boundaries, the accumulators carried across
    acc = (torch.zeros(El, 2 * I, H), torch.zeros(El, H, I))
    parts = [_run(e, x, dy, w, q, slice(lo, hi), acc=acc) for lo, hi in ((0, 64), (64, 96), (96, M))]
    for k in ("a", "b", "y", "dx", "d_w"):
        assert torch.equal(torch.cat([p[k] for p in parts]), one[k]), k
    assert torch.equal(acc[0], one["d_gate_up"]) and torch.equal(acc[1], one["d_down"])


def test_bad_arguments():
    e, x, _dy, _w, q = _inputs(3)
    quads = [_quad(t) for t in q]
    a, b, y = torch.empty(M, I, dtype=BF16), torch.empty(M, I, dtype=BF16), torch.empty(M, H, dtype=BF16)

    def fwd(experts=e, hidden=H, device="cpu", xp=None):
        mok_mxfp8.swiglu_forward(device, x.data_ptr() if xp is None else xp, experts.data_ptr(), *quads, a.data_ptr(),
                                 b.data_ptr(), y.data_ptr(), M, hidden, I, El)  # fmt: skip

    mixed = e.clone()
    mixed[3] = 1  # two experts in rows 0..31
    with pytest.raises(ValueError, match="hold two experts"):
        fwd(mixed)
    out_of_range = e.clone()
    out_of_range[7] = El
    with pytest.raises(ValueError, match=r"experts\[7\] must be in \[-1, num_experts"):
        fwd(out_of_range)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 32"):
        fwd(hidden=48)
    with pytest.raises(ValueError, match="x must not be 0"):
        fwd(xp=0)
    with pytest.raises(RuntimeError, match="not written yet"):
        fwd(device="cuda")
