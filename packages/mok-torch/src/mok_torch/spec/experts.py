"""The expert math of docs/design.md §2 on groups of row segments, in the reference arithmetic.

Shape letters: docs/design.md §1, and n experts in a chunk, L rows per expert (padded); in a
GEMM's weight `w_EKN`, K is the reduction and N the output columns.
Rows are processed as [n, L, ...] blocks: the rows of each expert in the chunk, padded
with zero rows. A zero row contributes exact zeros to every sum and never lands anywhere,
so the padding cannot change a bit (an fp32 accumulator that starts at +0 never becomes
-0, and adding +-0 to it leaves it unchanged).

MXFP8 (docs/mxfp8.md; `ExpertWeights.block` = 32): every GEMM operand holds MXFP8 values
(E4M3 times a per-32 power-of-two scale, quantized along the GEMM's reduction dimension),
and each reduction is cut into blocks of 32: a block's partial is a sequential fp32 sum
from +0 (the products of MXFP8 values are exact in fp32), and the partials are added in
block order to an accumulator that starts at +0. That is what an FP8 wgmma of K = 32 whose
result is rescaled and added on the CUDA cores computes. Weight-gradient operands are
quantized along rows, in 32-row blocks counted from the expert's segment start (segments
and minibatches start at multiples of the expert alignment, itself a multiple of 32, so
the blocks are the same however the rows are chunked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MoKConfig
from ..mxfp8 import MXFP8Tensor, fake_quantize, mxfp8_quantize
from .arith import (
    seq_matmul,
    seq_matmul_rows,
    seq_row_outer_sum,
    seq_row_outer_sum_rows,
    seq_sum_last,
    sigmoid,
    to_bf16_values,
)

BF16 = torch.bfloat16
MX_BLOCK = 32


class Grouped:
    """Rows as an [n, L] grid, expert i of the group owning row block i (host-planned)."""

    def rows(self, first: int, last: int) -> Grouped:
        """The layout of rows [first, last) of every block."""
        return self

    @staticmethod
    def mm(a: torch.Tensor, w_EKN: torch.Tensor) -> torch.Tensor:
        return seq_matmul(a, w_EKN)

    @staticmethod
    def outer_sum(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return seq_row_outer_sum(a, b, out)


class PerRow:
    """Flat rows [M], each with its own expert: shapes never depend on the routing."""

    def __init__(self, experts_M: torch.Tensor) -> None:
        self.e = experts_M

    def rows(self, first: int, last: int) -> PerRow:
        """The layout of rows [first, last)."""
        return PerRow(self.e[first:last])

    def mm(self, a: torch.Tensor, w_EKN: torch.Tensor) -> torch.Tensor:
        return seq_matmul_rows(a, w_EKN, self.e)

    def outer_sum(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return seq_row_outer_sum_rows(a, b, self.e, out)


Layout = Grouped | PerRow
GROUPED = Grouped()  # the reference's layout: experts' rows as blocks of a grid


@dataclass
class ExpertWeights:
    """The weights of a group of experts, as float32 tensors holding bf16 values.

    gate_up_T_EH2I: [E, H, 2I] (forward gate+up: x @ [Wg; Wu]^T)
    down_T_EIH: [E, I, H] (forward down: h @ Wd^T)
    down_EHI: [E, H, I] (backward: g = dy @ Wd)
    gate_up_E2IH: [E, 2I, H] (backward: dx = [d_a, d_b] @ [Wg; Wu])
    """

    gate_up_T_EH2I: torch.Tensor
    down_T_EIH: torch.Tensor
    down_EHI: torch.Tensor
    gate_up_E2IH: torch.Tensor
    block: int | None = None  # MXFP8: reductions in blocks of 32 over quantized operands

    @property
    def intermediate_size(self) -> int:
        return self.down_EHI.shape[2]

    @staticmethod
    def from_weights(wg_EIH: torch.Tensor, wu_EIH: torch.Tensor, wd_EHI: torch.Tensor) -> ExpertWeights:
        gate_up = torch.cat([wg_EIH, wu_EIH], dim=1).float()
        down = wd_EHI.float()
        return ExpertWeights(
            gate_up_T_EH2I=gate_up.transpose(1, 2).contiguous(),
            down_T_EIH=down.transpose(1, 2).contiguous(),
            down_EHI=down,
            gate_up_E2IH=gate_up,
        )

    @staticmethod
    def from_mxfp8(wg: MXFP8Tensor, wu: MXFP8Tensor, wd: MXFP8Tensor) -> ExpertWeights:
        """The dequantized values of MXFP8 weights, each GEMM's copy quantized along its reduction."""
        gate_up_H = torch.cat([wg.dequantize(), wu.dequantize()], dim=1)  # [E, 2I, H], blocks along H
        gate_up_I = torch.cat([wg.dequantize(transposed=True), wu.dequantize(transposed=True)], dim=2)  # [E, H, 2I]
        return ExpertWeights(
            gate_up_T_EH2I=gate_up_H.transpose(1, 2).contiguous(),
            down_T_EIH=wd.dequantize().transpose(1, 2).contiguous(),  # blocks along I
            down_EHI=wd.dequantize(transposed=True).transpose(1, 2).contiguous(),  # blocks along H
            gate_up_E2IH=gate_up_I.transpose(1, 2).contiguous(),  # blocks along I (gate, then up)
            block=MX_BLOCK,
        )

    def select(self, first: int, last: int) -> ExpertWeights:
        return ExpertWeights(
            self.gate_up_T_EH2I[first:last],
            self.down_T_EIH[first:last],
            self.down_EHI[first:last],
            self.gate_up_E2IH[first:last],
            self.block,
        )

    def operand(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """t as a GEMM operand reduced along `dim`: fp32 values (MXFP8-quantized along `dim`)."""
        if self.block is None:
            return t.float()
        return fake_quantize(_pad_to(t, dim, self.block), dim).narrow(dim, 0, t.shape[dim])

    def mm(self, layout: Layout, a: torch.Tensor, w_EKN: torch.Tensor) -> torch.Tensor:
        """a @ w over the shared dimension, in blocks of `block` for MXFP8."""
        if self.block is None:
            return layout.mm(a, w_EKN)
        acc = None
        for k0 in range(0, a.shape[-1], self.block):
            part = layout.mm(a[..., k0 : k0 + self.block], w_EKN[..., k0 : k0 + self.block, :])
            acc = (torch.zeros_like(part) if acc is None else acc) + part
        assert acc is not None
        return acc

    def outer_sum(self, layout: Layout, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """out += sum over rows of a^T b, MXFP8: operands quantized along rows, 32-row partials."""
        if self.block is None:
            layout.outer_sum(a, b, out)
            return
        # Flat rows (PerRow) are table rows from a multiple of the alignment, so each 32-row
        # block lies in one expert's segment, as in the grouped layout.
        aq, bq = self.operand(a, -2), self.operand(b, -2)
        for r0 in range(0, a.shape[-2], self.block):
            r1 = r0 + self.block
            part = torch.zeros_like(out)
            layout.rows(r0, r1).outer_sum(aq[..., r0:r1, :], bq[..., r0:r1, :], part)
            out.add_(part)


def expert_weights(cfg: MoKConfig, routed: tuple) -> ExpertWeights:
    """The routed experts' GEMM weights; MXFP8 weights may come as bf16 (quantized here) or
    as MXFP8Tensor (the user's, with both copies)."""
    if cfg.precision == "mxfp8":
        q = [r if isinstance(r, MXFP8Tensor) else mxfp8_quantize(r, compiled=False) for r in routed]
        return ExpertWeights.from_mxfp8(*q)
    return ExpertWeights.from_weights(*routed)


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """t with zeros appended along `dim` up to a multiple of `multiple` (zeros change no amax)."""
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def gate_up(x_nLH: torch.Tensor, w: ExpertWeights, layout: Layout = GROUPED) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-activations a = x @ Wg^T, b = x @ Wu^T (bf16)."""
    acc = w.mm(layout, w.operand(x_nLH), w.gate_up_T_EH2I)
    inner = w.intermediate_size
    return acc[..., :inner].to(BF16), acc[..., inner:].to(BF16)


def _clamped(a: torch.Tensor, b: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    af, bf = a.float(), b.float()
    if limit is not None:
        af = af.clamp(max=limit)
        bf = bf.clamp(-limit, limit)
    return af, bf


def swiglu(a: torch.Tensor, b: torch.Tensor, limit: float | None) -> torch.Tensor:
    """h = silu(a) * b (with the optional clamp), rounded to bf16."""
    af, bf = _clamped(a, b, limit)
    return ((af * sigmoid(af)) * bf).to(BF16)


def down(h_nLI: torch.Tensor, w: ExpertWeights, layout: Layout = GROUPED) -> torch.Tensor:
    """Expert output rows h @ Wd^T (bf16)."""
    return w.mm(layout, w.operand(h_nLI), w.down_T_EIH).to(BF16)


@dataclass
class RowGrads:
    h: torch.Tensor  # [n, L, I] bf16, recomputed as in forward
    d_w: torch.Tensor  # [n, L] fp32, router-weight gradient <g, h>
    d_ab: torch.Tensor  # [n, L, 2I] bf16: d_a then d_b
    dx: torch.Tensor  # [n, L, H] bf16: d_a @ Wg + d_b @ Wu


def row_backward(
    x_nLH: torch.Tensor,
    a_nLI: torch.Tensor,
    b_nLI: torch.Tensor,
    dy_nLH: torch.Tensor,
    w_nL: torch.Tensor | None,
    w: ExpertWeights,
    limit: float | None,
    layout: Layout = GROUPED,
) -> RowGrads:
    """Per-row backward of docs/design.md §2 (w_nL None means weight 1: the shared expert)."""
    g = w.mm(layout, w.operand(dy_nLH), w.down_EHI)  # unweighted down-projection input gradient
    h, d_w, d_ab = swiglu_backward_rows(g, a_nLI, b_nLI, w_nL, limit)
    dx = w.mm(layout, w.operand(d_ab), w.gate_up_E2IH).to(BF16)
    return RowGrads(h=h, d_w=d_w, d_ab=d_ab, dx=dx)


def swiglu_backward_rows(
    g: torch.Tensor, a_nLI: torch.Tensor, b_nLI: torch.Tensor, w_nL: torch.Tensor | None, limit: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, d_w, [d_a, d_b]) of rows from g = dy @ Wd (fp32, unweighted), the element math of
    docs/design.md §2: h and d_ab in bf16, d_w = <g, h> summed in order, no division by w."""
    af, bf = _clamped(a_nLI, b_nLI, limit)
    s = sigmoid(af)
    silu = af * s
    h = (silu * bf).to(BF16)
    d_w = seq_sum_last(g * h.float())  # no division by w: exact at w = 0
    d_h = g if w_nL is None else w_nL[..., None] * g
    d_silu = s * (1.0 + af * (1.0 - s))
    d_a = (d_h * bf) * d_silu
    d_b = d_h * silu
    if limit is not None:
        # The clamp passes gradient only where it did not bite.
        d_a = torch.where(a_nLI.float() <= limit, d_a, torch.zeros_like(d_a))
        d_b = torch.where(b_nLI.float().abs() <= limit, d_b, torch.zeros_like(d_b))
    d_ab = torch.cat([d_a, d_b], dim=-1).to(BF16)
    return h, d_w, d_ab


def accumulate_wgrads(
    x_nLH: torch.Tensor,
    dy_nLH: torch.Tensor,
    w_nL: torch.Tensor | None,
    rg: RowGrads,
    d_gate_up_n2IH: torch.Tensor,
    d_down_nHI: torch.Tensor,
    layout: Layout = GROUPED,
    weights: ExpertWeights | None = None,
) -> None:
    """Add this block's rows to the fp32 weight-gradient accumulators, rows in order.

    dWd += (w dy)^T h, d[Wg; Wu] += [d_a, d_b]^T x. `w dy` is rounded to bf16, as the
    kernels feed it to the tensor cores. `weights`: the experts' weights when they are MXFP8 (the
    operands are then quantized along rows and summed in 32-row blocks).
    """
    wdy = dy_nLH.float() if w_nL is None else to_bf16_values(w_nL[..., None] * dy_nLH.float())
    if weights is None or weights.block is None:
        layout.outer_sum(wdy, rg.h.float(), d_down_nHI)
        layout.outer_sum(rg.d_ab.float(), x_nLH.float(), d_gate_up_n2IH)
        return
    weights.outer_sum(layout, wdy, rg.h, d_down_nHI)
    weights.outer_sum(layout, rg.d_ab, x_nLH, d_gate_up_n2IH)


def combine_epilogue(
    base_TH: torch.Tensor | None, rows_TKH: torch.Tensor, weights_TK: torch.Tensor | None
) -> torch.Tensor:
    """base + sum_k w[t,k] * rows[t,k] in fp32, k ascending, rounded to bf16 once.

    Each product is rounded before its add (w is fp32, so w*row is not exact).
    """
    T, K, H = rows_TKH.shape
    acc = torch.zeros(T, H, dtype=torch.float32, device=rows_TKH.device) if base_TH is None else base_TH.float()
    for k in range(K):
        term = rows_TKH[:, k].float()
        if weights_TK is not None:
            term = weights_TK[:, k : k + 1] * term
        acc = acc + term
    return acc.to(BF16)


def wgrad_out(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight gradient handed out: a fresh contiguous tensor in `dtype` (gate and up come
    from one accumulator and must not share storage)."""
    return acc.to(dtype, memory_format=torch.contiguous_format, copy=True)


def routed_wgrads(
    d_gate_up_E2IH: torch.Tensor, d_down_EHI: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dWg, dWu, dWd) from the fp32 accumulators."""
    inner = d_down_EHI.shape[2]
    return (
        wgrad_out(d_gate_up_E2IH[:, :inner], dtype),
        wgrad_out(d_gate_up_E2IH[:, inner:], dtype),
        wgrad_out(d_down_EHI, dtype),
    )


Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _shared_as_expert(shared: Weights3) -> ExpertWeights:
    return ExpertWeights.from_weights(shared[0][None], shared[1][None], shared[2][None])


def shared_forward(
    x_TH: torch.Tensor, shared: Weights3 | None, limit: float | None, *, outputs: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The shared expert on every local token: (y_s [T, H] or None, a_s, b_s [T, Is])."""
    if shared is None:
        return None, None, None
    w = _shared_as_expert(shared)
    a, b = gate_up(x_TH[None], w)
    y = down(swiglu(a, b, limit), w)[0] if outputs else None
    return y, a[0], b[0]


def shared_backward(
    x_TH: torch.Tensor,
    dy_TH: torch.Tensor,
    a_TIs: torch.Tensor | None,
    b_TIs: torch.Tensor | None,
    shared: Weights3 | None,
    limit: float | None,
    wgrad_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, Weights3 | None]:
    """(dx_s [T, H] or None, (dWg_s, dWu_s, dWd_s) or None): tokens are the rows, in order."""
    if shared is None:
        return None, None
    assert a_TIs is not None and b_TIs is not None
    w = _shared_as_expert(shared)
    x1, dy1 = x_TH[None], dy_TH[None]
    rg = row_backward(x1, a_TIs[None], b_TIs[None], dy1, None, w, limit)
    inner, H = w.intermediate_size, x_TH.shape[1]
    d_gate_up = torch.zeros(1, 2 * inner, H, dtype=torch.float32, device=x_TH.device)
    d_down = torch.zeros(1, H, inner, dtype=torch.float32, device=x_TH.device)
    accumulate_wgrads(x1, dy1, None, rg, d_gate_up, d_down)
    dWg, dWu, dWd = routed_wgrads(d_gate_up, d_down, wgrad_dtype)
    return rg.dx[0].contiguous(), (dWg[0], dWu[0], dWd[0])
