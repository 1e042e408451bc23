"""Arithmetic of the reference backend, with one fixed rounding sequence.

The reference backend is the executable statement of the determinism contract, so its
arithmetic must not depend on the device, the vector width, the thread count or the
number of rows in a call:

- every reduction runs sequentially in ascending index order in fp32;
- GEMM operands are bf16 values, so each product is exact in fp32 and only the additions
  round (a fused multiply-add then gives the same bits as a multiply and an add);
- any other product is rounded on its own before it is added (separate torch ops);
- exp is a float64 polynomial built from +, *, / and exponent bits, because libm, SLEEF
  and CUDA exp differ in the last bit, and ATen runs a vector path and a scalar tail.

The price is speed: a GEMM is one elementwise op per step of its reduction. The reference
exists to be right and to be read; the compiled backends are for speed.
"""

from __future__ import annotations

import math

import torch

_INV_LN2 = 1.4426950408889634
# Cody-Waite split of ln 2: n * _LN2_HI is exact for |n| < 2**11.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# Taylor coefficients 1/k! for k = 13..0: |r| <= ln2/2 leaves a truncation error below 1e-17.
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(13, -1, -1)]
# |x| beyond this only under- or overflows float32 results; keeps 2**n a normal float64.
_EXP_CLAMP = 700.0


def exp_f64(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for a float64 tensor, bitwise identical on every device and code path."""
    xc = x.clamp(-_EXP_CLAMP, _EXP_CLAMP)
    n = torch.round(xc * _INV_LN2)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    # 2**n from its exponent bits: integer arithmetic, exact everywhere.
    two_n = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)
    out = p * two_n
    out = torch.where(x > _EXP_CLAMP, torch.full_like(out, float("inf")), out)
    out = torch.where(x < -_EXP_CLAMP, torch.zeros_like(out), out)
    return torch.where(torch.isnan(x), x, out)


def sigmoid(a: torch.Tensor) -> torch.Tensor:
    """sigmoid(a) in float32 for a float32 tensor, computed in float64 and rounded once."""
    a64 = a.to(torch.float64)
    return (1.0 / (1.0 + exp_f64(-a64))).to(torch.float32)


def seq_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b in fp32, reducing over the shared dimension sequentially in ascending order.

    a: [..., M, R], b: [..., R, N], both float32 tensors holding bf16 values.
    out: optional [..., M, N] float32 accumulator to continue from (it is updated in place).
    """
    if out is None:
        out = a.new_zeros(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]))
    for k in range(a.shape[-1]):
        out.addcmul_(a[..., :, k : k + 1], b[..., k : k + 1, :])
    return out


def seq_row_outer_sum(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out += sum_j a[..., j, :]^T b[..., j, :], rows j in ascending order, in place.

    a: [..., L, N], b: [..., L, M] float32 tensors holding bf16 values; out: [..., N, M] fp32.
    This is the weight-gradient reduction: rows are the reduction dimension, and carrying
    `out` across calls continues the same sequence, so splitting the rows anywhere gives the
    same bits as one pass.
    """
    for j in range(a.shape[-2]):
        out.addcmul_(a[..., j, :, None], b[..., j, None, :])
    return out


def seq_sum_last(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension sequentially in ascending order, in fp32."""
    acc = p.new_zeros(p.shape[:-1], dtype=torch.float32)
    for i in range(p.shape[-1]):
        acc = acc + p[..., i]
    return acc


def to_bf16_values(t: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (nearest even) and hold the result in float32 for the GEMM loops."""
    return t.to(torch.bfloat16).to(torch.float32)


def seq_matmul_rows(a_MK: torch.Tensor, w_EKN: torch.Tensor, e_M: torch.Tensor) -> torch.Tensor:
    """Row m times the matrix of its own expert e_M[m], reduced sequentially like seq_matmul.

    a_MK: float32 (bf16 values), w_EKN: float32 (bf16 values), e_M: int64 expert per row.
    The same bits as seq_matmul on the rows of each expert; shapes never depend on the data.
    """
    out = a_MK.new_zeros(a_MK.shape[0], w_EKN.shape[2])
    for k in range(a_MK.shape[1]):
        out.addcmul_(a_MK[:, k : k + 1], w_EKN[:, k, :].index_select(0, e_M))
    return out


def seq_row_outer_sum_rows(
    a_MN: torch.Tensor, b_MP: torch.Tensor, e_M: torch.Tensor, out_ENP: torch.Tensor
) -> torch.Tensor:
    """out[e_M[j]] += a[j]^T b[j] for rows j in ascending order, in place (each expert's rows in order)."""
    for j in range(a_MN.shape[0]):
        out_ENP.index_add_(0, e_M[j : j + 1], a_MN[j : j + 1, :, None] * b_MP[j : j + 1, None, :])
    return out_ENP
