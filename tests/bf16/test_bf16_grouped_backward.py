"""mok-bf16's grouped expert backward (`grouped_backward`): experts over segments of rows.

CPU: the reference arithmetic, bitwise the per-row entry point (`swiglu_backward`) over the
same segments. CUDA (skipped, with the reason, without a GPU): each kernel against float64 on
the kernel's own inputs (g against dy @ Wd; dx, d_w and the weight gradients against the
intermediate arrays the kernels passed each other), the element math bitwise the reference's,
the whole within bf16 rounding of the reference arithmetic, and the determinism contract
(docs/determinism.md) bitwise: run to run, any grid size, a row's bits independent of where it sits,
and the weight gradients' fp32 carry: rows split over two calls at a multiple of 64 rows from
every segment start give the bits of one call.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch
from helpers import GROUPED_CASES

import mok_bf16
from mok_torch.backends.native.grouped import GroupedBackward, GroupedScratch, grouped_backward
from mok_torch.spec.arith import sigmoid
from mok_torch.spec.experts import swiglu

BF16 = torch.bfloat16
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def make(lengths: list[int], H: int, I: int, seed: int = 0, weighted: bool = True) -> dict:
    """Inputs of a backward over consecutive segments of `lengths` rows (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    El, M = len(lengths), sum(lengths)
    return dict(
        x=torch.randn(M, H, generator=g).to(BF16),
        offsets=torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        a=torch.randn(M, I, generator=g).to(BF16),
        b=torch.randn(M, I, generator=g).to(BF16),
        dy=torch.randn(M, H, generator=g).to(BF16),
        w=torch.rand(M, generator=g) if weighted else None,
        wg=(torch.randn(El, I, H, generator=g) / H**0.5).to(BF16),
        wu=(torch.randn(El, I, H, generator=g) / H**0.5).to(BF16),
        wd=(torch.randn(El, H, I, generator=g) / I**0.5).to(BF16),
    )


def to(d: dict, device: str) -> dict:
    return {k: None if v is None else v.to(device) for k, v in d.items()}


def segments(offsets: torch.Tensor) -> list[tuple[int, int]]:
    o = offsets.tolist()
    return [(o[e], o[e + 1]) for e in range(len(o) - 1)]


def accumulators(d: dict, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> tuple:
    """(dWg, dWu, dWd) arrays filled with `fill`."""
    El, I, H = d["wg"].shape
    dev = d["x"].device
    return tuple(torch.full(s, fill, dtype=dtype, device=dev) for s in ((El, I, H), (El, I, H), (El, H, I)))


def run(d: dict, acc=None, limit=None, num_sms=0, fill=7.0, scratch=None, carry_in=True, wgrad_out=None):
    M, H = d["x"].shape
    dev = d["x"].device
    if acc is None and (carry_in or wgrad_out is None):
        acc = accumulators(d)
    out = GroupedBackward(
        torch.full((M, H), fill, dtype=BF16, device=dev), torch.full((M,), fill, dtype=torch.float32, device=dev)
    )
    got = grouped_backward(
        d["x"], d["offsets"], d["a"], d["b"], d["dy"], d["w"], d["wg"], d["wu"], d["wd"], acc,
        limit=limit, num_sms=num_sms, out=out, scratch=scratch, carry_in=carry_in, wgrad_out=wgrad_out,
    )  # fmt: skip
    return got, acc


def per_row_cpu(d: dict, limit):
    """swiglu_backward (the per-row CPU entry point) over the same segments."""
    M, H = d["x"].shape
    El, I = d["wg"].shape[:2]
    experts = torch.full((M,), -1, dtype=torch.int64)
    for e, (lo, hi) in enumerate(segments(d["offsets"])):
        experts[lo:hi] = e
    dx, d_w = torch.zeros(M, H, dtype=BF16), torch.zeros(M)
    acc_gu, acc_d = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    mok_bf16.swiglu_backward(
        "cpu", d["x"].data_ptr(), d["a"].data_ptr(), d["b"].data_ptr(), d["dy"].data_ptr(),
        0 if d["w"] is None else d["w"].data_ptr(), experts.data_ptr(), d["wg"].data_ptr(), d["wu"].data_ptr(),
        d["wd"].data_ptr(), dx.data_ptr(), d_w.data_ptr(), acc_gu.data_ptr(), acc_d.data_ptr(), M, H, I, El,
        limit=limit, num_threads=2,
    )  # fmt: skip
    return dx, d_w, (acc_gu[:, :I], acc_gu[:, I:], acc_d), experts >= 0


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("lengths", [[5, 0, 9], [1], [0, 0], [13, 2, 0, 7]], ids=["three", "one-row", "empty", "four"])
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
def test_cpu_equals_per_row_entry_point(lengths, limit, weighted):
    d = make(lengths, 24, 10, seed=len(lengths), weighted=weighted)
    # Two rows past the last segment: their dx and d_w keep the sentinel, they add nothing.
    d["x"], d["dy"] = (torch.cat([d[k], torch.randn(2, 24).to(BF16)]) for k in ("x", "dy"))
    d["a"], d["b"] = (torch.cat([d[k], torch.randn(2, 10).to(BF16)]) for k in ("a", "b"))
    if weighted:
        d["w"] = torch.cat([d["w"], torch.rand(2)])
    got, acc = run(d, limit=limit)
    dx, d_w, want, used = per_row_cpu(d, limit)
    assert torch.equal(got.dx[used], dx[used]) and torch.equal(got.d_w[used], d_w[used])
    for u, v in zip(acc, want, strict=True):
        assert torch.equal(u, v)
    assert bool((got.dx[~used] == 7.0).all()) and bool((got.d_w[~used] == 7.0).all())


def test_cpu_weight_gradients_from_zero_in_bf16():
    """carry_in=False ignores what the accumulators hold; wgrad_out gets the sums rounded once."""
    d = make([9, 0, 5], 16, 8, seed=6)
    _, want = run(d)
    junk = accumulators(d, fill=float("nan"))
    out16 = accumulators(d, dtype=BF16)
    run(d, acc=junk, carry_in=False, wgrad_out=out16)
    for u, v, w in zip(junk, want, out16, strict=True):
        assert torch.equal(u, v) and torch.equal(w, v.to(BF16))
    only16 = accumulators(d, dtype=BF16)
    run(d, carry_in=False, wgrad_out=only16)  # no fp32 accumulators at all
    for u, v in zip(only16, out16, strict=True):
        assert torch.equal(u, v)


def test_cpu_split_over_calls_gives_one_call():
    """The reference sums rows sequentially, so a split anywhere carries exactly."""
    d = make([30, 17], 16, 8, seed=4)
    _, acc_one = run(d)
    acc = accumulators(d)
    first = dict(d, offsets=torch.tensor([0, 11, 11]))
    rest = dict(d, offsets=torch.tensor([11, 30, 47]))
    run(first, acc)
    run(rest, acc)
    for u, v in zip(acc, acc_one, strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize(
    "offsets, match",
    [([0, 5, 3], r"offsets\[2\]"), ([1, 4, 9], r"offsets\[2\]"), ([-1, 4, 8], r"offsets\[0\]")],
    ids=["decreasing", "past-the-end", "negative"],
)
def test_cpu_bad_offsets_raise(offsets, match):
    d = make([4, 4], 16, 8)
    d["offsets"] = torch.tensor(offsets)
    with pytest.raises(ValueError, match=match):
        run(d)


def test_bad_tensors_raise_naming_the_argument():
    d = make([4, 4], 16, 8)
    cases = [
        (dict(a=d["a"].float()), TypeError, "a must have dtype bfloat16"),
        (dict(dy=d["dy"][:3]), ValueError, "dy must have shape"),
        (dict(w=d["w"].double()), TypeError, "router_weights must have dtype float32"),
        (dict(wd=d["wd"].transpose(1, 2)), ValueError, "w_down must have shape"),
        (dict(offsets=d["offsets"].int()), TypeError, "offsets must have dtype int64"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            run(dict(d, **change))
    gate, up, down = accumulators(d)
    with pytest.raises(ValueError, match=r"acc\.down must have shape"):
        run(d, acc=(gate, up, down[:, :, :4]))
    with pytest.raises(TypeError, match=r"acc\.gate must have dtype float32"):
        run(d, acc=(gate.double(), up, down))
    with pytest.raises(TypeError, match=r"wgrad_out\.up must have dtype bfloat16"):
        run(d, wgrad_out=(gate.bfloat16(), up, down.bfloat16()))
    with pytest.raises(ValueError, match="acc or wgrad_out must be given"):
        grouped_backward(d["x"], d["offsets"], d["a"], d["b"], d["dy"], d["w"], d["wg"], d["wu"], d["wd"], None,
                         carry_in=False)  # fmt: skip
    with pytest.raises(ValueError, match="carry_in=True needs acc"):
        grouped_backward(d["x"], d["offsets"], d["a"], d["b"], d["dy"], d["w"], d["wg"], d["wu"], d["wd"], None,
                         wgrad_out=accumulators(d, dtype=BF16))  # fmt: skip
    with pytest.raises(ValueError, match="num_sms"):
        run(d, num_sms=-1)


@pytest.mark.parametrize(
    "H, I, El, match",
    [(96, 64, 2, "hidden must be a positive multiple of 64"), (64, 32, 2, "inner must be a positive multiple of 64"),
     (64, 64, 1025, "num_experts must be <= 1024")],
    ids=["H96", "I32", "El1025"],
)  # fmt: skip
def test_cuda_shape_limits_raise_before_any_launch(H, I, El, match):
    """Checked on the host before the device is touched, so this runs on any machine."""
    p = 64
    acc_out = (p, p, p, 0, 0, 0, True)  # fp32 accumulators, no bf16 outputs, carry in
    with pytest.raises(ValueError, match=match):
        mok_bf16.grouped_backward("cuda", p, p, p, p, p, 0, p, p, p, p, p, *acc_out, p, p, p, 4, H, I, El)


def test_cuda_scratch_and_accumulators_are_required():
    """scratch_hw and scratch_d_ab are required; scratch_g only above G_SWIGLU_MAX_INNER (below it
    g is stored only where given), and a misaligned one is refused."""
    p = 64
    acc_out = (p, p, p, 0, 0, 0, True)
    wide = mok_bf16.G_SWIGLU_MAX_INNER + 64
    with pytest.raises(ValueError, match="scratch_g must be aligned to 16 bytes"):
        mok_bf16.grouped_backward("cuda", p, p, p, p, p, 0, p, p, p, p, p, *acc_out, p + 4, p, p, 4, 64, 64, 2)
    with pytest.raises(ValueError, match="scratch_g must not be 0"):
        mok_bf16.grouped_backward("cuda", p, p, p, p, p, 0, p, p, p, p, p, *acc_out, 0, p, p, 4, 64, wide, 2)
    for i, name in ((1, "scratch_hw"), (2, "scratch_d_ab")):
        scratch = [0, p, p]
        scratch[i] = 0
        with pytest.raises(ValueError, match=f"{name} must not be 0"):
            mok_bf16.grouped_backward("cuda", p, p, p, p, p, 0, p, p, p, p, p, *acc_out, *scratch, 4, 64, 64, 2)
    no_up = (p, 0, p, 0, 0, 0, False)  # dWu has neither an accumulator nor an output
    with pytest.raises(ValueError, match="acc_up must not be 0"):
        mok_bf16.grouped_backward("cuda", p, p, p, p, p, 0, p, p, p, p, p, *no_up, p, p, p, 4, 64, 64, 2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("carry_in", [False, True], ids=["from-zero", "carried"])
def test_zero_rows_still_write_the_weight_gradients(device, carry_in):
    """No rows at all: the weight gradients are C (carried in) or +0, in the fp32 accumulators
    and the bf16 outputs (on CUDA the wrapper writes them: no kernel runs without rows)."""
    d = to(make([0, 0, 0], 64, 64, seed=4), device)
    acc = accumulators(d, fill=0.375 if carry_in else float("nan"))
    out16 = accumulators(d, fill=3.0, dtype=BF16)
    got, _ = run(d, acc, carry_in=carry_in, wgrad_out=out16)
    assert got.dx.shape[0] == 0 and got.d_w.shape[0] == 0
    want = 0.375 if carry_in else 0.0
    for t in (*acc, *out16):
        assert bool((t == want).all())


def test_cuda_entry_point_refuses_zero_rows():
    """Checked on the host, so this runs on any machine: without rows no kernel would write the
    weight gradients (mok_torch's wrapper handles zero rows itself)."""
    p = 64
    acc_out = (p, p, p, 0, 0, 0, False)
    with pytest.raises(ValueError, match="num_rows = 0 on cuda"):
        mok_bf16.grouped_backward("cuda", p, p, p, p, p, 0, p, p, p, p, p, *acc_out, p, p, p, 0, 64, 64, 2)


# ------------------------------------------------------------------ CUDA


def assert_close(got: torch.Tensor, want64: torch.Tensor, scale64: torch.Tensor, rel: float, what: str) -> None:
    """|got - want| <= rel * |want| + 2^-13 * scale (fp32 sums of bf16 products)."""
    err = (got.double() - want64).abs()
    bound = want64.abs() * rel + scale64 * 2.0**-13 + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3f} x the bound"


def element_math(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor | None, limit):
    """The reference's SwiGLU backward elements (experts.row_backward) on a given fp32 g."""
    af, bf = a.float(), b.float()
    if limit is not None:
        af, bf = af.clamp(max=limit), bf.clamp(-limit, limit)
    s = sigmoid(af)
    silu = af * s
    h = (silu * bf).to(BF16)
    d_h = g if w is None else w[:, None] * g
    d_a = (d_h * bf) * (s * (1.0 + af * (1.0 - s)))
    d_b = d_h * silu
    if limit is not None:
        d_a = torch.where(a.float() <= limit, d_a, torch.zeros_like(d_a))
        d_b = torch.where(b.float().abs() <= limit, d_b, torch.zeros_like(d_b))
    return h, torch.cat([d_a, d_b], dim=-1).to(BF16)


def d_w_in_lane_order(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d_w = <g, h> in the CUDA SwiGLU backward's order (g_swiglu.cuh and experts_backward.cu's
    SwiGLU kernel, docs/determinism.md),
    fp32 op by op: lane l sums fl(g_i h_i) over its 8-element pieces l, l + 32, ... ascending
    from +0, then the 32 lane sums are added by a butterfly (xor 16, 8, 4, 2, 1)."""
    rows, I = g.shape
    prod = g * h.float()  # each product rounded to fp32
    lanes = torch.zeros(rows, 32)
    for piece in range(I // 8):
        for i in range(8 * piece, 8 * piece + 8):
            lanes[:, piece % 32] = lanes[:, piece % 32] + prod[:, i]
    for d in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, torch.arange(32) ^ d]
    return lanes[:, 0]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize("limit", [None, 0.75, 0.7])
def test_cuda_against_float64(lengths, H, I, limit):
    d = make(lengths, H, I, seed=H + I)
    dc = to(d, "cuda")
    M = d["x"].shape[0]
    scratch = GroupedScratch(
        torch.zeros(M, I, device="cuda"), *(torch.zeros(M, n, dtype=BF16, device="cuda") for n in (I, 2 * I))
    )
    got, acc = run(dc, limit=limit, scratch=scratch)
    torch.cuda.synchronize()
    dx, d_w = got.dx.cpu(), got.d_w.cpu()
    g, hw, d_ab = (t.cpu() for t in scratch)
    acc_gate, acc_up, acc_d = (t.cpu() for t in acc)
    used = torch.zeros(M, dtype=torch.bool)
    for lo, hi in segments(d["offsets"]):
        used[lo:hi] = True
    # The element math, bitwise the reference's on the kernel's g.
    h_ref, d_ab_ref = element_math(g[used], d["a"][used], d["b"][used], d["w"][used], limit)
    assert torch.equal(h_ref, swiglu(d["a"][used], d["b"][used], limit))
    assert torch.equal(d_ab[used], d_ab_ref)
    assert torch.equal(hw[used], (d["w"][used, None] * h_ref.float()).to(BF16))
    assert torch.equal(d_w[used], d_w_in_lane_order(g[used], h_ref))
    h = torch.zeros(M, I, dtype=BF16)
    h[used] = h_ref
    El = len(lengths)
    g64 = torch.zeros(M, I, dtype=torch.float64)
    dx64 = torch.zeros(M, H, dtype=torch.float64)
    g_scale, dx_scale = torch.zeros_like(g64), torch.zeros_like(dx64)
    gu64, gu_scale = torch.zeros(El, 2 * I, H, dtype=torch.float64), torch.zeros(El, 2 * I, H, dtype=torch.float64)
    dn64, dn_scale = torch.zeros(El, H, I, dtype=torch.float64), torch.zeros(El, H, I, dtype=torch.float64)
    for e, (lo, hi) in enumerate(segments(d["offsets"])):
        wd64 = d["wd"][e].double()
        g64[lo:hi] = d["dy"][lo:hi].double() @ wd64
        g_scale[lo:hi] = d["dy"][lo:hi].double().abs() @ wd64.abs()
        w_gu = torch.cat([d["wg"][e], d["wu"][e]]).double()
        dx64[lo:hi] = d_ab[lo:hi].double() @ w_gu
        dx_scale[lo:hi] = d_ab[lo:hi].double().abs() @ w_gu.abs()
        gu64[e] = d_ab[lo:hi].double().T @ d["x"][lo:hi].double()
        gu_scale[e] = d_ab[lo:hi].double().abs().T @ d["x"][lo:hi].double().abs()
        dn64[e] = d["dy"][lo:hi].double().T @ hw[lo:hi].double()
        dn_scale[e] = d["dy"][lo:hi].double().abs().T @ hw[lo:hi].double().abs()
    assert_close(g[used], g64[used], g_scale[used], 2.0**-20, "g")
    assert_close(dx[used], dx64[used], dx_scale[used], 2.0**-8, "dx")
    dw64 = (g.double() * h.double()).sum(-1)
    dw_scale = (g.double() * h.double()).abs().sum(-1)
    assert_close(d_w[used], dw64[used], dw_scale[used], 2.0**-20, "d_w")
    assert_close(acc_gate, gu64[:, :I], gu_scale[:, :I], 2.0**-20, "dWg")
    assert_close(acc_up, gu64[:, I:], gu_scale[:, I:], 2.0**-20, "dWu")
    assert_close(acc_d, dn64, dn_scale, 2.0**-20, "dWd")
    assert bool((dx[~used] == 7.0).all()) and bool((d_w[~used] == 7.0).all())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
def test_cuda_same_bits_with_or_without_g_stored(lengths, H, I):
    """At I <= G_SWIGLU_MAX_INNER the SwiGLU backward runs in the g GEMM's epilogue whether g is
    stored or not (scratch.g None, as the layer calls it): dx, d_w, bf16(w h), [d_a, d_b] and the
    weight gradients are the same bits either way. Above it g is required (a TypeError naming it)."""
    d = to(make(lengths, H, I, seed=H + I + 1), "cuda")
    M = d["x"].shape[0]
    if I > mok_bf16.G_SWIGLU_MAX_INNER:
        hw, d_ab = (torch.zeros(M, n, dtype=BF16, device="cuda") for n in (I, 2 * I))
        with pytest.raises(TypeError, match=r"scratch\.g must be a torch\.Tensor"):
            run(d, scratch=GroupedScratch(None, hw, d_ab))
        return
    results = []
    for g in (torch.zeros(M, I, device="cuda"), None):
        scratch = GroupedScratch(g, *(torch.zeros(M, n, dtype=BF16, device="cuda") for n in (I, 2 * I)))
        got, acc = run(d, limit=0.75, scratch=scratch)
        results.append((got.dx, got.d_w, scratch.hw, scratch.d_ab, *acc))
    torch.cuda.synchronize()
    for with_g, without_g in zip(*results, strict=True):
        assert torch.equal(with_g.view(torch.uint8), without_g.view(torch.uint8))


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns, every NaN as core::float_to_bf16's 0x7FFF (torch's CPU conversion
    writes other NaNs: 0x7FC0, or 0xFFFF in its vectorized loops)."""
    return torch.where(torch.isnan(t.float()), torch.tensor(0x7FFF, dtype=torch.int16), t.view(torch.int16))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("limit", [None, 0.75], ids=["no-limit", "limit"])
def test_cuda_element_math_on_every_gate_value(limit):
    """The SwiGLU backward's element math (its pair form on the device: the hardware's rounding
    of two values, a NaN as its canonical 0x7FFF) on all 65,536 bf16 gate patterns, NaN and infinities
    included, against up values with zeros, subnormals, the largest finite values, infinities
    and NaN, and g with a NaN row and rows that overflow: d_a, d_b and hw bitwise the
    reference's on the kernel's own g, each NaN 0x7FFF; d_w the reference's order where finite."""
    M, H, I = 256, 64, 256
    d = make([M], H, I, seed=29)
    d["a"] = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(BF16).reshape(M, I)
    specials = torch.tensor([0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81],
                            dtype=torch.int32).to(torch.int16).view(BF16)  # fmt: skip
    d["b"].view(-1)[::7] = specials.repeat(M * I // 7 // len(specials) + 1)[: (M * I + 6) // 7]
    d["dy"][3] = float("nan")
    d["dy"][5] = 3.0e38  # g overflows to +-inf where Wd's column sums do
    d["dy"][6, ::2] = -3.0e38
    scratch = GroupedScratch(
        torch.zeros(M, I, device="cuda"), *(torch.zeros(M, n, dtype=BF16, device="cuda") for n in (I, 2 * I))
    )
    got, _ = run(to(d, "cuda"), limit=limit, scratch=scratch)
    torch.cuda.synchronize()
    g, hw, d_ab = (t.cpu() for t in scratch)
    assert bool(torch.isnan(g[3]).all()) and bool(torch.isinf(g[5]).any())
    h_ref, d_ab_ref = element_math(g, d["a"], d["b"], d["w"], limit)
    assert torch.equal(d_ab.view(torch.int16), bf16_bits(d_ab_ref))
    assert torch.equal(hw.view(torch.int16), bf16_bits((d["w"][:, None] * h_ref.float()).to(BF16)))
    d_w, want = got.d_w.cpu(), d_w_in_lane_order(g, h_ref)
    assert torch.equal(torch.isnan(d_w), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(d_w[finite], want[finite])


@pytest.mark.gpu
@needs_gpu
def test_cuda_close_to_the_reference_arithmetic():
    """Against the CPU entry point (sequential fp32 sums) end to end: within bf16 rounding."""
    d = make([200, 90, 0, 33], 256, 128, seed=11)
    got, acc = run(to(d, "cuda"))
    dx, d_w, want, used = per_row_cpu(d, None)
    pairs = (("dx", got.dx[used], dx[used]), ("d_w", got.d_w[used], d_w[used]),
             ("dWg", acc[0], want[0]), ("dWu", acc[1], want[1]), ("dWd", acc[2], want[2]))  # fmt: skip
    for name, u, v in pairs:
        rel = (u.cpu().float() - v.float()).norm() / v.float().norm()
        assert rel < 4e-3, f"{name}: relative error {rel:.2e}"


@pytest.mark.gpu
@needs_gpu
def test_cuda_bitwise_run_to_run_and_any_grid():
    d = to(make([700, 5, 0, 333, 64], 512, 256, seed=5), "cuda")
    first, acc = run(d)
    for num_sms in (0, 0, 1, 3, 17):
        again, acc2 = run(d, num_sms=num_sms)
        for t, u in zip((*first, *acc), (*again, *acc2), strict=True):
            assert torch.equal(t, u), f"num_sms={num_sms}"


@pytest.mark.gpu
@needs_gpu
def test_cuda_rows_split_at_64_carry_the_weight_gradients():
    """Calls over rows split at multiples of 64 from every segment start: the bits of one call;
    dx and d_w of a row do not depend on the call or on where the row sits."""
    lengths = [300, 129, 0, 70]
    d = to(make(lengths, 256, 192, seed=9), "cuda")
    # One call from +0 (the accumulators hold junk that must not be read), bf16 out as well.
    acc_one, out_one = accumulators(d, fill=float("nan")), accumulators(d, dtype=BF16)
    whole, _ = run(d, acc_one, carry_in=False, wgrad_out=out_one)
    acc = accumulators(d, fill=float("nan"))
    # Call 1: rows [0, 128) (expert 0 only), from +0; call 2: rows [128, M) with 37 foreign rows
    # before them, carrying call 1's sums in, writing bf16 only.
    first = dict(d, offsets=torch.tensor([0, 128, 128, 128, 128], device="cuda"))
    part1, _ = run(first, acc, carry_in=False)
    pad = {k: torch.randn(37, *d[k].shape[1:], device="cuda").to(d[k].dtype) for k in ("x", "a", "b", "dy")}
    rest = {k: torch.cat([pad[k], d[k][128:]]) for k in pad}
    rest.update(wg=d["wg"], wu=d["wu"], wd=d["wd"], w=torch.cat([torch.rand(37, device="cuda"), d["w"][128:]]))
    rest["offsets"] = (d["offsets"] - 128 + 37).clamp(min=37)
    out = accumulators(d, dtype=BF16)
    part2, _ = run(rest, acc, wgrad_out=out)
    torch.cuda.synchronize()
    for u, v, w, z in zip(acc, acc_one, out, out_one, strict=True):
        assert torch.equal(u, v) and torch.equal(w, z) and torch.equal(z, v.to(BF16))
    assert torch.equal(whole.dx[:128], part1.dx[:128]) and torch.equal(whole.dx[128:], part2.dx[37:])
    assert torch.equal(whole.d_w[:128], part1.d_w[:128]) and torch.equal(whole.d_w[128:], part2.d_w[37:])
    # From +0 is the same as carrying zeros in.
    acc_zero = accumulators(d)
    run(d, acc_zero)
    for u, v in zip(acc_zero, acc_one, strict=True):
        assert torch.equal(u, v)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
def test_cuda_unweighted_rows_equal_weights_of_one(lengths, H, I):
    """router_weights None: w = 1 on every row (hw is h itself: bf16(1 * h) = h); every
    output bitwise the call with weights of exactly 1 (NaN rows included)."""
    d = to(make(lengths, H, I, seed=3, weighted=False), "cuda")
    if d["x"].shape[0] > 2:  # a NaN with a payload: dWd reads dy as it is on both paths
        d["dy"].view(torch.int16)[1, 5] = 0x7F81
    ones = dict(d, w=torch.ones(d["x"].shape[0], device="cuda"))
    got, acc = run(d)
    want, acc_want = run(ones)
    for u, v in zip((*got, *acc), (*want, *acc_want), strict=True):
        assert torch.equal(u.view(torch.int16 if u.dtype == BF16 else torch.int32),
                           v.view(torch.int16 if v.dtype == BF16 else torch.int32))  # fmt: skip


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize("num_sms", [0, 1, 17])
def test_cuda_bf16_only_weight_gradients_equal_the_fp32_path(lengths, H, I, num_sms):
    """bf16 outputs without fp32 accumulators (the deferred epilogue of wgrad_gemm.cuh) are
    bitwise what the kernel with accumulators writes, the fp32 sums rounded once; with one CTA
    (num_sms = 1) a CTA walks every tile: experts without rows, tiles of fewer k-blocks than the
    store pieces, the last pieces after the last tile."""
    d = to(make(lengths, H, I, seed=7), "cuda")
    acc = accumulators(d, fill=float("nan"))
    with_f32 = accumulators(d, fill=3.0, dtype=BF16)
    run(d, acc, num_sms=num_sms, carry_in=False, wgrad_out=with_f32)
    only = accumulators(d, fill=3.0, dtype=BF16)
    run(d, None, num_sms=num_sms, carry_in=False, wgrad_out=only)
    for u, v, w in zip(only, with_f32, acc, strict=True):
        assert torch.equal(u.view(torch.int16), v.view(torch.int16)) and torch.equal(u, w.to(BF16))


@pytest.mark.gpu
@needs_gpu
def test_cuda_experts_without_rows():
    """Carried in: their accumulators stay; from +0: their gradients are written as zeros."""
    d = to(make([0, 65, 0], 128, 64, seed=2), "cuda")
    acc = accumulators(d, fill=0.25)
    out = accumulators(d, fill=3.0, dtype=BF16)
    run(d, acc, wgrad_out=out)
    fresh = accumulators(d, fill=float("nan"))
    run(d, fresh, carry_in=False)
    torch.cuda.synchronize()
    for e in (0, 2):
        for t in acc:
            assert bool((t[e] == 0.25).all())
        for t in out:
            assert bool((t[e] == 0.25).all())
        for t in fresh:
            assert bool((t[e] == 0.0).all())
    assert not bool((acc[0][1] == 0.25).all())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize("carry_in", [False, True], ids=["bf16-only", "carried"])
def test_weights_by_route_give_the_bits_of_weights_in_table_order(device, lengths, H, I, carry_in):
    """`weight_route` (the cuda backend at one rank): each row's router weight read through its
    route from the routes' weights [T*K]; dx, d_w and the weight gradients bitwise those of the
    call with the weights copied into table order (0 for padding rows, about one in eight, and for
    a route past T*K; the routes a permutation, as a schedule table's are)."""
    d = make(lengths, H, I, seed=13)
    M = d["x"].shape[0]
    g = torch.Generator().manual_seed(14)
    padding = torch.rand(M, generator=g) < 0.125
    used = int((~padding).sum())
    TK = used + 3
    route = torch.full((M,), -1, dtype=torch.int32)
    route[~padding] = torch.randperm(TK, generator=g)[:used].to(torch.int32)
    if M > 2:
        route[M // 2] = TK + 5  # outside [0, T*K): weighs 0, as a padding row
    w_TK = torch.rand(TK, generator=g)
    valid = (route >= 0) & (route < TK)
    table_w = torch.where(valid, w_TK[torch.where(valid, route.long(), 0)], torch.zeros(()))
    d = to(d, device)
    results = []
    for w, by_route in ((table_w.to(device), None), (w_TK.to(device), route.to(device))):
        acc = accumulators(d, fill=0.5) if carry_in else None
        out16 = accumulators(d, fill=3.0, dtype=BF16)
        out = GroupedBackward(torch.full((M, H), 7.0, dtype=BF16, device=device), torch.full((M,), 7.0, device=device))
        got = grouped_backward(
            d["x"], d["offsets"], d["a"], d["b"], d["dy"], w, d["wg"], d["wu"], d["wd"], acc, out=out,
            carry_in=carry_in, wgrad_out=out16, weight_route=by_route,
        )  # fmt: skip
        results.append((got.dx, got.d_w, *out16, *(acc or ())))
    for u, v in zip(*results, strict=True):
        assert torch.equal(u.view(torch.int16 if u.dtype == BF16 else torch.int32),
                           v.view(torch.int16 if v.dtype == BF16 else torch.int32))  # fmt: skip


def token_routes(M: int, H: int, K: int, seed: int) -> tuple:
    """A table's routes over M rows (about one in eight a padding row, -1, and one route past
    T*K; the others a permutation of T*K routes, as a schedule table's are), the token rows
    dy_T [T, H] they read, the routes' weights and dy in table order (zeros where no route)."""
    g = torch.Generator().manual_seed(seed)
    padding = torch.rand(M, generator=g) < 0.125
    used = int((~padding).sum())
    T = -(-(used + 2) // K)
    route = torch.full((M,), -1, dtype=torch.int32)
    route[~padding] = torch.randperm(T * K, generator=g)[:used].to(torch.int32)
    if M > 2:
        route[M // 2] = T * K + 5  # outside [0, T*K): a padding row
    dy_T = torch.randn(T, H, generator=g).to(BF16)
    w_TK = torch.rand(T * K, generator=g)
    valid = (route >= 0) & (route < T * K)
    table_dy = torch.where(valid[:, None], dy_T[torch.where(valid, route.long(), 0) // K], torch.zeros((), dtype=BF16))
    return route, dy_T, w_TK, table_dy


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("dwd_gather", [0, 1], ids=["dwd-from-copy", "dwd-gathers"])
def test_dy_by_route_gives_the_bits_of_dy_in_table_order(device, lengths, H, I, K, dwd_gather):
    """`dy_tokens` (the cuda backend at one rank below GATHER_DY_MAX_HIDDEN): each row's dy read
    through its route from the token rows [T, H], gathered by the g GEMM's producers and again by
    dWd's where dwd_gather is 1 (at every I: one column tile of dWd or several, each gathering the
    rows; else read from the copy the g GEMM stores in table order); dx, d_w and the weight
    gradients bitwise the call with dy copied into table order (zeros for padding rows and a
    route past T*K; the routes a permutation, as a schedule table's are)."""
    d = make(lengths, H, I, seed=15)
    M = d["x"].shape[0]
    route, dy_T, w_TK, table_dy = token_routes(M, H, K, seed=16)
    d = to(d, device)
    results = []
    for dy, tokens in (
        (table_dy.to(device), None),
        (torch.full((M, H), float("nan"), dtype=BF16, device=device), dy_T.to(device)),
    ):
        out16 = accumulators(d, fill=3.0, dtype=BF16)
        out = GroupedBackward(torch.full((M, H), 7.0, dtype=BF16, device=device), torch.full((M,), 7.0, device=device))
        got = grouped_backward(
            d["x"], d["offsets"], d["a"], d["b"], dy, w_TK.to(device), d["wg"], d["wu"], d["wd"], None, out=out,
            carry_in=False, wgrad_out=out16, weight_route=route.to(device), dy_tokens=tokens,
            dwd_gather=dwd_gather,
        )  # fmt: skip
        results.append((got.dx, got.d_w, *out16))
    for u, v in zip(*results, strict=True):
        assert torch.equal(u.view(torch.int16 if u.dtype == BF16 else torch.int32),
                           v.view(torch.int16 if v.dtype == BF16 else torch.int32))  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize(
    "gathered, dwd_gather",
    [(False, -1), (True, 0), (True, 1)],
    ids=["dy-in-table-order", "dy-by-route-dwd-from-copy", "dy-by-route-dwd-gathers"],
)
def test_dx_into_dy_gives_the_bits_of_a_dx_of_its_own(device, lengths, H, I, gathered, dwd_gather):
    """out.dx may be dy_MH itself (the cuda backend's backward at one rank hands dy's table-order
    rows to dx: one [M, H] array less at its peak): dx, d_w and the weight gradients bitwise
    those of a dx of its own, with dy given in table order (which dWd, dy's last reader, reads
    before dx's GEMM writes over it) and gathered by route (then dy_MH is only dx's array)."""
    d = make(lengths, H, I, seed=17)
    M = d["x"].shape[0]
    route, dy_T, w_TK, table_dy = token_routes(M, H, 2, seed=18)
    d = to(d, device)
    results = []
    for shared in (False, True):
        dy = torch.full((M, H), float("nan"), dtype=BF16, device=device) if gathered else table_dy.to(device)
        dx = dy if shared else torch.full((M, H), 7.0, dtype=BF16, device=device)
        out16 = accumulators(d, fill=3.0, dtype=BF16)
        acc = accumulators(d, fill=0.5)
        got = grouped_backward(
            d["x"], d["offsets"], d["a"], d["b"], dy, w_TK.to(device), d["wg"], d["wu"], d["wd"], acc,
            out=GroupedBackward(dx, torch.full((M,), 7.0, device=device)), wgrad_out=out16,
            weight_route=route.to(device), dy_tokens=dy_T.to(device) if gathered else None,
            dwd_gather=dwd_gather,
        )  # fmt: skip
        assert got.dx is dx
        results.append((got.dx, got.d_w, *out16, *acc))
    for u, v in zip(*results, strict=True):
        assert torch.equal(u.view(torch.int16 if u.dtype == BF16 else torch.int32),
                           v.view(torch.int16 if v.dtype == BF16 else torch.int32))  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("lengths, H, I", GROUPED_CASES)
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("carried", [False, True], ids=["bf16-out", "fp32-carried"])
def test_dw1_modes_give_the_same_bits(device, lengths, H, I, K, carried):
    """dw1_mode 1 (dWg, dWu as x^T [d_a, d_b], [H, 2I] tiles stored transposed: the gate/up split
    inside a column tile where I is not a multiple of 256, a partial and a ghost row tile where H
    is not a multiple of 256) and 2 (the same with x's rows gathered by route from the token rows:
    padding rows and a route past T*K read zeros) give every output bitwise as mode 0 does, with
    bf16 outputs only and with fp32 accumulators carried in (distinct values, so that a carried
    element read from another's place, as a transposed load could, changes the bits)."""
    d = make(lengths, H, I, seed=19)
    M = d["x"].shape[0]
    route, x_T, w_TK, table_x = token_routes(M, H, K, seed=20)
    d["x"] = table_x
    d = to(d, device)
    g = torch.Generator().manual_seed(21)
    start = tuple(torch.randn(t.shape, generator=g).to(device) for t in accumulators(d)) if carried else ()
    results = []
    for mode in (0, 1, 2):
        x = torch.full((M, H), float("nan"), dtype=BF16, device=device) if mode == 2 else d["x"]
        out16 = accumulators(d, fill=3.0, dtype=BF16)
        acc = tuple(t.clone() for t in start) if carried else None
        got = grouped_backward(
            x, d["offsets"], d["a"], d["b"], d["dy"], w_TK.to(device), d["wg"], d["wu"], d["wd"], acc,
            carry_in=carried, wgrad_out=out16, weight_route=route.to(device),
            x_tokens=x_T.to(device) if mode == 2 else None, dw1_mode=mode,
        )  # fmt: skip
        results.append((got.dx, got.d_w, *out16, *(acc or ())))
    for other in results[1:]:
        for u, v in zip(results[0], other, strict=True):
            assert torch.equal(u.view(torch.int16 if u.dtype == BF16 else torch.int32),
                               v.view(torch.int16 if v.dtype == BF16 else torch.int32))  # fmt: skip


def bad_token_rows_call(name: str):
    """grouped_backward with token rows `name` (dy_tokens, or x_tokens with dw1_mode 2) on a small
    case, its routes and weights replaceable."""
    d = make([5, 3], 64, 64, seed=1)
    acc = accumulators(d)
    route = torch.arange(8, dtype=torch.int32)
    w = torch.rand(8)

    def call(rows=None, weight_route=route, **kw):
        kw.setdefault(name, rows)
        if name == "x_tokens":
            kw.setdefault("dw1_mode", 2)
        return grouped_backward(
            d["x"], d["offsets"], d["a"], d["b"], d["dy"], w if weight_route is not None else d["w"], d["wg"],
            d["wu"], d["wd"], acc, weight_route=weight_route, **kw,
        )  # fmt: skip

    return call


@pytest.mark.parametrize("name", ["dy_tokens", "x_tokens"])
def test_bad_token_rows_raise_naming_the_argument(name):
    call = bad_token_rows_call(name)
    with pytest.raises(ValueError, match=f"{name} needs weight_route"):
        call(torch.zeros(4, 64, dtype=BF16), weight_route=None)
    with pytest.raises(TypeError, match=f"{name} must have dtype bfloat16"):
        call(torch.zeros(4, 64))
    with pytest.raises(ValueError, match=rf"{name} must have shape \[T, H\]"):
        call(torch.zeros(4, 32, dtype=BF16))
    with pytest.raises(ValueError, match="T\\*K routes for T = 3 tokens"):
        call(torch.zeros(3, 64, dtype=BF16))


def test_bad_dw1_mode_raises_naming_the_argument():
    call = bad_token_rows_call("x_tokens")
    for bad in (3, -1, True, 0.5):
        with pytest.raises(ValueError, match="dw1_mode must be 0, 1 or 2"):
            call(dw1_mode=bad)
    with pytest.raises(ValueError, match="dw1_mode=2 needs x_tokens"):
        call()
    with pytest.raises(ValueError, match="x_tokens is read only with dw1_mode=2"):
        call(torch.zeros(4, 64, dtype=BF16), dw1_mode=1)
    with pytest.raises(ValueError, match="x_tokens and dy_tokens must have the same tokens"):
        call(torch.zeros(4, 64, dtype=BF16), dy_tokens=torch.zeros(2, 64, dtype=BF16))


def extension_args(d: dict) -> tuple:
    """mok_bf16.grouped_backward's positional arguments on the CPU for case `d` (fresh outputs and
    accumulators), and the tensors they address (to keep alive)."""
    acc = accumulators(d)
    out = GroupedBackward(torch.zeros_like(d["dy"]), torch.zeros(d["dy"].shape[0]))
    M, H = d["x"].shape
    El, I = d["wg"].shape[:2]
    args = (
        "cpu", d["x"].data_ptr(), d["offsets"].data_ptr(), d["a"].data_ptr(), d["b"].data_ptr(), d["dy"].data_ptr(),
        d["w"].data_ptr(), d["wg"].data_ptr(), d["wu"].data_ptr(), d["wd"].data_ptr(), out.dx.data_ptr(),
        out.d_w.data_ptr(), *(t.data_ptr() for t in acc), 0, 0, 0, True, 0, 0, 0, M, H, I, El,
    )  # fmt: skip
    return args, (acc, out)


def test_mok_bf16_rejects_a_bad_dw1_mode_naming_it():
    """The extension checks dw1_mode and x_tokens too (a caller past the wrapper)."""
    d = make([5, 3], 64, 64, seed=1)
    args, _keep = extension_args(d)
    with pytest.raises(ValueError, match="dw1_mode must be 0, 1"):
        mok_bf16.grouped_backward(*args, dw1_mode=3)
    with pytest.raises(ValueError, match=r"dw1_mode 2 .* is for 'cuda'"):
        mok_bf16.grouped_backward(*args, dw1_mode=2, x_tokens=d["x"].data_ptr())
    with pytest.raises(ValueError, match="x_tokens is read only with dw1_mode 2"):
        mok_bf16.grouped_backward(*args, x_tokens=d["x"].data_ptr())


@pytest.mark.parametrize("dwd_gather", [2, -2, True, 0.5])
def test_bad_dwd_gather_raises_naming_the_argument(dwd_gather):
    d = make([5, 3], 64, 64, seed=1)
    with pytest.raises(ValueError, match="dwd_gather must be -1"):
        grouped_backward(
            d["x"], d["offsets"], d["a"], d["b"], d["dy"], d["w"], d["wg"], d["wu"], d["wd"], accumulators(d),
            dwd_gather=dwd_gather,
        )  # fmt: skip


def test_mok_bf16_rejects_a_bad_dwd_gather_naming_it():
    """The extension checks it too (a caller of mok_bf16.grouped_backward past the wrapper)."""
    args, _keep = extension_args(make([5, 3], 64, 64, seed=1))
    with pytest.raises(ValueError, match="dwd_gather must be -1"):
        mok_bf16.grouped_backward(*args, dwd_gather=3)


def test_bad_weight_route_raises_naming_the_argument():
    d = make([5, 3], 64, 64, seed=1)
    acc = accumulators(d)
    route = torch.arange(8, dtype=torch.int32)

    def call(weight_route, w=d["w"]):
        return grouped_backward(
            d["x"], d["offsets"], d["a"], d["b"], d["dy"], w, d["wg"], d["wu"], d["wd"], acc, weight_route=weight_route
        )

    with pytest.raises(TypeError, match="weight_route must have dtype int32"):
        call(route.long())
    with pytest.raises(ValueError, match=r"weight_route must have shape \[M\]"):
        call(route[:3])
    with pytest.raises(ValueError, match="weight_route needs router_weights"):
        call(route, w=None)
    with pytest.raises(ValueError, match=r"router_weights must have shape \[T\*K\]"):
        call(route, w=d["w"][None])
