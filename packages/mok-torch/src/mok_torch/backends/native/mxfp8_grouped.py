"""mok-mxfp8's grouped expert forward on tensors: the MXFP8 experts over segments of
consecutive rows (docs/mxfp8.md).

`mxfp8_grouped_forward` checks its tensors, allocates the outputs and calls
`mok_mxfp8.grouped_forward` on the current stream; `mxfp8_grouped_gemm` does the same for one
GEMM in the orientation of the input gradients (`mok_mxfp8.grouped_gemm`). On CUDA (sm_90a) it runs the FP8
tensor-core GEMMs with per-32 scaling (`packages/mok-mxfp8/cuda/sm90/fp8_gemm.cuh`): deterministic
and batch invariant, within a tight tolerance of the reference's bits (the FP8 wgmma's partial
of 32 products is not a sequential fp32 sum). On the CPU it runs the reference arithmetic.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ...mxfp8 import MXFP8Tensor, pack_rows
from ...validation import check_tensor
from .transport import current_stream_handle

BF16 = torch.bfloat16
U8 = torch.uint8


class MxGroupedForward(NamedTuple):
    a: torch.Tensor  # [M, I] bf16: x_q @ Q(Wg)^T
    b: torch.Tensor  # [M, I] bf16: x_q @ Q(Wu)^T
    h: torch.Tensor | None  # [M, I] bf16: silu(a) * b (None without the down projection)
    h_q: torch.Tensor | None  # uint8 [M, hq_row_bytes(I)]: Q_I(h) as MXFP8 rows (I bytes, I/32 scales)
    y: torch.Tensor | None  # [M, H] bf16: Q_I(h) @ Q(Wd)^T


def hq_row_bytes(inner: int) -> int:
    """Bytes per row of h_q: I + I/32 rounded up to 16 (the GPU's copy engine reads 16-byte rows)."""
    return (inner + inner // 32 + 15) // 16 * 16


def split_a_cols(k: int, k_split: int) -> int:
    """Columns of `mxfp8_grouped_gemm`'s A rows with a K split at k_split (0: none): the second
    weight's part starts at k_split rounded up to 128 (the GPU's 128-deep stages), the columns
    between unread."""
    return k if k_split == 0 else (k_split + 127) // 128 * 128 + (k - k_split)


def pack_split_rows(t: torch.Tensor, k_split: int) -> torch.Tensor:
    """t [M, K] (bf16 or fp32) as `mxfp8_grouped_gemm`'s A with a K split at k_split (a multiple
    of 32): uint8 [M, hq_row_bytes(K_A)], the first k_split elements at columns [0, k_split), the
    rest from k_split rounded up to 128 on, then the scales of the K_A = `split_a_cols(K,
    k_split)` columns; zeros in the gap and the padding. The bytes of `pack_rows(t)` (no block
    straddles the split), laid out for the GPU's stages."""
    M, K = t.shape
    if k_split <= 0 or k_split >= K or k_split % 32 or K % 32:
        raise ValueError(f"k_split must be a multiple of 32 in (0, K = {K}), and K of 32; got {k_split}")
    ka = split_a_cols(K, k_split)
    k1 = ka - (K - k_split)  # the second part's first column
    out = torch.zeros(M, hq_row_bytes(ka), dtype=U8, device=t.device)
    first, rest = pack_rows(t[:, :k_split]), pack_rows(t[:, k_split:])
    out[:, :k_split], out[:, k1:ka] = first[:, :k_split], rest[:, : K - k_split]
    out[:, ka : ka + k_split // 32], out[:, ka + k1 // 32 : ka + ka // 32] = first[:, k_split:], rest[:, K - k_split :]
    return out


def _weight(name: str, w: MXFP8Tensor, shape: tuple[int, int, int], dev: torch.device) -> tuple[int, int, int, int]:
    """The (data, scales, data_t, scales_t) addresses of an MXFP8 weight's normal copy (0 for the
    transposed copy's when it has none: the forward does not read them)."""
    if not isinstance(w, MXFP8Tensor):
        raise TypeError(f"{name} must be an MXFP8Tensor (mok.mxfp8_quantize), got {type(w).__name__}")
    if w.data is None or w.scales is None:
        raise ValueError(f"{name} needs its normal copy (mxfp8_quantize(..., normal=True))")
    El, R, C = shape
    data_shape, scales_shape = [("El", El), ("R", R), ("C", C)], [("El", El), ("C/32", C // 32), ("R", R)]
    check_tensor(f"{name}.data", w.data, dtypes=(U8, torch.float8_e4m3fn), shape=data_shape, device=dev)
    check_tensor(f"{name}.scales", w.scales, dtypes=(U8, torch.float8_e8m0fnu), shape=scales_shape, device=dev)
    if not (w.data.is_contiguous() and w.scales.is_contiguous()):
        raise ValueError(f"{name}'s data and scales must be contiguous")
    return (w.data.data_ptr(), w.scales.data_ptr(), 0, 0)


def mxfp8_grouped_forward(
    x_rows: torch.Tensor,
    hidden: int,
    offsets_El1: torch.Tensor,
    w_gate: MXFP8Tensor,
    w_up: MXFP8Tensor,
    w_down: MXFP8Tensor | None,
    limit: float | None = None,
    num_sms: int = 0,
    out: MxGroupedForward | None = None,
) -> MxGroupedForward:
    """The MXFP8 SwiGLU experts on rows [offsets[e], offsets[e+1]) of x for each local expert e.

    x_rows: uint8 [M, row_bytes], each row H E4M3 bytes then H/32 E8M0 scales (`pack_rows`), in
    the first H + H/32 bytes of its row; offsets int64 [El + 1], non-decreasing within [0, M] (on
    CUDA they stay on the device and are clamped there). Weights: mok.mxfp8_quantize's copies of
    Wg, Wu [El, I, H] and Wd [El, H, I] (w_down None: a and b only). Rows outside every segment
    are left as `out` has them (zeros in fresh outputs); `out`'s h and h_q may be None (scratch).
    """
    import mok_mxfp8

    x_rows = check_tensor("x_rows", x_rows, dtypes=(U8,), shape=[("M", None), ("row_bytes", None)])
    dev = x_rows.device
    M, row_bytes = x_rows.shape
    H = hidden
    if not isinstance(H, int) or H <= 0 or H % 32:
        raise ValueError(f"hidden must be a positive multiple of 32, got {H!r}")
    if row_bytes < H + H // 32:
        raise ValueError(f"x_rows has {row_bytes} bytes per row, fewer than hidden + hidden/32 = {H + H // 32}")
    if x_rows.stride(1) != 1:
        raise ValueError("x_rows' bytes must be contiguous within a row")
    if not isinstance(w_gate, MXFP8Tensor):
        raise TypeError(f"w_gate must be an MXFP8Tensor (mok.mxfp8_quantize), got {type(w_gate).__name__}")
    El, I = int(w_gate.shape[0]), int(w_gate.shape[1])
    check_tensor("offsets", offsets_El1, dtypes=(torch.int64,), shape=[("El+1", El + 1)], device=dev)
    gate = _weight("w_gate", w_gate, (El, I, H), dev)
    up = _weight("w_up", w_up, (El, I, H), dev)
    down = (0, 0, 0, 0) if w_down is None else _weight("w_down", w_down, (El, H, I), dev)
    if not isinstance(num_sms, int) or num_sms < 0:
        raise ValueError(f"num_sms must be an int >= 0 (0: every SM), got {num_sms!r}")
    zeros = lambda *shape, dtype=BF16: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
    with_down = w_down is not None
    if out is None:
        out = MxGroupedForward(zeros(M, I), zeros(M, I), None, None, zeros(M, H) if with_down else None)
    if with_down:
        out = out._replace(
            h=zeros(M, I) if out.h is None else out.h,
            h_q=zeros(M, hq_row_bytes(I), dtype=U8) if out.h_q is None else out.h_q,
        )
    rows_I = [("M", M), ("I", I)]
    check_tensor("out.a", out.a, dtypes=(BF16,), shape=rows_I, device=dev)
    check_tensor("out.b", out.b, dtypes=(BF16,), shape=rows_I, device=dev)
    if with_down:
        if out.y is None:
            raise ValueError("out.y must be a tensor when w_down is given")
        check_tensor("out.h", out.h, dtypes=(BF16,), shape=rows_I, device=dev)
        check_tensor("out.h_q", out.h_q, dtypes=(U8,), shape=[("M", M), ("hq_row_bytes", hq_row_bytes(I))], device=dev)
        check_tensor("out.y", out.y, dtypes=(BF16,), shape=[("M", M), ("H", H)], device=dev)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with on_device:
        stream = current_stream_handle(dev) if dev.type == "cuda" else 0
        mok_mxfp8.grouped_forward(
            dev.type, x_rows.data_ptr(), x_rows.stride(0), offsets_El1.data_ptr(), gate, up, down,
            out.a.data_ptr(), out.b.data_ptr(), ptr(out.h), ptr(out.h_q), ptr(out.y),
            M, H, I, El, limit, num_sms, torch.get_num_threads() if dev.type == "cpu" else 1, stream,
        )  # fmt: skip
    return out


def _operand(name: str, b: tuple[torch.Tensor, torch.Tensor], El: int, N: int | None, dev: torch.device) -> tuple:
    """(data, scales, N, K) of a B operand: E4M3 [El, N, K] with E8M0 scales [El, K/32, N]."""
    if not isinstance(b, tuple) or len(b) != 2:
        raise TypeError(f"{name} must be a (data, scales) pair of tensors, got {type(b).__name__}")
    e4m3, e8m0 = (U8, torch.float8_e4m3fn), (U8, torch.float8_e8m0fnu)
    data = check_tensor(f"{name}[0] (data)", b[0], dtypes=e4m3, shape=[("El", El), ("N", N), ("K", None)], device=dev)
    N, K = int(data.shape[1]), int(data.shape[2])
    if K % 32:
        raise ValueError(f"{name}'s K must be a multiple of 32, got {K}")
    scale_shape = [("El", El), ("K/32", K // 32), ("N", N)]
    check_tensor(f"{name}[1] (scales)", b[1], dtypes=e8m0, shape=scale_shape, device=dev)
    return data, b[1], N, K


def mxfp8_grouped_gemm(
    a_rows: torch.Tensor,
    k: int,
    offsets_El1: torch.Tensor,
    b: tuple[torch.Tensor, torch.Tensor],
    b2: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    out_dtype: torch.dtype = BF16,
    num_sms: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[rows of e] = A[rows of e] @ B_e^T for each local expert e, both quantized along K.

    a_rows: uint8 [M, row_bytes], each row K E4M3 bytes then K/32 E8M0 scales (`pack_rows`);
    with b2, the part of b2 starts at column K0 rounded up to 128 instead (`split_a_cols`: K_A
    data bytes, then K_A/32 scales; the gap unread), as `mxfp8_swiglu_backward` writes dx's A.
    offsets int64 [El + 1] as in `mxfp8_grouped_forward`. b: (data [El, N, K0], scales
    [El, K0/32, N]) of a weight quantized along K — `w.operand()` of an MXFP8Tensor of W
    [El, N, K], or `w.operand(transposed=True)` of one of W^T [El, K, N]; b2: a second such weight
    for the rest of K (K = K0 + K1, the blocks of b then b2), as dx = [d_a, d_b] @ [Wg; Wu]
    reads Wg's and Wu's transposed copies. out_dtype bf16 or float32. Rows outside every
    segment are left as `out` has them (zeros in a fresh one).

        g = mxfp8_grouped_gemm(dy_rows, H, offsets, wd.operand(transposed=True), out_dtype=torch.float32)
        dx = mxfp8_grouped_gemm(dab_rows, 2 * I, offsets, wg.operand(True), wu.operand(True))
    """
    import mok_mxfp8

    a_rows = check_tensor("a_rows", a_rows, dtypes=(U8,), shape=[("M", None), ("row_bytes", None)])
    dev = a_rows.device
    M, row_bytes = a_rows.shape
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0 or k % 32:
        raise ValueError(f"k must be a positive multiple of 32, got {k!r}")
    if a_rows.stride(1) != 1:
        raise ValueError("a_rows' bytes must be contiguous within a row")
    if out_dtype not in (BF16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if not isinstance(b, tuple) or len(b) != 2 or not isinstance(b[0], torch.Tensor):
        raise TypeError(f"b must be a (data, scales) pair of tensors, got {type(b).__name__}")
    El = int(b[0].shape[0]) if b[0].dim() == 3 else -1
    d0, s0, N, K0 = _operand("b", b, El, None, dev)
    check_tensor("offsets", offsets_El1, dtypes=(torch.int64,), shape=[("El+1", El + 1)], device=dev)
    d1 = s1 = None
    if b2 is None:
        if K0 != k:
            raise ValueError(f"b's K ({K0}) must equal k ({k}) without b2")
    else:
        d1, s1, _, K1 = _operand("b2", b2, El, N, dev)
        if K0 + K1 != k:
            raise ValueError(f"b's and b2's K ({K0} + {K1}) must add up to k ({k})")
    ka = split_a_cols(k, 0 if b2 is None else K0)
    if row_bytes < ka + ka // 32:
        what = "k + k/32" if b2 is None else "K_A + K_A/32 (K_A = split_a_cols(k, K0))"
        raise ValueError(f"a_rows has {row_bytes} bytes per row, fewer than {what} = {ka + ka // 32}")
    for name, t in (("b[0]", d0), ("b[1]", s0), ("b2[0]", d1), ("b2[1]", s1)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not isinstance(num_sms, int) or num_sms < 0:
        raise ValueError(f"num_sms must be an int >= 0 (0: every SM), got {num_sms!r}")
    if out is None:
        out = torch.zeros(M, N, dtype=out_dtype, device=dev)
    check_tensor("out", out, dtypes=(out_dtype,), shape=[("M", M), ("N", N)], device=dev)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with on_device:
        stream = current_stream_handle(dev) if dev.type == "cuda" else 0
        mok_mxfp8.grouped_gemm(
            dev.type, a_rows.data_ptr(), a_rows.stride(0), offsets_El1.data_ptr(), d0.data_ptr(), s0.data_ptr(),
            ptr(d1), ptr(s1), 0 if b2 is None else K0, out.data_ptr(), out_dtype == torch.float32,
            M, N, k, El, num_sms, torch.get_num_threads() if dev.type == "cpu" else 1, stream,
        )  # fmt: skip
    return out


def _rows_operand(name: str, t: tuple[torch.Tensor, torch.Tensor], M: int | None, dev: torch.device) -> tuple:
    """(data, scales, R, M) of a transposed copy quantized along the rows: E4M3 [R, M] (rows at a
    16-byte multiple stride on CUDA), E8M0 [M/32, R]."""
    if not isinstance(t, tuple) or len(t) != 2 or not isinstance(t[0], torch.Tensor):
        raise TypeError(f"{name} must be a (data, scales) pair of tensors, got {type(t).__name__}")
    e4m3, e8m0 = (U8, torch.float8_e4m3fn), (U8, torch.float8_e8m0fnu)
    rows_M = [("R", None), ("M", M)]
    data = check_tensor(f"{name}[0] (data)", t[0], dtypes=e4m3, shape=rows_M, device=dev, contiguous=False)
    R, M = int(data.shape[0]), int(data.shape[1])
    if data.stride(1) != 1:
        raise ValueError(f"{name}[0] (data) must be contiguous within a row")
    if M % 32:
        raise ValueError(f"{name}'s rows M must be a multiple of 32, got {M}")
    check_tensor(f"{name}[1] (scales)", t[1], dtypes=e8m0, shape=[("M/32", M // 32), ("R", R)], device=dev)
    return data, t[1], R, M


def mxfp8_grouped_wgrad(
    a_t: tuple[torch.Tensor, torch.Tensor],
    b_t: tuple[torch.Tensor, torch.Tensor],
    offsets_El1: torch.Tensor,
    *,
    carry: torch.Tensor | None = None,
    out_dtype: torch.dtype = BF16,
    num_sms: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight gradients of the experts, rows as the reduction, for each local expert e:

        out_e [R, C] = carry_e + sum over the 32-row blocks of segment e of Q_rows(A)^T Q_rows(B)

    a_t, b_t: transposed copies of A [M, R] and B [M, C] quantized along the rows, as
    `mxfp8_quantize(A, normal=False).operand(transposed=True)` makes them: (E4M3 [R, M], E8M0
    [M/32, R]). dWd = Q(w dy)^T Q(h) takes A = bf16(w dy), B = h; d[Wg; Wu] = Q([d_a, d_b])^T
    Q(x) takes A = [d_a, d_b], B = x. offsets int64 [El + 1], non-decreasing, multiples of 32 (on
    CUDA they stay on the device, clamped to [0, M]). carry: fp32 [El, R, C] the sums start from
    (None: +0); out_dtype bf16 or float32 (an fp32 out may be the carry itself: the call then
    accumulates in place). A split of the rows at multiples of 32 into calls that carry the fp32
    sums gives the bits of one call.
    """
    import mok_mxfp8

    if not isinstance(a_t, tuple) or len(a_t) != 2 or not isinstance(a_t[0], torch.Tensor):
        raise TypeError(f"a_t must be a (data, scales) pair of tensors, got {type(a_t).__name__}")
    dev = a_t[0].device
    ad, as_, R, M = _rows_operand("a_t", a_t, None, dev)
    bd, bs, C, _ = _rows_operand("b_t", b_t, M, dev)
    if offsets_El1.dim() != 1 or offsets_El1.shape[0] < 2:
        raise ValueError(f"offsets must have shape [El + 1] with El >= 1, got {list(offsets_El1.shape)}")
    El = int(offsets_El1.shape[0]) - 1
    check_tensor("offsets", offsets_El1, dtypes=(torch.int64,), shape=[("El+1", El + 1)], device=dev)
    if out_dtype not in (BF16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if not isinstance(num_sms, int) or num_sms < 0:
        raise ValueError(f"num_sms must be an int >= 0 (0: every SM), got {num_sms!r}")
    shape = [("El", El), ("R", R), ("C", C)]
    if carry is not None:
        check_tensor("carry", carry, dtypes=(torch.float32,), shape=shape, device=dev)
    if out is None:
        out = torch.empty(El, R, C, dtype=out_dtype, device=dev)
    check_tensor("out", out, dtypes=(out_dtype,), shape=shape, device=dev)
    fp32 = out_dtype == torch.float32
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with on_device:
        stream = current_stream_handle(dev) if dev.type == "cuda" else 0
        mok_mxfp8.grouped_wgrad(
            dev.type, ad.data_ptr(), as_.data_ptr(), ad.stride(0) if M else 0, bd.data_ptr(), bs.data_ptr(),
            bd.stride(0) if M else 0,
            offsets_El1.data_ptr(), ptr(carry), out.data_ptr() if fp32 else 0, 0 if fp32 else out.data_ptr(),
            M, R, C, El, num_sms, torch.get_num_threads() if dev.type == "cpu" else 1, stream,
        )  # fmt: skip
    return out


class MxSwigluBackward(NamedTuple):
    d_w: torch.Tensor  # [M] fp32: <g, h>, summed in ascending order
    dab_rows: torch.Tensor  # uint8 [M, hq_row_bytes(K_A)]: Q_2I([d_a, d_b]), dx's A (split_a_cols(2I, I))
    da_t: tuple[torch.Tensor, torch.Tensor]  # d_a along the rows: E4M3 [I, M], E8M0 [M/32, I]
    db_t: tuple[torch.Tensor, torch.Tensor]  # d_b along the rows: [I, M], [M/32, I]
    h_t: tuple[torch.Tensor, torch.Tensor]  # h along the rows: [I, M], [M/32, I]
    x_t: tuple[torch.Tensor, torch.Tensor]  # bf16(x) along the rows: [H, M], [M/32, H]
    wdy_t: tuple[torch.Tensor, torch.Tensor]  # bf16(w dy) along the rows: [H, M], [M/32, H]


def _mx_rows_arg(name: str, t: torch.Tensor, M: int, cols: int, dev: torch.device) -> torch.Tensor:
    t = check_tensor(name, t, dtypes=(U8,), shape=[("M", M), ("row_bytes", None)], device=dev, contiguous=False)
    if t.shape[1] < cols + cols // 32:
        raise ValueError(f"{name} has {t.shape[1]} bytes per row, fewer than H + H/32 = {cols + cols // 32}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}'s bytes must be contiguous within a row")
    return t


def mxfp8_swiglu_backward(
    g: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    router_weights: torch.Tensor | None,
    x_rows: torch.Tensor,
    dy_rows: torch.Tensor,
    hidden: int,
    limit: float | None = None,
) -> MxSwigluBackward:
    """The MXFP8 backward's element pass between its GEMMs (`mok_mxfp8.grouped_swiglu_backward`),
    on M rows (a multiple of 32):

        h, d_a, d_b, d_w = the SwiGLU backward of g (fp32 [M, I], dy_q @ Q(Wd), unweighted), a, b
        (bf16 [M, I]) and the router weights w (fp32 [M], None: all ones)
        dab_rows = Q_2I([d_a, d_b])                  the input gradients' A (MXFP8 rows, d_b from
                                                      column I rounded up to 128: `split_a_cols`)
        da_t, db_t, h_t, x_t, wdy_t                   d_a, d_b, h, bf16(x), bf16(w dy) quantized
                                                      along the rows: the weight gradients' operands

    x_rows, dy_rows: uint8 MXFP8 rows [M, >= H + H/32] (H bytes then H/32 scales). The bits are
    those of `swiglu_backward_rows`, `pack_rows` and `mxfp8_quantize(..., normal=False)` (a computed
    NaN's sign aside), on the CPU and the GPU alike. H and I multiples of 64.
    """
    import mok_mxfp8

    g = check_tensor("g", g, dtypes=(torch.float32,), shape=[("M", None), ("I", None)])
    dev, (M, I) = g.device, g.shape
    H = hidden
    if M % 32:
        raise ValueError(f"g's rows M must be a multiple of 32, got {M}")
    a = check_tensor("a", a, dtypes=(BF16,), shape=[("M", M), ("I", I)], device=dev)
    b = check_tensor("b", b, dtypes=(BF16,), shape=[("M", M), ("I", I)], device=dev)
    if router_weights is not None:
        router_weights = check_tensor(
            "router_weights", router_weights, dtypes=(torch.float32,), shape=[("M", M)], device=dev
        )
    if not isinstance(H, int) or isinstance(H, bool) or H <= 0 or H % 64:
        raise ValueError(f"hidden must be a positive multiple of 64, got {H!r}")
    x_rows = _mx_rows_arg("x_rows", x_rows, M, H, dev)
    dy_rows = _mx_rows_arg("dy_rows", dy_rows, M, H, dev)

    def rows_copy(C: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(C, M, dtype=U8, device=dev), torch.empty(M // 32, C, dtype=U8, device=dev)

    d_w = torch.empty(M, dtype=torch.float32, device=dev)
    dab_rows = torch.zeros(M, hq_row_bytes(split_a_cols(2 * I, I)), dtype=U8, device=dev)
    h_t, x_t, wdy_t = rows_copy(I), rows_copy(H), rows_copy(H)
    dab_t = torch.empty(2 * I, M, dtype=U8, device=dev), torch.empty(2, M // 32, I, dtype=U8, device=dev)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with on_device:
        stream = current_stream_handle(dev) if dev.type == "cuda" else 0
        mok_mxfp8.grouped_swiglu_backward(
            dev.type, g.data_ptr(), a.data_ptr(), b.data_ptr(), ptr(router_weights), x_rows.data_ptr(),
            x_rows.stride(0), dy_rows.data_ptr(), dy_rows.stride(0), d_w.data_ptr(), dab_rows.data_ptr(),
            dab_rows.stride(0), dab_t[0].data_ptr(), dab_t[1].data_ptr(), h_t[0].data_ptr(), h_t[1].data_ptr(),
            x_t[0].data_ptr(), x_t[1].data_ptr(), wdy_t[0].data_ptr(), wdy_t[1].data_ptr(), M, H, I, limit,
            torch.get_num_threads() if dev.type == "cpu" else 1, stream,
        )  # fmt: skip
    view = lambda t: (t[0].view(torch.float8_e4m3fn), t[1].view(torch.float8_e8m0fnu))  # noqa: E731
    da_t, db_t = (dab_t[0][:I], dab_t[1][0]), (dab_t[0][I:], dab_t[1][1])
    return MxSwigluBackward(d_w, dab_rows, view(da_t), view(db_t), view(h_t), view(x_t), view(wdy_t))
