"""MXFP8 quantization (OCP Microscaling): E4M3 elements, one E8M0 scale per 32 elements.

    qw = mok.mxfp8_quantize(w)                  # w [..., R, C] bf16 or fp32
    qw.data      float8_e4m3fn [..., R, C]      blocks of 32 along C (the last dimension)
    qw.scales    float8_e8m0fnu [..., C/32, R]  block-major (see below)
    qw.data_t    float8_e4m3fn [..., C, R]      w transposed, blocks of 32 along R
    qw.scales_t  float8_e8m0fnu [..., R/32, C]
    qw.dequantize(), qw.dequantize(transposed=True)   float32, exact

The rules (one definition, in mok-mxfp8's include/mok/mxfp8/format.h, shared by the CPU and
CUDA quantizers, and restated here for the pure-PyTorch one):
- scale 2^e per block; "rceil" (default): the smallest e with amax <= 448 * 2^e, so nothing
  saturates; "floor" (OCP): e = floor(log2(amax)) - 8, elements above 448 * 2^e saturate.
  e is clamped to [-127, 127]; a block of zeros gets e = -127.
- elements x / 2^e round to nearest, ties to even, saturating at +-448; zeros keep their sign.
- a block holding a NaN or an infinity gets the NaN scale (0xFF) and NaN elements (0x7F with
  the input's sign): it dequantizes to NaN.

Scale layout. Weight scales are stored *block-major*: `scales[..., j, r]` is the scale of
elements `[r, 32j : 32j+32]`. A GEMM tile of rows `[r0, r0+BM)` at K-block `j` reads `BM`
consecutive bytes, so one TMA box `[K-blocks of a stage, BM]` loads a stage's scales (a row-major
layout would give 4-byte rows, below TMA's 16-byte minimum). Activations quantized inside
the layer keep each row's scales with the row instead (see `quantize_rows`), because rows
travel between ranks one at a time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 32
RULES = ("rceil", "floor")
SOURCE_DTYPES = (torch.bfloat16, torch.float32)
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
_NAN_SCALE = 0xFF
_E4M3_NAN = 0x7F
E4M3_MAX = 448.0  # the largest finite E4M3 value


@dataclass(frozen=True, eq=False)  # identity equality: comparing tensors has no single truth value
class MXFP8Tensor:
    """A tensor quantized to MXFP8, as a normal copy, a transposed copy, or both.

    The transposed copy is the quantization of `w.transpose(-2, -1)` (blocks along the
    original rows): backward GEMMs reduce over the other dimension, and a copy quantized
    along it is what they need (a transpose of the normal copy would have its blocks
    along the wrong dimension).
    """

    data: torch.Tensor | None
    scales: torch.Tensor | None
    data_t: torch.Tensor | None
    scales_t: torch.Tensor | None
    rule: str = "rceil"

    @property
    def shape(self) -> torch.Size:
        """The shape of the tensor that was quantized."""
        if self.data is not None:
            return self.data.shape
        assert self.data_t is not None
        return self.data_t.shape[:-2] + (self.data_t.shape[-1], self.data_t.shape[-2])

    @property
    def device(self) -> torch.device:
        t = self.data if self.data is not None else self.data_t
        assert t is not None
        return t.device

    def operand(self, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scales) of the normal copy ([..., R, C], [..., C/32, R]) or the transposed one
        ([..., C, R], [..., R/32, C]): a GEMM operand quantized along its last dimension, as
        `mxfp8_grouped_gemm` takes B."""
        data, scales = (self.data_t, self.scales_t) if transposed else (self.data, self.scales)
        if data is None or scales is None:
            which = "transposed" if transposed else "normal"
            raise ValueError(f"this MXFP8Tensor has no {which} copy (quantize with {which}=True)")
        return data, scales

    def dequantize(self, transposed: bool = False) -> torch.Tensor:
        """The values as float32 (exact): [..., R, C], or [..., C, R] for the transposed copy."""
        data, scales = self.operand(transposed)
        return dequantize_blocks(data, scales.transpose(-2, -1))


def dequantize_blocks(data: torch.Tensor, scales_rowmajor: torch.Tensor) -> torch.Tensor:
    """float32 values of E4M3 `data` [..., C] with row-major E8M0 scales [..., C/32] (exact)."""
    values = data.view(E4M3).float().unflatten(-1, (-1, BLOCK))
    scale = scales_rowmajor.view(E8M0).float()
    return (values * scale[..., None]).flatten(-2)


def quantize_rows_torch(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """The pure-PyTorch quantizer: (uint8 E4M3 [..., C], uint8 E8M0 [..., C/32]) of x [..., C].

    Blocks of 32 along the last dimension; the same bytes as mok-mxfp8's quantizer.
    """
    xf = x.float()
    blocks = xf.unflatten(-1, (-1, BLOCK))
    finite_e = torch.isfinite(blocks)
    finite = finite_e.all(-1)
    amax = torch.where(finite_e, blocks.abs(), torch.zeros_like(blocks)).amax(-1)
    mant, expo = torch.frexp(amax)  # amax = mant * 2^expo, mant in [0.5, 1)
    e = expo.to(torch.int32) - 9  # floor(log2(amax)) - 8
    if rule == "rceil":
        e = torch.where(mant > 0.875, e + 1, e)  # 448 * 2^e = 1.75 * 2^floor(log2 amax) too small
    e = torch.where(amax == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    # 2^-e from its exponent bits (e <= 120 for finite fp32, so 127 - e is a normal exponent).
    inv_scale = ((127 - e) << 23).view(torch.float32)
    # Exact scaling, then saturation by hand: torch's float -> e4m3fn cast saturates on some
    # builds and gives NaN on others (seen on the H200 machines' torch, CPU and CUDA alike).
    # Clamping first is the spec's saturation: anything above 448 rounds to 448 or beyond.
    scaled = (blocks * inv_scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    data = scaled.to(E4M3).view(torch.uint8)  # round to nearest even
    sign = (xf.view(torch.int32) < 0).to(torch.uint8).unflatten(-1, (-1, BLOCK)) << 7
    data = torch.where(finite[..., None], data, sign | _E4M3_NAN)
    scales = torch.where(finite, (e + 127).to(torch.uint8), torch.full_like(e, _NAN_SCALE, dtype=torch.uint8))
    return data.flatten(-2), scales


@functools.cache
def _compiled(device_type: str) -> Any | None:
    """mok_mxfp8 when its quantizer runs on `device_type`, else None."""
    try:
        import mok_mxfp8
    except ImportError:
        return None
    if not hasattr(mok_mxfp8, "quantize") or device_type not in mok_mxfp8.build_info()["backends"]:
        return None
    return mok_mxfp8


def _quantize_compiled(mod: Any, x: torch.Tensor, transposed: bool, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 data [B, rows, cols], uint8 block-major scales [B, cols/32, rows]) by mok_mxfp8.

    x: [B, R, C]; the normal copy quantizes [R, C] along C, the transposed one [C, R] along R.
    """
    B, R, C = x.shape
    rows, cols = (C, R) if transposed else (R, C)
    sb, sr, sc = x.stride()
    row_stride, col_stride = (sc, sr) if transposed else (sr, sc)
    data = torch.empty(B, rows, cols, dtype=torch.uint8, device=x.device)
    scales = torch.empty(B, cols // BLOCK, rows, dtype=torch.uint8, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    mod.quantize(
        x.device.type,
        x.data_ptr(),
        "bf16" if x.dtype == torch.bfloat16 else "fp32",
        B,
        rows,
        cols,
        sb,
        row_stride,
        col_stride,
        data.data_ptr(),
        scales.data_ptr(),
        1,
        rows,
        rule,
        num_threads=max(1, torch.get_num_threads()) if not x.is_cuda else 1,
        stream=stream,
    )
    return data, scales


def _quantize_3d(x: torch.Tensor, transposed: bool, rule: str, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mod = _compiled(x.device.type) if compiled else None
    if mod is not None:
        return _quantize_compiled(mod, x, transposed, rule)
    src = x.transpose(-2, -1) if transposed else x
    data, scales = quantize_rows_torch(src, rule)
    return data.contiguous(), scales.transpose(-2, -1).contiguous()


def _check_rule(rule: object) -> str:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    return rule  # type: ignore[return-value]


def mxfp8_quantize(
    w: torch.Tensor, normal: bool = True, transposed: bool = True, *, rule: str = "rceil", compiled: bool = True
) -> MXFP8Tensor:
    """w [..., R, C] (bf16 or fp32) quantized to MXFP8: a normal copy (blocks along C, R any,
    C a multiple of 32) and/or a transposed copy (blocks along R, a multiple of 32).

    Runs mok-mxfp8's quantizer when it is installed for w's device (`compiled=False` forces the
    pure-PyTorch one; both give the same bytes). Not differentiable: quantize the weights
    once per optimizer step and pass the result to the functional API, or let `moe` /
    `MoELayer` with `precision="mxfp8"` do it.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in SOURCE_DTYPES:
        raise TypeError(f"w must have dtype bfloat16 or float32, got {str(w.dtype).replace('torch.', '')}")
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dims [..., R, C], got shape {list(w.shape)}")
    rule = _check_rule(rule)
    if not (normal or transposed):
        raise ValueError("mxfp8_quantize: ask for normal=True, transposed=True or both")
    R, C = w.shape[-2], w.shape[-1]
    if normal and C % BLOCK:
        raise ValueError(f"w: the last dim C ({C}) must be a multiple of 32 for the normal copy")
    if transposed and R % BLOCK:
        raise ValueError(f"w: dim -2 R ({R}) must be a multiple of 32 for the transposed copy")
    lead = w.shape[:-2]
    x = w.detach().reshape(math.prod(lead), R, C)
    data = scales = data_t = scales_t = None
    if normal:
        d, s = _quantize_3d(x, False, rule, compiled)
        data, scales = d.view(E4M3).reshape(lead + (R, C)), s.view(E8M0).reshape(lead + (C // BLOCK, R))
    if transposed:
        d, s = _quantize_3d(x, True, rule, compiled)
        data_t, scales_t = d.view(E4M3).reshape(lead + (C, R)), s.view(E8M0).reshape(lead + (R // BLOCK, C))
    return MXFP8Tensor(data, scales, data_t, scales_t, rule)


def pack_rows(x: torch.Tensor, compiled: bool = True) -> torch.Tensor:
    """Rows x [N, C] as MXFP8 rows: uint8 [N, C + C/32], C E4M3 bytes then C/32 E8M0 scales.

    The form activations travel in between ranks: a row and its scales move as one unit
    (RCEIL). A zero row of bytes is the value 0 (scale byte 0 is 2^-127). Runs mok-mxfp8's
    quantizer when it is installed for x's device (`compiled=False`: the pure-PyTorch one; both
    give the same bytes).
    """
    mod = _compiled(x.device.type) if compiled and x.dim() == 2 and x.dtype in SOURCE_DTYPES else None
    if mod is None or x.shape[1] % BLOCK:
        data, scales = quantize_rows_torch(x)
        return torch.cat([data, scales], dim=-1)
    (N, C), row = x.shape, x.shape[1] + x.shape[1] // BLOCK
    out = torch.empty(N, row, dtype=torch.uint8, device=x.device)
    if N * C == 0:
        return out
    x = x.contiguous()
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    mod.quantize(
        x.device.type, x.data_ptr(), "bf16" if x.dtype == torch.bfloat16 else "fp32", 1, N, C, 0, C, 1,
        out.data_ptr(), out.data_ptr() + C, row, 1, "rceil",
        num_threads=max(1, torch.get_num_threads()) if not x.is_cuda else 1, stream=stream, data_row_stride=row,
    )  # fmt: skip
    return out


def unpack_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 values [..., C] of MXFP8 rows [..., C + C/32] (exact)."""
    return dequantize_blocks(packed[..., :cols], packed[..., cols:])


def fake_quantize(x: torch.Tensor, dim: int = -1, rule: str = "rceil") -> torch.Tensor:
    """x quantized along `dim` in blocks of 32 and dequantized: float32 values of x's shape.

    The values an MXFP8 GEMM operand holds (pure PyTorch, the reference backend's path).
    """
    moved = x.movedim(dim, -1)
    data, scales = quantize_rows_torch(moved, rule)
    return dequantize_blocks(data, scales).movedim(-1, dim)


__all__ = [
    "BLOCK",
    "MXFP8Tensor",
    "dequantize_blocks",
    "fake_quantize",
    "mxfp8_quantize",
    "pack_rows",
    "quantize_rows_torch",
    "unpack_rows",
]
