"""mok-mxfp8's element pass of the MXFP8 backward (`grouped_swiglu_backward`): everything between
the backward's GEMMs in one call.

From g (fp32, dy_q @ Q(Wd)), the pre-activations a, b, the router weights and the dispatched MXFP8
rows x and dy, it makes h, d_a, d_b and d_w, dx's operand Q_2I([d_a, d_b]) as MXFP8 rows, and the
weight gradients' four operands quantized along the rows. Every byte is checked against the
PyTorch composition the layer used before (the reference's `swiglu_backward_rows`, the pure-PyTorch
quantizer), d_w included (the reference's sequential sum). CPU always; CUDA (skipped, with the reason,
without a GPU): the same checks, and the GPU's bytes equal to the CPU's.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import pytest
import torch

from mok_torch.backends.native.mxfp8_grouped import hq_row_bytes, mxfp8_swiglu_backward, split_a_cols
from mok_torch.mxfp8 import mxfp8_quantize, pack_rows, unpack_rows
from mok_torch.spec.arith import to_bf16_values
from mok_torch.spec.experts import swiglu_backward_rows

mok_mxfp8 = pytest.importorskip("mok_mxfp8", reason="mok-mxfp8 is not installed")
if not hasattr(mok_mxfp8, "grouped_swiglu_backward"):
    pytest.skip("the installed mok-mxfp8 has no grouped_swiglu_backward", allow_module_level=True)

BF16 = torch.bfloat16
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]
COPIES = ("da_t", "db_t", "h_t", "x_t", "wdy_t")

# (M, H, I, limit, weighted)
CASES = [
    pytest.param(32, 64, 64, None, True, id="one-block"),
    pytest.param(96, 128, 192, None, True, id="three-blocks"),
    pytest.param(64, 320, 128, 7.0, True, id="clamp"),
    pytest.param(32, 64, 128, None, False, id="unweighted"),
    pytest.param(0, 64, 64, None, True, id="no-rows"),
]


def make(M: int, H: int, I: int, seed: int = 0) -> tuple:
    """g, a, b, w and MXFP8 rows x, dy in 16-byte rows wider than packed (as the layer's tables
    hold them), on the CPU, with awkward values: padding rows of zeros, a pre-activation exactly
    at and beyond the clamp, a large g, tiny dy values."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(M, I, generator=gen) * 0.5
    a = (torch.randn(M, I, generator=gen) * 4).to(BF16)
    b = (torch.randn(M, I, generator=gen) * 4).to(BF16)
    w = torch.rand(M, generator=gen)
    x = torch.randn(M, H, generator=gen).to(BF16)
    dy = (torch.randn(M, H, generator=gen) * 1e-3).to(BF16)
    if M:
        a[0, :4] = torch.tensor([7.0, 8.0, -7.0, 0.0])
        b[0, :4] = torch.tensor([-7.0, 9.0, 7.5, 0.0])
        g[1, 5] = 3e4
        dy[2, :32] = 1e-30  # a block near the bottom of the scales
        for t in (g, a, b, x, dy):
            t[M - 1] = 0  # a padding row
        w[M - 1] = 0
    width = hq_row_bytes(H) + 16
    x_rows = torch.zeros(M, width, dtype=torch.uint8)
    dy_rows = torch.zeros(M, width, dtype=torch.uint8)
    x_rows[:, : H + H // 32] = pack_rows(x)
    dy_rows[:, : H + H // 32] = pack_rows(dy)
    return g, a, b, w, x_rows, dy_rows


def split_dab(packed: torch.Tensor, I: int) -> torch.Tensor:
    """`pack_rows([d_a, d_b])` in `mxfp8_grouped_gemm`'s split A layout (k_split = I: d_b from I
    rounded up to 128 on), zeros in the gap and the 16-byte padding, as the pass leaves them."""
    KA = split_a_cols(2 * I, I)
    I1, b = KA - I, I // 32
    out = torch.zeros(packed.shape[0], hq_row_bytes(KA), dtype=torch.uint8)
    out[:, :I], out[:, I1:KA] = packed[:, :I], packed[:, I : 2 * I]
    out[:, KA : KA + b], out[:, KA + I1 // 32 : KA + I1 // 32 + b] = (
        packed[:, 2 * I : 2 * I + b],
        packed[:, 2 * I + b :],
    )
    return out


def rows_copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, C] quantized along the rows by the pure-PyTorch quantizer, as uint8 (data, scales)."""
    q = mxfp8_quantize(t, normal=False, compiled=False)
    assert q.data_t is not None and q.scales_t is not None
    return q.data_t.view(torch.uint8), q.scales_t.view(torch.uint8)


def expected(g, a, b, w, x_rows, dy_rows, H: int, limit: float | None, weighted: bool) -> dict[str, torch.Tensor]:
    h, d_w, d_ab = swiglu_backward_rows(g, a, b, w if weighted else None, limit)
    x_values = unpack_rows(x_rows[:, : H + H // 32], H)
    dy_values = unpack_rows(dy_rows[:, : H + H // 32], H)
    wdy = to_bf16_values(w[:, None] * dy_values) if weighted else dy_values
    out = {"d_w": d_w, "dab_rows": split_dab(pack_rows(d_ab), h.shape[1])}
    I = h.shape[1]
    copies = {"da_t": d_ab[:, :I], "db_t": d_ab[:, I:], "h_t": h, "x_t": x_values.to(BF16), "wdy_t": wdy.to(BF16)}
    for name, t in copies.items():
        out[name], out[name + "_scales"] = rows_copy(t)
    return out


def run(device: str, g, a, b, w, x_rows, dy_rows, H, limit, weighted) -> dict[str, torch.Tensor]:
    dev = torch.device(device)
    out = mxfp8_swiglu_backward(
        g.to(dev), a.to(dev), b.to(dev), w.to(dev) if weighted else None, x_rows.to(dev), dy_rows.to(dev), H, limit
    )
    got = {"d_w": out.d_w.cpu(), "dab_rows": out.dab_rows.cpu()}
    assert out.db_t[0].data_ptr() == out.da_t[0].data_ptr() + out.da_t[0].numel(), "one [2I, M] array"
    for name in COPIES:
        data, scales = getattr(out, name)
        got[name], got[name + "_scales"] = data.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu()
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("M", "H", "I", "limit", "weighted"), CASES)
def test_bytes_of_the_pytorch_composition(device: str, M: int, H: int, I: int, limit, weighted: bool) -> None:
    inputs = make(M, H, I)
    want = expected(*inputs, H, limit, weighted)
    got = run(device, *inputs, H, limit, weighted)
    assert torch.equal(got["dab_rows"], want["dab_rows"]), "dx's operand Q_2I([d_a, d_b]), split layout"
    for name in COPIES:
        assert torch.equal(got[name], want[name]), f"{name}: E4M3 bytes"
        assert torch.equal(got[name + "_scales"], want[name + "_scales"]), f"{name}: scales"
    assert torch.equal(got["d_w"].view(torch.int32), want["d_w"].view(torch.int32)), "d_w"


@needs_gpu
@pytest.mark.parametrize(("M", "H", "I", "limit", "weighted"), CASES[:4])
def test_gpu_bytes_equal_the_cpu_bytes(M: int, H: int, I: int, limit, weighted: bool) -> None:
    inputs = make(M, H, I, seed=3)
    cpu = run("cpu", *inputs, H, limit, weighted)
    gpu = run("cuda", *inputs, H, limit, weighted)
    for name, t in cpu.items():
        assert torch.equal(gpu[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("device", DEVICES)
def test_nans_poison_their_blocks_only(device: str) -> None:
    M, H, I = 64, 64, 64
    g, a, b, w, x_rows, dy_rows = make(M, H, I, seed=5)
    g[3, 10] = float("nan")
    x_rows[40, H] = 0xFF  # x's first block of row 40: the NaN scale
    want = expected(g, a, b, w, x_rows, dy_rows, H, None, True)
    got = run(device, g, a, b, w, x_rows, dy_rows, H, None, True)
    # A computed NaN's sign is the arithmetic's (the GPU's NaNs are positive): E4M3 bytes 0x7F and
    # 0xFF both mean NaN, compared as one.
    nan_free = lambda t: torch.where(t & 0x7F == 0x7F, 0x7F, t)  # noqa: E731
    assert torch.equal(nan_free(got["dab_rows"]), nan_free(want["dab_rows"]))
    for name in ("da_t", "db_t", "x_t", "wdy_t"):
        assert torch.equal(nan_free(got[name]), nan_free(want[name])), name
        assert torch.equal(got[name + "_scales"], want[name + "_scales"]), name
    assert torch.isnan(got["d_w"][3]) and not torch.isnan(got["d_w"][torch.arange(M) != 3]).any()
    assert got["x_t_scales"][1, :32].eq(0xFF).all() and got["x_t_scales"][1, 32:].ne(0xFF).all()


def test_bad_arguments_are_named() -> None:
    g, a, b, w, x_rows, dy_rows = make(64, 64, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_swiglu_backward(g[:40], a[:40], b[:40], w[:40], x_rows[:40], dy_rows[:40], 64)
    with pytest.raises(ValueError, match="hidden"):
        mxfp8_swiglu_backward(g, a, b, w, x_rows, dy_rows, 96)
    with pytest.raises(ValueError, match="inner"):
        mxfp8_swiglu_backward(
            g[:, :32].contiguous(), a[:, :32].contiguous(), b[:, :32].contiguous(), w, x_rows, dy_rows, 64
        )
    with pytest.raises(ValueError, match="x_rows"):
        mxfp8_swiglu_backward(g, a, b, w, x_rows[:, :40], dy_rows, 64)
    with pytest.raises(TypeError, match="g must have dtype"):
        mxfp8_swiglu_backward(g.double(), a, b, w, x_rows, dy_rows, 64)
    with pytest.raises(ValueError, match="router_weights"):
        mxfp8_swiglu_backward(g, a, b, w[:32], x_rows, dy_rows, 64)
