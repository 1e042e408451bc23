"""mok-bf16's grouped expert forward (`grouped_forward`): experts over segments of rows.

CPU: the reference arithmetic, bitwise the per-row entry point. CUDA (skipped, with the
reason, without a GPU): the sm_90a tensor-core GEMMs against a float64 reference within bf16
tolerance, h bitwise the reference's element math on the kernel's a and b, and the
determinism contract (docs/determinism.md) bitwise: run to run, any grid size, a row's bits
independent of where it sits and of the other rows, a segment split over two calls.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GROUPED_CASES

import mok_bf16
from mok_torch.backends.native.grouped import GroupedForward, grouped_backward, grouped_forward
from mok_torch.spec.experts import swiglu

BF16 = torch.bfloat16
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def make(lengths: list[int], H: int, I: int, seed: int = 0) -> tuple:
    """x with consecutive segments of `lengths` rows, weights, and the offsets (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    El, M = len(lengths), sum(lengths)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    x = torch.randn(M, H, generator=g).to(BF16)
    wg = (torch.randn(El, I, H, generator=g) / H**0.5).to(BF16)
    wu = (torch.randn(El, I, H, generator=g) / H**0.5).to(BF16)
    wd = (torch.randn(El, H, I, generator=g) / I**0.5).to(BF16)
    return x, offsets, wg, wu, wd


def segments(offsets: torch.Tensor) -> list[tuple[int, int]]:
    o = offsets.tolist()
    return [(o[e], o[e + 1]) for e in range(len(o) - 1)]


def per_row_cpu(x, offsets, wg, wu, wd, limit):
    """The per-row CPU entry point over the same segments: the reference arithmetic."""
    M, H = x.shape
    El, I = wg.shape[:2]
    experts = torch.full((M,), -1, dtype=torch.int64)
    for e, (lo, hi) in enumerate(segments(offsets)):
        experts[lo:hi] = e
    a, b, y = (torch.zeros(M, n, dtype=BF16) for n in (I, I, H))
    mok_bf16.swiglu_forward(
        "cpu", x.data_ptr(), experts.data_ptr(), wg.data_ptr(), wu.data_ptr(), wd.data_ptr(),
        a.data_ptr(), b.data_ptr(), y.data_ptr(), M, H, I, El, limit=limit, num_threads=2,
    )  # fmt: skip
    return a, b, y, experts


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("lengths", [[5, 0, 9], [1], [0, 0], [13, 2, 0, 7]], ids=["three", "one-row", "empty", "four"])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_cpu_equals_per_row_entry_point(lengths, limit):
    x, offs, wg, wu, wd = make(lengths, 24, 10, seed=len(lengths))
    # Two unused rows at the end, which must keep their sentinel.
    x = torch.cat([x, torch.randn(2, x.shape[1]).to(BF16)])
    M, I = x.shape[0], wg.shape[1]
    out = GroupedForward(*(torch.full((M, n), 7.0, dtype=BF16) for n in (I, I, I, x.shape[1])))
    got = grouped_forward(x, offs, wg, wu, wd, limit=limit, out=out)
    a, b, y, experts = per_row_cpu(x, offs, wg, wu, wd, limit)
    used = experts >= 0
    assert torch.equal(got.a[used], a[used]) and torch.equal(got.b[used], b[used])
    assert torch.equal(got.y[used], y[used])
    assert torch.equal(got.h[used], swiglu(a[used], b[used], limit))
    for t in got:
        assert bool((t[~used] == 7.0).all()), "rows outside every segment must not be written"


def test_cpu_without_down_writes_a_b_h_only():
    x, offs, wg, wu, _ = make([4, 3], 16, 8)
    got = grouped_forward(x, offs, wg, wu, None)
    a, b, _, _ = per_row_cpu(x, offs, wg, wu, torch.zeros(2, 16, 8, dtype=BF16), None)
    assert got.y is None
    assert torch.equal(got.a, a) and torch.equal(got.b, b) and torch.equal(got.h, swiglu(a, b, None))
    ab = grouped_forward(x, offs, wg, wu, None, with_h=False)
    assert ab.h is None and torch.equal(ab.a, a) and torch.equal(ab.b, b)
    with pytest.raises(ValueError, match="with_h=False needs w_down=None"):
        grouped_forward(x, offs, wg, wu, torch.zeros(2, 16, 8, dtype=BF16), with_h=False)


@pytest.mark.parametrize(
    "offsets, match",
    [([0, 5, 3], r"offsets\[2\]"), ([1, 4, 9], r"offsets\[2\]"), ([-1, 4, 8], r"offsets\[0\]")],
    ids=["decreasing", "past-the-end", "negative"],
)
def test_cpu_bad_offsets_raise(offsets, match):
    x, _, wg, wu, wd = make([4, 4], 16, 8)
    with pytest.raises(ValueError, match=match):
        grouped_forward(x, torch.tensor(offsets), wg, wu, wd)


def test_bad_tensors_raise_naming_the_argument():
    x, offs, wg, wu, wd = make([4, 4], 16, 8)
    with pytest.raises(TypeError, match="x must have dtype bfloat16"):
        grouped_forward(x.float(), offs, wg, wu, wd)
    with pytest.raises(TypeError, match="offsets must have dtype int64"):
        grouped_forward(x, offs.int(), wg, wu, wd)
    with pytest.raises(ValueError, match="w_up must have shape"):
        grouped_forward(x, offs, wg, wu[:1], wd)
    with pytest.raises(ValueError, match="w_down must have shape"):
        grouped_forward(x, offs, wg, wu, wd.transpose(1, 2))
    with pytest.raises(ValueError, match="x must be contiguous"):
        grouped_forward(torch.randn(16, 8).to(BF16).t(), offs, wg, wu, wd)
    with pytest.raises(ValueError, match="num_sms"):
        grouped_forward(x, offs, wg, wu, wd, num_sms=-1)


@pytest.mark.parametrize(
    "H, I, El, match",
    [(96, 64, 2, "hidden must be a positive multiple of 64"), (64, 32, 2, "inner must be a positive multiple of 64"),
     (64, 64, 1025, "num_experts must be <= 1024")],
    ids=["H96", "I32", "El1025"],
)  # fmt: skip
def test_cuda_shape_limits_raise_before_any_launch(H, I, El, match):
    """Checked on the host before the device is touched, so this runs on any machine."""
    with pytest.raises(ValueError, match=match):
        mok_bf16.grouped_forward("cuda", 64, 64, 64, 64, 64, 64, 64, 64, 64, 4, H, I, El)


# ------------------------------------------------------------------ CUDA


def f64_forward(x, offsets, wg, wu, wd, limit, h_kernel):
    """float64 a, b per segment, and y from the kernel's own h (so y's check is one GEMM's)."""
    M, H = x.shape
    I = wg.shape[1]
    a = torch.zeros(M, I, dtype=torch.float64)
    b = torch.zeros(M, I, dtype=torch.float64)
    y = torch.zeros(M, H, dtype=torch.float64)
    for e, (lo, hi) in enumerate(segments(offsets)):
        xe = x[lo:hi].double()
        a[lo:hi] = xe @ wg[e].double().T
        b[lo:hi] = xe @ wu[e].double().T
        y[lo:hi] = h_kernel[lo:hi].double() @ wd[e].double().T
    return a, b, y


def assert_bf16_close(got: torch.Tensor, want64: torch.Tensor, scale64: torch.Tensor, what: str) -> None:
    """|got - want| <= one bf16 rounding of want plus fp32 accumulation error on the scale."""
    err = (got.double() - want64).abs()
    bound = want64.abs() * 2.0**-8 + scale64 * 2.0**-14 + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3f} x the bf16 bound"


def cuda_forward(x, offs, wg, wu, wd, limit=None, num_sms=0, fill=7.0):
    M, H = x.shape
    I = wg.shape[1]
    out = GroupedForward(*(torch.full((M, n), fill, dtype=BF16, device="cuda") for n in (I, I, I, H)))
    return grouped_forward(x, offs, wg, wu, wd, limit=limit, num_sms=num_sms, out=out)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize("limit", [None, 0.75, 0.7])
def test_cuda_against_float64(lengths, H, I, limit):
    x, offs, wg, wu, wd = make(lengths, H, I, seed=H + I)
    got = cuda_forward(*(t.cuda() for t in (x, offs, wg, wu, wd)), limit=limit)
    torch.cuda.synchronize()
    a, b, h, y = (t.cpu() for t in got)
    a64, b64, y64 = f64_forward(x, offs, wg, wu, wd, limit, h)
    M = x.shape[0]
    used = torch.zeros(M, dtype=torch.bool)
    for lo, hi in segments(offs):
        used[lo:hi] = True
    ax = x.double().abs()
    scale_ab = torch.zeros(M, I, dtype=torch.float64)
    scale_y = torch.zeros(M, H, dtype=torch.float64)
    for e, (lo, hi) in enumerate(segments(offs)):
        scale_ab[lo:hi] = ax[lo:hi] @ torch.maximum(wg[e].double().abs(), wu[e].double().abs()).T
        scale_y[lo:hi] = h[lo:hi].double().abs() @ wd[e].double().abs().T
    assert_bf16_close(a[used], a64[used], scale_ab[used], "a")
    assert_bf16_close(b[used], b64[used], scale_ab[used], "b")
    assert_bf16_close(y[used], y64[used], scale_y[used], "y")
    assert torch.equal(h[used], swiglu(a[used], b[used], limit)), "h must be the reference's element math"


@pytest.mark.gpu
@needs_gpu
def test_cuda_rows_outside_segments_untouched_and_offsets_clamped():
    x, _, wg, wu, wd = (t.cuda() for t in make([40, 70], 128, 128, seed=3))
    M = x.shape[0]
    # Segment 1 claims rows far past the end: clamped to M, nothing read or written outside.
    bad = torch.tensor([10, 30, 10**12], dtype=torch.int64, device="cuda")
    got = cuda_forward(x, bad, wg, wu, wd)
    good = cuda_forward(x, torch.tensor([10, 30, M], dtype=torch.int64, device="cuda"), wg, wu, wd)
    torch.cuda.synchronize()
    for t, u in zip(got, good, strict=True):
        assert torch.equal(t, u)
        assert bool((t[:10] == 7.0).all()), "rows before the first segment must not be written"


@pytest.mark.gpu
@needs_gpu
def test_cuda_bitwise_run_to_run_and_any_grid():
    x, offs, wg, wu, wd = (t.cuda() for t in make([700, 5, 0, 333, 64], 512, 256, seed=5))
    first = cuda_forward(x, offs, wg, wu, wd)
    for num_sms in (0, 0, 1, 3, 17):
        again = cuda_forward(x, offs, wg, wu, wd, num_sms=num_sms)
        for t, u in zip(first, again, strict=True):
            assert torch.equal(t, u), f"num_sms={num_sms}"


@pytest.mark.gpu
@needs_gpu
def test_cuda_batch_invariant_and_split_invariant():
    """A row's bits do not depend on where it sits, on the other rows, or on the calls."""
    lengths = [300, 41, 129]
    x, offs, wg, wu, wd = (t.cuda() for t in make(lengths, 256, 192, seed=9))
    whole = cuda_forward(x, offs, wg, wu, wd)
    # The same rows shifted by 37 rows, behind rows of other data (not in any segment).
    pad = torch.randn(37, x.shape[1], device="cuda").to(BF16)
    shifted = cuda_forward(torch.cat([pad, x]), offs + 37, wg, wu, wd)
    for t, u in zip(whole, shifted, strict=True):
        assert torch.equal(t, u[37:])
    # Segment 0 split at row 77 over two calls, its second half with other rows around it.
    first = cuda_forward(x[:77].contiguous(), torch.tensor([0, 77, 77, 77], device="cuda"), wg, wu, wd)
    rest = cuda_forward(x[77:].contiguous(), offs - 77 + torch.tensor([77, 0, 0, 0], device="cuda"), wg, wu, wd)
    for t, u, v in zip(whole, first, rest, strict=True):
        assert torch.equal(t[:77], u) and torch.equal(t[77:], v)
    # One row alone.
    r, e = 320, 1  # a row of expert 1
    alone = torch.tensor([0] * (e + 1) + [1] * (len(lengths) - e), device="cuda")
    one = cuda_forward(x[r : r + 1].contiguous(), alone, wg, wu, wd)
    for t, u in zip(whole, one, strict=True):
        assert torch.equal(t[r : r + 1], u)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_sms", [0, 1])
def test_cuda_nan_rows_stay_in_their_rows(num_sms):
    """A NaN in x makes its row's a, b, h and y NaN (each the canonical 0x7FFF: core/bf16.h) and
    leaves every other row bitwise as without it; one CTA walks every tile (the epilogues' stores
    carried from tile to tile)."""
    x, offs, wg, wu, wd = (t.cuda() for t in make([300, 77, 0, 200], 1024, 640, seed=13))
    clean = cuda_forward(x, offs, wg, wu, wd, num_sms=num_sms)
    bad_rows = [0, 129, 310, 576]
    x_nan = x.clone()
    x_nan[bad_rows, 5] = float("nan")
    got = cuda_forward(x_nan, offs, wg, wu, wd, num_sms=num_sms)
    torch.cuda.synchronize()
    keep = torch.ones(x.shape[0], dtype=torch.bool, device="cuda")
    keep[bad_rows] = False
    for name, t, u in zip(("a", "b", "h", "y"), got, clean, strict=True):
        assert torch.equal(t[keep], u[keep]), f"{name}: a NaN row changed other rows"
        bits = t[bad_rows].view(torch.int16)
        assert bool((bits == 0x7FFF).all()), f"{name}: NaN rows must hold 0x7fff"


@pytest.mark.gpu
@needs_gpu
def test_cuda_close_to_the_reference_arithmetic():
    """Against the CPU entry point (sequential fp32 sums): within bf16 rounding."""
    x, offs, wg, wu, wd = make([200, 90], 256, 128, seed=11)
    got = [t.cpu() for t in cuda_forward(*(t.cuda() for t in (x, offs, wg, wu, wd)))]
    a, b, y, _ = per_row_cpu(x, offs, wg, wu, wd, None)
    for name, u, v in (("a", got[0], a), ("b", got[1], b), ("y", got[3], y)):
        rel = (u.float() - v.float()).norm() / v.float().norm()
        assert rel < 4e-3, f"{name}: relative error {rel:.2e}"


def _dirty_cache(device: str) -> None:
    """Leave the caching allocator blocks full of 7s, so an output that is not zeroed shows it."""
    junk = torch.full((1 << 22,), 7.0, dtype=torch.float32, device=device)
    del junk


FRESH_OFFSETS = [
    pytest.param([10, 30, 95], id="sorted-gaps"),  # rows [0, 10) and [95, 100) outside
    pytest.param([50, 60, 10, 20], id="unsorted"),  # covered: [50, 60) and [10, 20) (cuda only)
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize("offsets", FRESH_OFFSETS)
def test_fresh_outputs_are_zero_outside_the_segments(device, offsets):
    """Without `out`, the rows no segment covers come back zero (zeroed by the call, on the
    device: no fill pass over the rows it writes), and the covered rows are those of a call into
    given outputs; forward and backward."""
    if device == "cpu" and offsets != sorted(offsets):
        pytest.skip("the CPU entry points reject decreasing offsets (ValueError, tested elsewhere)")
    M, H, I = 100, 128, 64
    x, _, wg, wu, wd = (t.to(device) for t in make([M], H, I, seed=21))
    El = len(offsets) - 1
    wg, wu, wd = (w.expand(El, *w.shape[1:]).contiguous() for w in (wg, wu, wd))
    offs = torch.tensor(offsets, dtype=torch.int64, device=device)
    covered = torch.zeros(M, dtype=torch.bool)
    for e in range(El):
        covered[offsets[e] : max(offsets[e], offsets[e + 1])] = True
    covered = covered.to(device)
    _dirty_cache(device)
    fresh = grouped_forward(x, offs, wg, wu, wd)
    given = cuda_forward(x, offs, wg, wu, wd) if device == "cuda" else None
    for name, t in zip(("a", "b", "h", "y"), fresh, strict=True):
        assert bool((t[~covered] == 0).all()), f"{name}: rows outside the segments must be zero"
        if given is not None:
            assert torch.equal(t[covered], given[("a", "b", "h", "y").index(name)][covered]), name
    dy = torch.randn(M, H, device=device).to(BF16)
    _dirty_cache(device)
    back = grouped_backward(x, offs, fresh.a, fresh.b, dy, None, wg, wu, wd, None, carry_in=False,
                            wgrad_out=tuple(torch.empty_like(w) for w in (wg, wu, wd)))  # fmt: skip
    assert bool((back.dx[~covered] == 0).all()) and bool((back.d_w[~covered] == 0).all())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu])])
def test_given_outputs_zeroed_outside_the_segments_on_request(device):
    """zero_outside=True (the chain's forward into its ring, allocated without a fill): given
    outputs full of junk come back with the uncovered rows zero and the covered rows those of a
    fresh call; zero_outside=False leaves the junk; a non-bool is a TypeError."""
    M, H, I = 100, 128, 64
    offsets = [10, 30, 95]
    x, _, wg, wu, wd = (t.to(device) for t in make([M], H, I, seed=22))
    wg, wu, wd = (w.expand(2, *w.shape[1:]).contiguous() for w in (wg, wu, wd))
    offs = torch.tensor(offsets, dtype=torch.int64, device=device)
    covered = torch.zeros(M, dtype=torch.bool, device=device)
    covered[10:95] = True
    fresh = grouped_forward(x, offs, wg, wu, wd)

    def junk() -> GroupedForward:
        return GroupedForward(*(torch.full((M, n), 7.0, dtype=BF16, device=device) for n in (I, I, I, H)))

    zeroed = grouped_forward(x, offs, wg, wu, wd, out=junk(), zero_outside=True)
    kept = grouped_forward(x, offs, wg, wu, wd, out=junk(), zero_outside=False)
    for name, z, k, f in zip(("a", "b", "h", "y"), zeroed, kept, fresh, strict=True):
        assert bool((z[~covered] == 0).all()), f"{name}: rows outside the segments must be zeroed"
        assert bool((k[~covered] == 7.0).all()), f"{name}: without the request they are left alone"
        assert torch.equal(z[covered], f[covered]) and torch.equal(k[covered], f[covered]), name
    with pytest.raises(TypeError, match="zero_outside must be a bool or None"):
        grouped_forward(x, offs, wg, wu, wd, out=junk(), zero_outside=1)
