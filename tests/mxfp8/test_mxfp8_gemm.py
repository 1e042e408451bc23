"""mok-mxfp8's grouped GEMM in the input-gradient orientation (`grouped_gemm`): out[rows of e] =
A[rows of e] @ B_e^T with both operands quantized along K, B one weight or two along K.

g = dy_q @ Q_H(Wd^T)^T reads Wd's transposed copy; dx = Q_2I([d_a, d_b]) @ [Q_I(Wg^T); Q_I(Wu^T)]^T
reads Wg's and Wu's transposed copies one after the other (a K split). CPU: the reference
arithmetic (32-block partials summed in fp32 in K order), against a float64 product of the
dequantized operands. CUDA (skipped, with the reason, without a GPU): the sm_90a FP8 GEMM
against the same float64 product (tight: only the order of the sums differs), and the
determinism contract (docs/determinism.md) bitwise: run to run, any grid size, a row's bits
independent of where it sits and of the other rows, a K split the same as one weight holding
both, bf16 outputs the rounding of the fp32 ones.

Shape letters: docs/design.md §1; the GEMMs here are M rows x N output columns, K their reduction (not top-k).
"""

from __future__ import annotations

import pytest
import torch

from mok_torch.backends.native.mxfp8_grouped import hq_row_bytes, mxfp8_grouped_gemm, pack_split_rows, split_a_cols
from mok_torch.mxfp8 import mxfp8_quantize, pack_rows, unpack_rows

mok_mxfp8 = pytest.importorskip("mok_mxfp8", reason="mok-mxfp8 is not installed")
if not hasattr(mok_mxfp8, "grouped_gemm"):
    pytest.skip("the installed mok-mxfp8 has no grouped_gemm", allow_module_level=True)

BF16 = torch.bfloat16
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")

# (lengths, N, K, k_split): k_split 0 is one weight (g's orientation: N = I, K = H), else two
# along K (dx's: N = H, K = 2I, k_split = I; a multiple of 128 for the GPU's stages).
CASES = [
    pytest.param([300, 0, 129, 1], 192, 128, 0, id="g-mixed"),
    pytest.param([1], 64, 64, 0, id="one-row"),
    pytest.param([0, 0, 0], 64, 128, 0, id="all-empty"),
    pytest.param([64, 128, 127, 255, 257], 256, 256, 128, id="dx-tile-edges"),
    pytest.param([1000, 3, 5, 0, 0, 2, 1, 24], 512, 768, 384, id="dx-skewed"),
    pytest.param([300, 77, 0, 200], 640, 1024, 0, id="g-long-K"),
    pytest.param([517], 320, 1280, 640, id="dx-one-expert"),
    pytest.param([40, 9], 128, 192, 0, id="K-192"),  # a last stage of 2 slices
    # K splits off the 128-deep stages (gpt-oss's I = 2880 is 64 mod 128): A holds the second
    # part from K0 rounded up to 128 on
    pytest.param([64, 100, 0, 37], 192, 128, 64, id="dx-split-64"),
    pytest.param([300, 5, 77], 320, 640, 320, id="dx-split-320"),
]


def make(lengths: list[int], N: int, K: int, k_split: int, seed: int = 0) -> tuple:
    """A as MXFP8 rows in wider rows (as the layer's tables hold them), the offsets, and B as
    (data, scales) pairs of transposed copies (one, or two along K), all on the CPU."""
    g = torch.Generator().manual_seed(seed)
    El, M = len(lengths), sum(lengths)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    a = (torch.randn(M, K, generator=g) * 2).to(BF16)
    rows = split_layout(pack_rows(a), K, k_split, g)
    parts = [k_split, K - k_split] if k_split else [K]
    # W^T [El, K', N] quantized along K' (its transposed copy): the layout of Wd^T, Wg^T, Wu^T
    bs = []
    for k in parts:
        w = (torch.randn(El, k, N, generator=g) / K**0.5).to(BF16)
        bs.append(mxfp8_quantize(w, normal=False).operand(transposed=True))
    return rows, offsets, bs


def split_layout(packed: torch.Tensor, K: int, k_split: int, g: torch.Generator) -> torch.Tensor:
    """MXFP8 rows [M, K + K/32] in `mxfp8_grouped_gemm`'s A layout (the part past k_split from
    k_split rounded up to 128 on), in wider 16-byte rows; the gap holds random bytes and NaN
    scales, so a kernel that read it would fail the test."""
    M, KA = packed.shape[0], split_a_cols(K, k_split)
    rows = torch.zeros(M, hq_row_bytes(KA) + 16, dtype=torch.uint8)
    K0 = k_split or K
    K0a = KA - (K - K0)  # the second part's first column
    rows[:, K0:K0a] = torch.randint(0, 256, (M, K0a - K0), generator=g, dtype=torch.uint8)
    rows[:, KA + K0 // 32 : KA + K0a // 32] = 0xFF
    rows[:, :K0], rows[:, K0a:KA] = packed[:, :K0], packed[:, K0:K]
    rows[:, KA : KA + K0 // 32] = packed[:, K : K + K0 // 32]
    rows[:, KA + K0a // 32 : KA + KA // 32] = packed[:, K + K0 // 32 :]
    return rows


def packed_of(rows: torch.Tensor, K: int, k_split: int) -> torch.Tensor:
    """The MXFP8 rows [M, K + K/32] (`pack_rows`'s form) of rows in the split layout."""
    KA, K0 = split_a_cols(K, k_split), k_split or K
    K0a = KA - (K - K0)
    data = torch.cat([rows[:, :K0], rows[:, K0a:KA]], dim=1)
    scales = torch.cat([rows[:, KA : KA + K0 // 32], rows[:, KA + K0a // 32 : KA + KA // 32]], dim=1)
    return torch.cat([data, scales], dim=1)


def a_values(rows: torch.Tensor, K: int, k_split: int) -> torch.Tensor:
    """float32 A [M, K] of rows in the split layout."""
    return unpack_rows(packed_of(rows, K, k_split), K)


def dequantized(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """float64 B_e [El, N, K'] of a (data [El, N, K'], scales [El, K'/32, N]) pair."""
    data, scales = b
    values = data.view(torch.float8_e4m3fn).double().unflatten(-1, (-1, 32))
    return (values * scales.view(torch.float8_e8m0fnu).double().transpose(1, 2)[..., None]).flatten(-2)


def f64(rows, offsets, bs, K, k_split) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product per segment, and the scale of its sums (sum of |products|)."""
    a = a_values(rows, K, k_split).double()
    b = torch.cat([dequantized(x) for x in bs], dim=2)
    M, N = a.shape[0], b.shape[1]
    out, scale = torch.zeros(M, N, dtype=torch.float64), torch.zeros(M, N, dtype=torch.float64)
    for e in range(len(offsets) - 1):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = a[lo:hi] @ b[e].T
        scale[lo:hi] = a[lo:hi].abs() @ b[e].abs().T
    return out, scale


def call(rows, K, offsets, bs, **kw) -> torch.Tensor:
    return mxfp8_grouped_gemm(rows, K, offsets, bs[0], bs[1] if len(bs) > 1 else None, **kw)


def assert_close(got: torch.Tensor, want64: torch.Tensor, scale64: torch.Tensor, fp32: bool, what: str) -> None:
    """|got - want| <= the output's rounding (bf16, or fp32) plus the sums' rounding error on the
    scale (2^-12 of sum |products|: the FP8 wgmma keeps fewer than fp32's bits inside an
    instruction; the CPU's sequential fp32 sums are well inside it)."""
    err = (got.double() - want64).abs()
    bound = want64.abs() * (2.0**-23 if fp32 else 2.0**-8) + scale64 * 2.0**-12 + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3f} x the bound"


def concatenated(bs) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight holding both of a K split: data along K, scales along K/32."""
    return torch.cat([b[0].view(torch.uint8) for b in bs], dim=2), torch.cat(
        [b[1].view(torch.uint8) for b in bs], dim=1
    )


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("lengths, N, K, k_split", CASES)
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_cpu_against_float64(lengths, N, K, k_split, out_dtype):
    rows, offs, bs = make(lengths, N, K, k_split, seed=N + K)
    got = call(rows, K, offs, bs, out_dtype=out_dtype)
    want, scale = f64(rows, offs, bs, K, k_split)
    assert got.dtype == out_dtype and got.shape == (rows.shape[0], N)
    assert_close(got, want, scale, out_dtype == torch.float32, "out")


@pytest.mark.parametrize("k_split", [128, 64, 192])
def test_cpu_split_is_one_weight_holding_both_and_bf16_rounds_fp32(k_split):
    rows, offs, bs = make([50, 0, 31], 128, 256, k_split, seed=2)
    split = call(rows, 256, offs, bs, out_dtype=torch.float32)
    whole = split_layout(packed_of(rows, 256, k_split), 256, 0, torch.Generator())
    assert torch.equal(split, call(whole, 256, offs, [concatenated(bs)], out_dtype=torch.float32))
    assert torch.equal(call(rows, 256, offs, bs), split.to(BF16))


@pytest.mark.parametrize("K, k_split", [(128, 64), (640, 320), (256, 128)])
def test_pack_split_rows_is_the_split_layout(K, k_split):
    """`pack_split_rows` lays out pack_rows' bytes for a K split: the same values, zeros in the
    gap, and the GEMM on it equal to the one on the test's own layout (random bytes in the gap)."""
    g = torch.Generator().manual_seed(K)
    a = (torch.randn(40, K, generator=g) * 3).to(BF16)
    rows = pack_split_rows(a, k_split)
    assert rows.shape == (40, hq_row_bytes(split_a_cols(K, k_split)))
    assert torch.equal(packed_of(rows, K, k_split), pack_rows(a))
    KA = split_a_cols(K, k_split)
    gap = KA - K
    assert (
        not rows[:, k_split : k_split + gap].any()
        and not rows[:, KA + k_split // 32 : KA + (k_split + gap) // 32].any()
    )
    _, offs, bs = make([25, 15], 128, K, k_split, seed=1)
    ours = split_layout(pack_rows(a), K, k_split, g)
    assert torch.equal(call(rows, K, offs, bs), call(ours, K, offs, bs))
    with pytest.raises(ValueError, match="k_split must be a multiple of 32"):
        pack_split_rows(a, 48)


def test_cpu_rows_outside_segments_untouched_and_bad_offsets_raise():
    rows, _, bs = make([20, 30], 64, 64, 0, seed=6)
    out = torch.full((50, 64), 7.0, dtype=BF16)
    call(rows, 64, torch.tensor([5, 20, 45]), bs, out=out)
    assert bool((out[:5] == 7).all()) and bool((out[45:] == 7).all())
    with pytest.raises(ValueError, match="non-decreasing"):
        call(rows, 64, torch.tensor([0, 30, 20]), bs)


def test_bad_arguments_raise_naming_them():
    rows, offs, bs = make([3, 4], 64, 256, 128)
    with pytest.raises(ValueError, match=r"must add up to k"):
        call(rows, 192, offs, bs)
    with pytest.raises(ValueError, match=r"b's K \(128\) must equal k"):
        mxfp8_grouped_gemm(rows, 256, offs, bs[0])
    with pytest.raises(ValueError, match="k must be a positive multiple of 32"):
        call(rows, 250, offs, bs)
    with pytest.raises(TypeError, match="out_dtype"):
        call(rows, 256, offs, bs, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="b must be a"):
        mxfp8_grouped_gemm(rows, 256, offs, bs[0][0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"b2\[0\] \(data\) must have shape"):
        mxfp8_grouped_gemm(rows, 256, offs, bs[0], (bs[1][0][:, :32], bs[1][1]))
    with pytest.raises(ValueError, match="offsets must have shape"):
        call(rows, 256, offs[:2], bs)
    with pytest.raises(ValueError, match="bytes per row, fewer than"):
        call(rows[:, :100].contiguous(), 256, offs, bs)
    with pytest.raises(ValueError, match="num_sms"):
        call(rows, 256, offs, bs, num_sms=-1)
    with pytest.raises(ValueError, match="no normal copy"):
        mxfp8_quantize(torch.ones(2, 32, 64), normal=False).operand()
    with pytest.raises(ValueError, match="out must have shape"):
        call(rows, 256, offs, bs, out=torch.zeros(7, 32, dtype=BF16))


@pytest.mark.parametrize(
    "N, K, k_split, match",
    [(96, 128, 0, "n and k must be multiples of 64"), (128, 384, 160, "k_split must be a multiple of 64")],
)
def test_cuda_limits_raise_before_any_launch(N, K, k_split, match):
    """The GPU's limits are checked by the entry point before it touches the device."""
    rows, offs, bs = make([4], N, K, k_split)
    ptrs = [t.data_ptr() for b in bs for t in b] + ([0, 0] if len(bs) == 1 else [])
    out = torch.zeros(4, N, dtype=BF16)
    with pytest.raises(ValueError, match=match):
        mok_mxfp8.grouped_gemm(
            "cuda", rows.data_ptr(), 0, offs.data_ptr(), *ptrs, k_split, out.data_ptr(), False, 4, N, K, 1
        )


# ------------------------------------------------------------------ CUDA


def to_cuda(rows, offs, bs):
    return rows.cuda(), offs.cuda(), [(d.cuda(), s.cuda()) for d, s in bs]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, N, K, k_split", CASES)
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_against_float64(lengths, N, K, k_split, out_dtype):
    rows, offs, bs = make(lengths, N, K, k_split, seed=N + K)
    r, o, b = to_cuda(rows, offs, bs)
    got = call(r, K, o, b, out_dtype=out_dtype)
    want, scale = f64(rows, offs, bs, K, k_split)
    assert_close(got.cpu(), want, scale, out_dtype == torch.float32, "out")
    cpu = call(rows, K, offs, bs, out_dtype=torch.float32)
    if cpu.numel():
        rel = ((got.cpu().float() - cpu).norm() / cpu.norm().clamp_min(1e-30)).item()
        assert rel < 4e-3, f"relative error {rel:.2e} against the CPU's reference arithmetic"


@pytest.mark.gpu
@needs_gpu
def test_cuda_bitwise_run_to_run_any_grid_and_split_is_one_weight():
    K = 512
    r, o, b = to_cuda(*make([700, 5, 0, 333, 64], 256, K, 256, seed=5))
    first = call(r, K, o, b, out_dtype=torch.float32)
    for num_sms in (0, 1, 3, 17):
        assert torch.equal(first, call(r, K, o, b, out_dtype=torch.float32, num_sms=num_sms)), f"num_sms={num_sms}"
    assert torch.equal(first, call(r, K, o, [concatenated(b)], out_dtype=torch.float32)), "K split vs one weight"
    assert torch.equal(call(r, K, o, b), first.to(BF16)), "bf16 out must be the fp32 sums rounded"
    # A split off the stages (A's second part from 320 on): the same blocks in the same order
    rows, offs, bs = make([700, 5, 0, 333, 64], 256, K, 192, seed=5)
    r2, o2, b2 = to_cuda(rows, offs, bs)
    whole = split_layout(packed_of(rows, K, 192), K, 0, torch.Generator()).cuda()
    one = call(whole, K, o2, [concatenated(b2)], out_dtype=torch.float32)
    assert torch.equal(call(r2, K, o2, b2, out_dtype=torch.float32), one), "K split at 192 vs one weight"


@pytest.mark.gpu
@needs_gpu
def test_cuda_batch_invariant_split_invariant_and_rows_outside_untouched():
    """A row's bits do not depend on where it sits, on the other rows, or on the calls."""
    K, lengths = 256, [300, 41, 129]
    rows, offs, bs = to_cuda(*make(lengths, 192, K, 0, seed=9))
    whole = call(rows, K, offs, bs)
    pad = torch.randint(0, 255, (37, rows.shape[1]), dtype=torch.uint8, device="cuda")
    shifted = call(torch.cat([pad, rows]), K, offs + 37, bs)
    assert torch.equal(whole, shifted[37:])
    assert bool((shifted[:37] == 0).all()), "rows before the first segment must not be written"
    first = call(rows[:77].contiguous(), K, torch.tensor([0, 77, 77, 77], device="cuda"), bs)
    rest = call(rows[77:].contiguous(), K, offs - 77 + torch.tensor([77, 0, 0, 0], device="cuda"), bs)
    assert torch.equal(whole[:77], first) and torch.equal(whole[77:], rest)
    r, e = 320, 1  # a row of expert 1, alone
    alone = torch.tensor([0] * (e + 1) + [1] * (len(lengths) - e), device="cuda")
    assert torch.equal(whole[r : r + 1], call(rows[r : r + 1].contiguous(), K, alone, bs))


# ------------------------------------------------------------------ weight gradients
#
# out_e [R, C] = carry_e + sum over segment e's 32-row blocks of Q_rows(A)^T Q_rows(B), from the
# transposed copies quantized along the rows (`grouped_wgrad`).

WGRAD_CASES = [
    pytest.param([64, 0, 96, 32], 128, 192, id="mixed"),
    pytest.param([32], 64, 64, id="one-block"),
    pytest.param([0, 0], 64, 128, id="all-empty"),
    pytest.param([1024, 32, 0, 160], 256, 384, id="long-skewed"),
    pytest.param([544], 320, 192, id="partial-tiles"),
]


def rows_copy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, R]'s transposed copy quantized along the rows: (E4M3 [R, M], E8M0 [M/32, R])."""
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], 0, dtype=torch.uint8), torch.zeros(0, x.shape[1], dtype=torch.uint8)
    return mxfp8_quantize(x, normal=False).operand(transposed=True)


def make_wgrad(lengths: list[int], R: int, C: int, seed: int = 0) -> tuple:
    """A [M, R] and B [M, C] (bf16), their transposed row copies, the offsets and a carry."""
    g = torch.Generator().manual_seed(seed)
    M = sum(lengths)
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    A = (torch.randn(M, R, generator=g) * 2).to(BF16)
    B = torch.randn(M, C, generator=g).to(BF16)
    carry = torch.randn(len(lengths), R, C, generator=g) * 4
    return A, B, rows_copy(A), rows_copy(B), offsets, carry


def rows_values(t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """float64 [R, M] of a transposed row copy."""
    data, scales = t
    values = data.view(torch.float8_e4m3fn).double()
    return values * scales.view(torch.float8_e8m0fnu).double().T.repeat_interleave(32, dim=1)


def f64_wgrad(a_t, b_t, offsets, carry) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = rows_values(a_t), rows_values(b_t)
    El, R, C = len(offsets) - 1, a.shape[0], b.shape[0]
    out = torch.zeros(El, R, C, dtype=torch.float64) if carry is None else carry.double().clone()
    scale = out.abs().clone()
    for e in range(El):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[e] += a[:, lo:hi] @ b[:, lo:hi].T
        scale[e] += a[:, lo:hi].abs() @ b[:, lo:hi].abs().T
    return out, scale


def wgrad(a_t, b_t, offsets, **kw) -> torch.Tensor:
    from mok_torch.backends.native.mxfp8_grouped import mxfp8_grouped_wgrad

    return mxfp8_grouped_wgrad(a_t, b_t, offsets, **kw)


def split_wgrad(A, B, offsets, s: int, device: str, **kw) -> torch.Tensor:
    """Rows [0, s) then [s, M) in two calls, the fp32 sums carried (s a multiple of 32)."""
    first_offs, rest_offs = offsets.clamp(max=s), (offsets - s).clamp(min=0)
    mv = lambda t: tuple(x.to(device) for x in t)  # noqa: E731
    acc = wgrad(mv(rows_copy(A[:s])), mv(rows_copy(B[:s])), first_offs.to(device), out_dtype=torch.float32, **kw)
    return wgrad(mv(rows_copy(A[s:])), mv(rows_copy(B[s:])), rest_offs.to(device), carry=acc, out=acc,
                 out_dtype=torch.float32, **kw)  # fmt: skip


@pytest.mark.parametrize("lengths, R, C", WGRAD_CASES)
@pytest.mark.parametrize("with_carry", [False, True], ids=["from-zero", "carry"])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_cpu_wgrad_against_float64(lengths, R, C, with_carry, out_dtype):
    _, _, a_t, b_t, offs, carry = make_wgrad(lengths, R, C, seed=R + C)
    got = wgrad(a_t, b_t, offs, carry=carry if with_carry else None, out_dtype=out_dtype)
    want, scale = f64_wgrad(a_t, b_t, offs, carry if with_carry else None)
    assert got.dtype == out_dtype and got.shape == (len(lengths), R, C)
    assert_close(got, want, scale, out_dtype == torch.float32, "out")


def test_cpu_wgrad_split_carries_the_bits_of_one_call_and_bf16_rounds_fp32():
    A, B, a_t, b_t, offs, _ = make_wgrad([96, 64, 160], 128, 64, seed=3)
    one = wgrad(a_t, b_t, offs, out_dtype=torch.float32)
    for s in (32, 96, 128, 224):  # inside a segment and at a segment boundary
        assert torch.equal(one, split_wgrad(A, B, offs, s, "cpu")), f"split at {s}"
    assert torch.equal(wgrad(a_t, b_t, offs), one.to(BF16))


def test_wgrad_bad_arguments_raise_naming_them():
    _, _, a_t, b_t, offs, carry = make_wgrad([32, 64], 64, 128)
    with pytest.raises(ValueError, match="offsets must be multiples of 32"):
        wgrad(a_t, b_t, torch.tensor([0, 40, 96]))
    with pytest.raises(ValueError, match=r"b_t\[0\] \(data\) must have shape"):
        wgrad(a_t, (b_t[0][:, :64], b_t[1]), offs)
    with pytest.raises(ValueError, match="carry must have shape"):
        wgrad(a_t, b_t, offs, carry=carry[:1])
    with pytest.raises(TypeError, match="out_dtype"):
        wgrad(a_t, b_t, offs, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="a_t must be a"):
        wgrad(a_t[0], b_t, offs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offsets must have shape"):
        wgrad(a_t, b_t, torch.tensor([0]))
    with pytest.raises(ValueError, match="r must be a positive multiple of 64"):
        _, _, a2, b2, o2, _ = make_wgrad([32], 96, 64)
        wgrad(a2, b2, o2)


# ------------------------------------------------------------------ weight gradients, CUDA


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("lengths, R, C", WGRAD_CASES)
@pytest.mark.parametrize("with_carry", [False, True], ids=["from-zero", "carry"])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_wgrad_against_float64(lengths, R, C, with_carry, out_dtype):
    _, _, a_t, b_t, offs, carry = make_wgrad(lengths, R, C, seed=R + C)
    cu = lambda t: tuple(x.cuda() for x in t)  # noqa: E731
    got = wgrad(cu(a_t), cu(b_t), offs.cuda(), carry=carry.cuda() if with_carry else None, out_dtype=out_dtype)
    want, scale = f64_wgrad(a_t, b_t, offs, carry if with_carry else None)
    assert_close(got.cpu(), want, scale, out_dtype == torch.float32, "out")
    cpu = wgrad(a_t, b_t, offs, carry=carry if with_carry else None, out_dtype=torch.float32)
    rel = ((got.cpu().float() - cpu).norm() / cpu.norm().clamp_min(1e-30)).item()
    assert rel < 4e-3, f"relative error {rel:.2e} against the CPU's reference arithmetic"


@pytest.mark.gpu
@needs_gpu
def test_cuda_wgrad_bitwise_any_grid_split_carry_and_bf16_rounds_fp32():
    A, B, a_t, b_t, offs, carry = make_wgrad([352, 0, 64, 96, 32], 192, 256, seed=8)
    cu = lambda t: tuple(x.cuda() for x in t)  # noqa: E731
    a, b, o = cu(a_t), cu(b_t), offs.cuda()
    one = wgrad(a, b, o, out_dtype=torch.float32)
    for num_sms in (0, 1, 3, 17):
        assert torch.equal(one, wgrad(a, b, o, out_dtype=torch.float32, num_sms=num_sms)), f"num_sms={num_sms}"
    for s in (32, 160, 352, 416):  # inside a segment and at segment boundaries
        assert torch.equal(one, split_wgrad(A, B, offs, s, "cuda")), f"split at {s}"
    assert torch.equal(wgrad(a, b, o), one.to(BF16)), "bf16 out must be the fp32 sums rounded"
    inplace = carry.cuda()
    want = wgrad(a, b, o, carry=carry.cuda(), out_dtype=torch.float32)
    assert torch.equal(want, wgrad(a, b, o, carry=inplace, out=inplace, out_dtype=torch.float32))
    empty = wgrad(*(cu(rows_copy(t[:0])) for t in (A, B)), torch.zeros(6, dtype=torch.int64, device="cuda"),
                  carry=carry.cuda(), out_dtype=torch.float32)  # fmt: skip
    assert torch.equal(empty, carry.cuda()), "no rows: the carry itself"
