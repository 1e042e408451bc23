"""MXFP8 quantization against a reference written from the OCP Microscaling spec.

The spec reference below uses exact rational arithmetic: the E4M3 value set from the bit
layout (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent field 0 subnormal;
0x7F/0xFF NaN), the scale rule from its definition, and rounding as "the nearest finite
E4M3 value, ties to the even code". Every implementation (mok-mxfp8 on the CPU and on CUDA,
the pure-PyTorch one) must give its bytes exactly.
"""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import pytest
import torch

import mok_torch as mok
from mok_torch.mxfp8 import _compiled, dequantize_blocks, fake_quantize, pack_rows, quantize_rows_torch

# ---------------------------------------------------------------- the spec, in exact arithmetic


def e4m3_value(code: int) -> Fraction | None:
    """The value of an E4M3 (fn) byte; None for NaN."""
    sign = -1 if code & 0x80 else 1
    field, frac = (code >> 3) & 0xF, code & 0x7
    if field == 15 and frac == 7:
        return None
    if field == 0:
        return sign * Fraction(frac, 8) * Fraction(1, 2**6)
    return sign * (1 + Fraction(frac, 8)) * Fraction(2) ** (field - 7)


# Non-negative finite codes sorted by value (0x00 .. 0x7E are increasing).
POSITIVE = [(e4m3_value(c), c) for c in range(0x7F)]
VALUES = [v for v, _ in POSITIVE]


def spec_encode(v: Fraction, negative: bool) -> int:
    """Nearest finite E4M3 to |v| (ties to the even code), saturating; sign from `negative`."""
    a = abs(v)
    i = bisect.bisect_left(VALUES, a)
    if i == len(VALUES):
        code = 0x7E
    elif VALUES[i] == a or i == 0:
        code = POSITIVE[i][1]
    else:
        lo, hi = POSITIVE[i - 1], POSITIVE[i]
        dlo, dhi = a - lo[0], hi[0] - a
        code = lo[1] if dlo < dhi or (dlo == dhi and lo[1] % 2 == 0) else hi[1]
    return code | (0x80 if negative else 0)


def spec_scale(amax: Fraction, rule: str) -> int:
    if amax == 0:
        return -127
    floor_log2 = math.floor(math.log2(amax))
    while Fraction(2) ** floor_log2 > amax:  # guard the float log
        floor_log2 -= 1
    while Fraction(2) ** (floor_log2 + 1) <= amax:
        floor_log2 += 1
    if rule == "floor":
        e = floor_log2 - 8
    else:
        e = floor_log2 - 9
        while amax > 448 * Fraction(2) ** e:
            e += 1
    return max(-127, min(127, e))


def spec_quantize_block(values: list[float], rule: str) -> tuple[list[int], int]:
    """(E4M3 codes, E8M0 byte) of one block of fp32 values."""
    neg = [math.copysign(1.0, v) < 0 for v in values]
    if any(not math.isfinite(v) for v in values):
        return [0x7F | (0x80 if n else 0) for n in neg], 0xFF
    exact = [Fraction(v) for v in values]
    e = spec_scale(max(abs(v) for v in exact), rule)
    scale = Fraction(2) ** e
    return [spec_encode(v / scale, n) for v, n in zip(exact, neg, strict=True)], e + 127


def spec_quantize(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major (data, scales) of x [N, C] by the spec."""
    rows = x.float().tolist()
    data, scales = [], []
    for row in rows:
        codes, sc = [], []
        for j in range(0, len(row), 32):
            c, s = spec_quantize_block(row[j : j + 32], rule)
            codes += c
            sc.append(s)
        data.append(codes)
        scales.append(sc)
    return torch.tensor(data, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# ---------------------------------------------------------------- inputs


def boundary_blocks() -> torch.Tensor:
    """fp32 blocks [N, 32] that probe the rules: scale boundaries, rounding ties, subnormals,
    saturation, zeros, NaN and infinity, fp32 subnormal inputs, the extreme exponents."""
    g = torch.Generator().manual_seed(0)
    blocks = []
    # amax exactly at, just below and just above 448 * 2^k and 1.75 * 2^k
    for k in (-130, -100, -20, -1, 0, 1, 7, 8, 9, 40, 110):
        for amax in (
            448 * 2.0**k,
            math.nextafter(448 * 2.0**k, 0),
            math.nextafter(448 * 2.0**k, math.inf),
            1.75 * 2.0**k,
            2.0**k,
            math.nextafter(2.0**k, 0),
        ):
            if amax == 0 or not math.isfinite(amax):
                continue
            rest = (torch.rand(31, generator=g) * 2 - 1) * amax
            blocks.append(torch.cat([torch.tensor([amax]), rest]))
    # every E4M3 value and the midpoints between neighbours (ties) at scale 1: amax 448
    vals = [float(v) for v in VALUES]
    mids = [float((VALUES[i] + VALUES[i + 1]) / 2) for i in range(len(VALUES) - 1)]
    pool = torch.tensor(vals + mids + [-v for v in mids])
    for j in range(0, len(pool), 31):
        chunk = pool[j : j + 31]
        blocks.append(torch.cat([torch.tensor([448.0]), chunk, torch.zeros(31 - len(chunk))]))
    # saturation under FLOOR (values in (448, 512) * 2^e), tiny elements next to large ones
    blocks.append(torch.tensor([511.0, 500.0, 464.0, 465.0, 449.0, -480.0] + [1e-3] * 26))
    blocks.append(torch.tensor([1e30] + [1e-10] * 30 + [-3e29]))
    # zeros with signs, an all-zero block, a negative-zero block
    blocks.append(torch.zeros(32))
    blocks.append(torch.full((32,), -0.0))
    blocks.append(torch.tensor([0.0, -0.0, 1.0, -1.0] * 8))
    # NaN and infinities
    blocks.append(torch.tensor([1.0, float("nan")] + [-2.0] * 30))
    blocks.append(torch.tensor([float("inf")] + [0.5] * 30 + [-1.0]))
    blocks.append(torch.tensor([-float("inf")] + [-0.5] * 31))
    # fp32 subnormals and the largest finite values
    blocks.append(torch.tensor([f32(1), f32(3), f32(0x7FFFFF), -f32(0x400000)] + [0.0] * 28))
    blocks.append(torch.tensor([f32(0x7F7FFFFF), -f32(0x7F7FFFFF)] + [1e37] * 30))
    # random magnitudes across the range
    for k in (-120, -60, -10, 0, 10, 60, 120):
        blocks.append(torch.randn(32, generator=g) * 2.0**k)
    return torch.stack(blocks).float()


def compiled_or_skip(device: str):
    mod = _compiled(device)
    if mod is None:
        pytest.skip(f"mok-mxfp8's quantizer is not installed for {device} (built without it)")
    return mod


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_torch_quantizer_matches_the_spec(rule):
    x = boundary_blocks()
    want_data, want_scales = spec_quantize(x, rule)
    data, scales = quantize_rows_torch(x, rule)
    assert torch.equal(scales, want_scales)
    assert torch.equal(data, want_data)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_quantizer_matches_the_spec(rule, dtype):
    compiled_or_skip("cpu")
    x = boundary_blocks()
    if dtype == torch.bfloat16:
        x = x.to(dtype)  # bf16 inputs: the spec sees their exact values
    q = mok.mxfp8_quantize(x, normal=True, transposed=False, rule=rule)
    want_data, want_scales = spec_quantize(x.float(), rule)
    assert torch.equal(q.scales.view(torch.uint8).t(), want_scales)
    assert torch.equal(q.data.view(torch.uint8), want_data)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (3, 32, 160), (2, 5, 128, 32)])
def test_compiled_and_torch_quantizers_agree(rule, dtype, shape):
    """Normal and transposed copies, block-major scales, batched inputs: the same bytes."""
    compiled_or_skip("cpu")
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * torch.logspace(-8, 8, shape[-1], base=2.0)).to(dtype)
    R, C = shape[-2], shape[-1]
    transposed = R % 32 == 0
    a = mok.mxfp8_quantize(w, normal=True, transposed=transposed, rule=rule)
    b = mok.mxfp8_quantize(w, normal=True, transposed=transposed, rule=rule, compiled=False)
    for field in ("data", "scales", "data_t", "scales_t"):
        ta, tb = getattr(a, field), getattr(b, field)
        assert (ta is None) == (tb is None)
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), field
    assert a.data.shape == w.shape and a.scales.shape == w.shape[:-2] + (C // 32, R)
    if transposed:
        assert a.data_t.shape == w.shape[:-2] + (C, R) and a.scales_t.shape == w.shape[:-2] + (R // 32, C)
        # the transposed copy is the normal quantization of w^T
        t = mok.mxfp8_quantize(w.transpose(-2, -1).contiguous(), transposed=False, rule=rule)
        assert torch.equal(a.data_t.view(torch.uint8), t.data.view(torch.uint8))
        assert torch.equal(a.scales_t.view(torch.uint8), t.scales.view(torch.uint8))


@pytest.mark.parametrize("compiled", [True, False])
def test_empty_and_strided_inputs(compiled):
    if compiled:
        compiled_or_skip("cpu")
    q = mok.mxfp8_quantize(torch.zeros(0, 64), compiled=compiled)
    assert q.data.shape == (0, 64) and q.scales.shape == (2, 0) and q.data_t.shape == (64, 0)
    q = mok.mxfp8_quantize(torch.zeros(2, 0, 32, 64, dtype=torch.bfloat16), compiled=compiled)
    assert q.data.shape == (2, 0, 32, 64) and q.scales.shape == (2, 0, 2, 32)
    w = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(4))[:, :, :64]  # not contiguous
    got, want = mok.mxfp8_quantize(w, compiled=compiled), mok.mxfp8_quantize(w.contiguous(), compiled=False)
    for field in ("data", "scales", "data_t", "scales_t"):
        assert torch.equal(getattr(got, field).view(torch.uint8), getattr(want, field).view(torch.uint8)), field


def test_threads_do_not_change_bytes():
    mod = compiled_or_skip("cpu")
    x = torch.randn(257, 512)
    outs = []
    for threads in (1, 2, 7):
        data = torch.empty(257, 512, dtype=torch.uint8)
        scales = torch.empty(257, 16, dtype=torch.uint8)
        mod.quantize(
            "cpu",
            x.data_ptr(),
            "fp32",
            1,
            257,
            512,
            0,
            512,
            1,
            data.data_ptr(),
            scales.data_ptr(),
            16,
            1,
            num_threads=threads,
        )
        outs.append((data, scales))
    want = quantize_rows_torch(x)
    for data, scales in outs:
        assert torch.equal(data, want[0]) and torch.equal(scales, want[1])


def test_dequantize_is_exact_and_requantizing_is_idempotent():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 64, 96, generator=g).to(torch.bfloat16)
    q = mok.mxfp8_quantize(w)
    v = q.dequantize()
    # exact: every value is an E4M3 value times a power of two, and bf16 holds it
    assert torch.equal(v.to(torch.bfloat16).float(), v)
    again = mok.mxfp8_quantize(v)
    assert torch.equal(again.dequantize(), v)
    assert torch.equal(q.dequantize(transposed=True), fake_quantize(w, dim=-2).transpose(-2, -1))
    # error bound of E4M3 with RCEIL: half an ulp of 3 mantissa bits, relative to the block max
    err = (v - w.float()).abs().unflatten(-1, (-1, 32))
    amax = w.float().abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    assert bool((err <= amax * 2.0**-4 + 2.0**-130).all())


def test_dequantize_blocks_special_bytes():
    data = torch.tensor([[0x00, 0x80, 0x01, 0x7E, 0xFE, 0x7F] + [0] * 26], dtype=torch.uint8)
    got = dequantize_blocks(data, torch.tensor([[127]], dtype=torch.uint8))
    assert got[0, :5].tolist() == [0.0, -0.0, 2.0**-9, 448.0, -448.0] and math.isnan(got[0, 5])
    assert math.copysign(1.0, got[0, 1].item()) < 0
    tiny = dequantize_blocks(data, torch.tensor([[0]], dtype=torch.uint8))  # scale 2^-127
    assert tiny[0, 2].item() == 2.0**-136
    nan = dequantize_blocks(data, torch.tensor([[0xFF]], dtype=torch.uint8))
    assert bool(torch.isnan(nan).all())


def test_bad_input():
    with pytest.raises(TypeError, match=r"w must be a torch\.Tensor"):
        mok.mxfp8_quantize([1.0])
    with pytest.raises(TypeError, match="w must have dtype"):
        mok.mxfp8_quantize(torch.zeros(32, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="at least 2 dims"):
        mok.mxfp8_quantize(torch.zeros(32))
    with pytest.raises(ValueError, match="C \\(48\\) must be a multiple of 32"):
        mok.mxfp8_quantize(torch.zeros(32, 48), transposed=False)
    with pytest.raises(ValueError, match="R \\(40\\) must be a multiple of 32"):
        mok.mxfp8_quantize(torch.zeros(40, 32))
    with pytest.raises(ValueError, match="rule must be one of"):
        mok.mxfp8_quantize(torch.zeros(32, 32), rule="up")
    with pytest.raises(ValueError, match="normal=True, transposed=True or both"):
        mok.mxfp8_quantize(torch.zeros(32, 32), normal=False, transposed=False)
    with pytest.raises(ValueError, match="no transposed copy"):
        mok.mxfp8_quantize(torch.zeros(32, 32), transposed=False).dequantize(transposed=True)


def test_compiled_entry_point_rejects_bad_arguments():
    mod = compiled_or_skip("cpu")
    x = torch.zeros(4, 64)
    d = torch.empty(4, 64, dtype=torch.uint8)
    s = torch.empty(4, 2, dtype=torch.uint8)
    args = dict(src_batch_stride=0, src_row_stride=64, src_col_stride=1, scale_row_stride=2, scale_block_stride=1)

    def call(**kw):
        a = dict(
            device="cpu",
            src=x.data_ptr(),
            src_dtype="fp32",
            batch=1,
            rows=4,
            cols=64,
            data=d.data_ptr(),
            scales=s.data_ptr(),
            **args,
        )
        a.update(kw)
        mod.quantize(**a)

    call()  # valid
    with pytest.raises(ValueError, match="cols must be a non-negative multiple of 32"):
        call(cols=48)
    with pytest.raises(ValueError, match="src must not be 0"):
        call(src=0)
    with pytest.raises(ValueError, match="scale strides"):
        call(scale_row_stride=3)
    with pytest.raises(ValueError, match="src_dtype"):
        call(src_dtype="fp16")
    with pytest.raises(ValueError, match="rule"):
        call(rule="ceil")
    with pytest.raises(ValueError, match="device"):
        call(device="tpu")
    with pytest.raises(ValueError, match="num_threads"):
        call(num_threads=0)
    with pytest.raises(ValueError, match="data_row_stride must be 0 or >= cols"):
        call(data_row_stride=32)
    with pytest.raises(ValueError, match="needs batch 1"):
        call(batch=2, rows=2, data_row_stride=80, scale_row_stride=80)
    with pytest.raises(ValueError, match="scale strides"):  # scales with the rows: stride of the rows
        call(data_row_stride=80, scale_row_stride=5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40, 32), (7, 96), (128, 256), (1, 7168), (0, 64)], ids=str)
def test_pack_rows_compiled_is_the_torch_quantizer(device, dtype, shape):
    """MXFP8 rows (the layer's activations) by mok-mxfp8's quantizer, rows with their scales: the
    pure-PyTorch bytes, on row sizes with and without 8-byte alignment (C + C/32 = 33 at C = 32)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    compiled_or_skip(device)
    g = torch.Generator().manual_seed(7)
    N, C = shape
    x = torch.randn(N, C, generator=g) * torch.logspace(-30, 30, C, base=2.0)
    if N * C:
        bb = boundary_blocks().flatten()
        n = min(bb.numel(), N * C)
        x.view(-1)[:n] = bb[:n]
    x = x.to(dtype)
    want = pack_rows(x, compiled=False)
    got = pack_rows(x.to(device))
    assert got.shape == (N, C + C // 32) and got.dtype == torch.uint8
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_quantizer_matches_cpu(rule, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    compiled_or_skip("cuda")
    g = torch.Generator().manual_seed(3)
    bb = boundary_blocks()
    bb = bb[: bb.shape[0] // 4 * 4].reshape(-1, 128)
    x = torch.cat([bb, torch.randn(128 - bb.shape[0], 128, generator=g)]).to(dtype)
    w = torch.stack([x, x.flip(0)])  # [2, 128, 128], boundary values in rows and in columns
    cpu = mok.mxfp8_quantize(w, rule=rule, compiled=True)
    gpu = mok.mxfp8_quantize(w.cuda(), rule=rule)
    ref = mok.mxfp8_quantize(w.cuda(), rule=rule, compiled=False)  # torch's CUDA conversion too
    for field in ("data", "scales", "data_t", "scales_t"):
        want = getattr(cpu, field).view(torch.uint8)
        assert torch.equal(getattr(gpu, field).view(torch.uint8).cpu(), want), field
        assert torch.equal(getattr(ref, field).view(torch.uint8).cpu(), want), field


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 64, 520), (96, 264), (2, 32, 36), (1, 160, 1024)], ids=str)
def test_cuda_transposed_copies_over_tiles(dtype, shape):
    """Transposed copies across several 256-row tiles, a partial last tile, and a row count that
    is not a multiple of 8 (one thread per block): the CPU's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    compiled_or_skip("cuda")
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(shape, generator=g) * torch.logspace(-20, 20, shape[-1], base=2.0)).to(dtype)
    w.view(-1)[:64] = boundary_blocks().flatten()[:64].to(dtype)
    cpu = mok.mxfp8_quantize(w, normal=False, compiled=True)
    gpu = mok.mxfp8_quantize(w.cuda(), normal=False)
    for field in ("data_t", "scales_t"):
        want = getattr(cpu, field).view(torch.uint8)
        assert torch.equal(getattr(gpu, field).view(torch.uint8).cpu(), want), field


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 4, 8], ids=["aligned", "8-byte-offset", "16-byte-offset"])
def test_cuda_quantizer_on_strided_views(offset):
    """Row views at any offset (the lane-shared kernel for 16-byte aligned rows, one thread per
    block otherwise) and batch strides with padding: the CPU's bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    compiled_or_skip("cuda")
    g = torch.Generator().manual_seed(5)
    big = (torch.randn(3, 64, 200, generator=g) * torch.logspace(-6, 6, 200, base=2.0)).to(torch.bfloat16)
    w = big[:, :, offset : offset + 160]  # rows 400 bytes apart, the first at `offset` elements
    cpu = mok.mxfp8_quantize(w, rule="rceil", compiled=True)
    gpu = mok.mxfp8_quantize(w.cuda(), rule="rceil")
    for field in ("data", "scales", "data_t", "scales_t"):
        want = getattr(cpu, field).view(torch.uint8)
        assert torch.equal(getattr(gpu, field).view(torch.uint8).cpu(), want), field
