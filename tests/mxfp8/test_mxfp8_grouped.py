"""mok-mxfp8's grouped expert forward (`grouped_forward`): MXFP8 experts over segments of rows.

CPU: the reference arithmetic, bitwise the per-row entry point (swiglu_forward), h and its
MXFP8 copy bitwise the reference's element math and quantizer. CUDA (skipped, with the reason,
without a GPU): the sm_90a FP8 GEMMs with per-32 scaling against a float64 product of the
dequantized operands (tight: the inputs are the same, only the order of the sums differs), h
and h_q bitwise the reference's on the kernel's a and b, close to the CPU's bits, and the
determinism contract (docs/determinism.md) bitwise: run to run, any grid size, a row's bits
independent of where it sits and of the other rows, a segment split over two calls.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GROUPED_CASES

from mok_torch.backends.native.mxfp8_grouped import MxGroupedForward, mxfp8_grouped_forward
from mok_torch.mxfp8 import MXFP8Tensor, mxfp8_quantize, pack_rows, quantize_rows_torch, unpack_rows
from mok_torch.spec.experts import swiglu

mok_mxfp8 = pytest.importorskip("mok_mxfp8", reason="mok-mxfp8 is not installed")
if not hasattr(mok_mxfp8, "grouped_forward"):
    pytest.skip("the installed mok-mxfp8 has no grouped_forward", allow_module_level=True)

BF16 = torch.bfloat16
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def make(lengths: list[int], H: int, I: int, seed: int = 0) -> tuple:
    """MXFP8 rows of x (in 2H-byte rows, as the layer's tables hold them), the offsets, and the
    quantized weights (CPU)."""
    g = torch.Generator().manual_seed(seed)
    El, M = len(lengths), sum(lengths)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    x = (torch.randn(M, H, generator=g) * 2).to(BF16)
    rows = torch.zeros(M, 2 * H, dtype=torch.uint8)
    rows[:, : H + H // 32] = pack_rows(x)
    wg = (torch.randn(El, I, H, generator=g) / H**0.5).to(BF16)
    wu = (torch.randn(El, I, H, generator=g) / H**0.5).to(BF16)
    wd = (torch.randn(El, H, I, generator=g) / I**0.5).to(BF16)
    return rows, offsets, *(mxfp8_quantize(w) for w in (wg, wu, wd))


def on(device: str, w: MXFP8Tensor) -> MXFP8Tensor:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return MXFP8Tensor(move(w.data), move(w.scales), move(w.data_t), move(w.scales_t), w.rule)


def segments(offsets: torch.Tensor) -> list[tuple[int, int]]:
    o = offsets.tolist()
    return [(o[e], o[e + 1]) for e in range(len(o) - 1)]


def per_row_cpu(rows, offsets, wg, wu, wd, H, limit):
    """The per-row CPU entry point, a call per segment: the reference arithmetic."""
    M = rows.shape[0]
    El, I = wg.shape[:2]
    a, b, y = (torch.zeros(M, n, dtype=BF16) for n in (I, I, H))
    quad = lambda w: tuple(t.view(torch.uint8).data_ptr() for t in (w.data, w.scales, w.data_t, w.scales_t))  # noqa: E731
    for e, (lo, hi) in enumerate(segments(offsets)):
        if hi == lo:
            continue
        x = rows[lo:hi, : H + H // 32].contiguous()
        experts = torch.full((hi - lo,), e, dtype=torch.int64)
        outs = [torch.zeros(hi - lo, n, dtype=BF16) for n in (I, I, H)]
        mok_mxfp8.swiglu_forward(
            "cpu", x.data_ptr(), experts.data_ptr(), quad(wg), quad(wu), quad(wd), *(t.data_ptr() for t in outs),
            hi - lo, H, I, El, limit=limit, num_threads=2,
        )  # fmt: skip
        a[lo:hi], b[lo:hi], y[lo:hi] = outs
    return a, b, y


def used_rows(offsets: torch.Tensor, M: int) -> torch.Tensor:
    used = torch.zeros(M, dtype=torch.bool)
    for lo, hi in segments(offsets):
        used[lo:hi] = True
    return used


def assert_h_and_hq_of(got: MxGroupedForward, used: torch.Tensor, limit) -> None:
    """h is the reference's element math on got's a and b; h_q its MXFP8 copy along I."""
    assert got.h is not None and got.h_q is not None
    a, b, h = got.a[used].cpu(), got.b[used].cpu(), got.h[used].cpu()
    I = h.shape[1]
    assert torch.equal(h, swiglu(a, b, limit)), "h must be the reference's element math"
    data, scales = quantize_rows_torch(h)
    assert got.h_q.shape[1] == (I + I // 32 + 15) // 16 * 16
    assert torch.equal(got.h_q[used, :I].cpu(), data.view(torch.uint8)), "h_q must be Q_I(h)"
    assert torch.equal(got.h_q[used, I : I + I // 32].cpu(), scales.view(torch.uint8)), "h_q's scales"


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("lengths", [[5, 0, 9], [1], [0, 0], [13, 2, 0, 7]], ids=["three", "one-row", "empty", "four"])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_cpu_equals_per_row_entry_point(lengths, limit):
    H, I = 64, 96
    rows, offs, wg, wu, wd = make(lengths, H, I, seed=len(lengths))
    got = mxfp8_grouped_forward(rows, H, offs, wg, wu, wd, limit=limit)
    a, b, y = per_row_cpu(rows, offs, wg, wu, wd, H, limit)
    used = used_rows(offs, rows.shape[0])
    assert got.y is not None
    for name, u, v in (("a", got.a, a), ("b", got.b, b), ("y", got.y, y)):
        assert torch.equal(u[used], v[used]), name
    if used.any():
        assert_h_and_hq_of(got, used, limit)


def test_cpu_row_stride_and_without_down():
    H, I = 128, 64
    rows, offs, wg, wu, wd = make([20, 11], H, I, seed=4)
    dense = rows[:, : H + H // 32].contiguous()
    want = mxfp8_grouped_forward(dense, H, offs, wg, wu, wd)
    got = mxfp8_grouped_forward(rows, H, offs, wg, wu, wd)  # 2H-byte rows
    for u, v in zip(got, want, strict=True):
        assert torch.equal(u, v)
    ab = mxfp8_grouped_forward(rows, H, offs, wg, wu, None)
    assert ab.h is None and ab.y is None
    assert torch.equal(ab.a, want.a) and torch.equal(ab.b, want.b)


@pytest.mark.parametrize(
    "offsets, match",
    [([0, 5, 3], "non-decreasing"), ([0, 2, 99], "non-decreasing"), ([-1, 2, 3], "non-decreasing")],
)
def test_cpu_bad_offsets_raise(offsets, match):
    rows, _, wg, wu, wd = make([2, 3], 64, 64)
    with pytest.raises(ValueError, match=match):
        mxfp8_grouped_forward(rows, 64, torch.tensor(offsets), wg, wu, wd)


def test_bad_arguments_raise_naming_them():
    H, I = 64, 64
    rows, offs, wg, wu, wd = make([3, 4], H, I)
    with pytest.raises(TypeError, match="w_up must be an MXFP8Tensor"):
        mxfp8_grouped_forward(rows, H, offs, wg, torch.zeros(2, I, H, dtype=BF16), wd)
    with pytest.raises(ValueError, match="hidden"):
        mxfp8_grouped_forward(rows, 48, offs, wg, wu, wd)
    with pytest.raises(ValueError, match="fewer than hidden"):
        mxfp8_grouped_forward(rows[:, :60].contiguous(), H, offs, wg, wu, wd)
    with pytest.raises(ValueError, match="offsets"):
        mxfp8_grouped_forward(rows, H, offs[:2], wg, wu, wd)
    with pytest.raises(ValueError, match=r"w_down\.data"):
        other = mxfp8_quantize(torch.zeros(2, H, 2 * I, dtype=BF16))
        mxfp8_grouped_forward(rows, H, offs, wg, wu, other)
    with pytest.raises(ValueError, match="normal copy"):
        mxfp8_grouped_forward(rows, H, offs, wg, wu, MXFP8Tensor(None, None, wd.data_t, wd.scales_t))
    with pytest.raises(ValueError, match="num_sms"):
        mxfp8_grouped_forward(rows, H, offs, wg, wu, wd, num_sms=-1)


@pytest.mark.parametrize(
    "H, I, row_bytes, match",
    [(96, 64, 192, "multiples of 64"), (64, 96, 128, "multiples of 64"), (64, 64, 72, "multiple of 16")],
)
def test_cuda_limits_raise_before_any_launch(H, I, row_bytes, match):
    """The GPU's shape limits are checked on the host first: ValueError on any machine."""
    with pytest.raises(ValueError, match=match):
        mok_mxfp8.grouped_forward(
            "cuda", 1 << 20, row_bytes, 1 << 20, (16, 16, 16, 16), (16, 16, 16, 16), (16, 16, 16, 16),
            16, 16, 16, 16, 16, 4, H, I, 2,
        )  # fmt: skip


# ------------------------------------------------------------------ CUDA


def f64_forward(rows, offsets, wg, wu, wd, H, got):
    """float64 a, b per segment from the dequantized operands, and y from the kernel's own h_q (so
    y's check is one GEMM's)."""
    M = rows.shape[0]
    I = wg.shape[1]
    x = unpack_rows(rows[:, : H + H // 32], H).double()
    h = unpack_rows(got.h_q[:, : I + I // 32].cpu(), I).double()
    g, u, d = (w.dequantize().double() for w in (wg, wu, wd))
    a, b = torch.zeros(M, I, dtype=torch.float64), torch.zeros(M, I, dtype=torch.float64)
    y = torch.zeros(M, H, dtype=torch.float64)
    scale_ab, scale_y = torch.zeros(M, I, dtype=torch.float64), torch.zeros(M, H, dtype=torch.float64)
    for e, (lo, hi) in enumerate(segments(offsets)):
        a[lo:hi], b[lo:hi] = x[lo:hi] @ g[e].T, x[lo:hi] @ u[e].T
        y[lo:hi] = h[lo:hi] @ d[e].T
        scale_ab[lo:hi] = x[lo:hi].abs() @ torch.maximum(g[e].abs(), u[e].abs()).T
        scale_y[lo:hi] = h[lo:hi].abs() @ d[e].abs().T
    return a, b, y, scale_ab, scale_y


def assert_bf16_close(got: torch.Tensor, want64: torch.Tensor, scale64: torch.Tensor, what: str) -> None:
    """|got - want| <= one bf16 rounding of want plus the sums' rounding error on the scale (the
    FP8 wgmma keeps fewer than fp32's bits inside an instruction: 2^-12 of sum |products|)."""
    err = (got.double() - want64).abs()
    bound = want64.abs() * 2.0**-8 + scale64 * 2.0**-12 + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3f} x the bound"


def cuda_forward(rows, H, offs, wg, wu, wd, limit=None, num_sms=0) -> MxGroupedForward:
    return mxfp8_grouped_forward(rows, H, offs, wg, wu, wd, limit=limit, num_sms=num_sms)


def to_cuda(rows, offs, *weights):
    return (rows.cuda(), offs.cuda(), *(on("cuda", w) for w in weights))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize("limit", [None, 0.75])
def test_cuda_against_float64(lengths, H, I, limit):
    rows, offs, wg, wu, wd = make(lengths, H, I, seed=H + I)
    r, o, g, u, d = to_cuda(rows, offs, wg, wu, wd)
    got = cuda_forward(r, H, o, g, u, d, limit=limit)
    torch.cuda.synchronize()
    used = used_rows(offs, rows.shape[0])
    a64, b64, y64, scale_ab, scale_y = f64_forward(rows, offs, wg, wu, wd, H, got)
    assert got.y is not None
    assert_bf16_close(got.a.cpu()[used], a64[used], scale_ab[used], "a")
    assert_bf16_close(got.b.cpu()[used], b64[used], scale_ab[used], "b")
    assert_bf16_close(got.y.cpu()[used], y64[used], scale_y[used], "y")
    if used.any():
        assert_h_and_hq_of(got, used, limit)


@pytest.mark.gpu
@needs_gpu
def test_cuda_rows_outside_segments_untouched_and_offsets_clamped():
    H, I = 128, 128
    rows, _, wg, wu, wd = to_cuda(*make([40, 70], H, I, seed=3))
    M = rows.shape[0]
    bad = torch.tensor([10, 30, 10**12], dtype=torch.int64, device="cuda")  # clamped to M
    got = cuda_forward(rows, H, bad, wg, wu, wd)
    good = cuda_forward(rows, H, torch.tensor([10, 30, M], dtype=torch.int64, device="cuda"), wg, wu, wd)
    torch.cuda.synchronize()
    for t, u in zip(got, good, strict=True):
        assert torch.equal(t, u)
        assert bool((t[:10] == 0).all()), "rows before the first segment must not be written"


@pytest.mark.gpu
@needs_gpu
def test_cuda_bitwise_run_to_run_and_any_grid():
    H = 512
    rows, offs, wg, wu, wd = to_cuda(*make([700, 5, 0, 333, 64], H, 256, seed=5))
    first = cuda_forward(rows, H, offs, wg, wu, wd)
    for num_sms in (0, 0, 1, 3, 17):
        again = cuda_forward(rows, H, offs, wg, wu, wd, num_sms=num_sms)
        for t, u in zip(first, again, strict=True):
            assert torch.equal(t, u), f"num_sms={num_sms}"


@pytest.mark.gpu
@needs_gpu
def test_cuda_batch_invariant_and_split_invariant():
    """A row's bits do not depend on where it sits, on the other rows, or on the calls."""
    H, lengths = 256, [300, 41, 129]
    rows, offs, wg, wu, wd = to_cuda(*make(lengths, H, 192, seed=9))
    whole = cuda_forward(rows, H, offs, wg, wu, wd)
    pad = torch.randint(0, 255, (37, rows.shape[1]), dtype=torch.uint8, device="cuda")
    shifted = cuda_forward(torch.cat([pad, rows]), H, offs + 37, wg, wu, wd)
    for t, u in zip(whole, shifted, strict=True):
        assert torch.equal(t, u[37:])
    first = cuda_forward(rows[:77].contiguous(), H, torch.tensor([0, 77, 77, 77], device="cuda"), wg, wu, wd)
    rest = cuda_forward(rows[77:].contiguous(), H, offs - 77 + torch.tensor([77, 0, 0, 0], device="cuda"), wg, wu, wd)
    for t, u, v in zip(whole, first, rest, strict=True):
        assert torch.equal(t[:77], u) and torch.equal(t[77:], v)
    r, e = 320, 1  # a row of expert 1, alone
    alone = torch.tensor([0] * (e + 1) + [1] * (len(lengths) - e), device="cuda")
    one = cuda_forward(rows[r : r + 1].contiguous(), H, alone, wg, wu, wd)
    for t, u in zip(whole, one, strict=True):
        assert torch.equal(t[r : r + 1], u)


@pytest.mark.gpu
@needs_gpu
def test_cuda_close_to_the_reference_arithmetic():
    """Against the CPU entry point (sequential fp32 sums of each 32-block): within bf16 rounding."""
    H = 256
    rows, offs, wg, wu, wd = make([200, 90], H, 128, seed=11)
    r, o, g, u, d = to_cuda(rows, offs, wg, wu, wd)
    got = cuda_forward(r, H, o, g, u, d)
    a, b, y = per_row_cpu(rows, offs, wg, wu, wd, H, None)
    assert got.y is not None
    for name, u, v in (("a", got.a.cpu(), a), ("b", got.b.cpu(), b), ("y", got.y.cpu(), y)):
        rel = (u.float() - v.float()).norm() / v.float().norm()
        assert rel < 4e-3, f"{name}: relative error {rel:.2e}"
