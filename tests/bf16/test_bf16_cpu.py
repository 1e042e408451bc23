"""mok-bf16's CPU expert entry points against mok_torch's reference arithmetic, bit for bit.

Shape letters: docs/design.md §1. A row carries its local expert, -1 for a padding row. The
reference sees a padding row as a zero row of some expert (as the schedule's padding rows are);
mok_bf16 is given garbage there, which it must not read.
Everything is compared with torch.equal, except NaN payloads (bf16 and fp32 NaN bits differ
between torch's code paths), where the NaN positions must agree and the rest be equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import mok_bf16
from mok_torch.backends.native import NativeBackend
from mok_torch.spec.arith import exp_f64, sigmoid
from mok_torch.spec.experts import (
    GROUPED,
    ExpertWeights,
    PerRow,
    accumulate_wgrads,
    down,
    gate_up,
    row_backward,
    swiglu,
)

BF16 = torch.bfloat16

# (M, H, I, El, routing, padding fraction)
SHAPES = [
    pytest.param(0, 16, 8, 2, "random", 0.0, id="no-rows"),
    pytest.param(1, 8, 4, 1, "random", 0.0, id="one-row"),
    pytest.param(37, 19, 13, 3, "sorted", 0.2, id="odd-sorted-padding"),
    pytest.param(45, 24, 10, 5, "random", 0.1, id="unsorted-padding"),
    pytest.param(33, 9, 17, 4, "skewed", 0.0, id="skewed"),
    pytest.param(20, 16, 6, 2, "random", 1.0, id="all-padding"),
    pytest.param(29, 1, 1, 2, "sorted", 0.1, id="H1-I1"),
    pytest.param(12, 16, 0, 2, "random", 0.0, id="I0"),
    pytest.param(12, 0, 8, 2, "random", 0.0, id="H0"),
]
LIMITS = [None, 0.7]  # 0.7: not a bf16 value (the clamp returns the fp32 limit itself)


@dataclass
class Case:
    """Rows for mok_bf16 (garbage in padding rows) and the reference's view of them."""

    x: torch.Tensor  # [M, H] bf16
    dy: torch.Tensor  # [M, H] bf16
    w: torch.Tensor  # [M] fp32 router weights
    experts: torch.Tensor  # [M] int64, -1 = padding
    wg: torch.Tensor  # [El, I, H] bf16
    wu: torch.Tensor
    wd: torch.Tensor  # [El, H, I] bf16
    limit: float | None

    @property
    def pad(self) -> torch.Tensor:
        return self.experts < 0

    def zeroed(self, t: torch.Tensor) -> torch.Tensor:
        """t with the padding rows zeroed: what the schedule's pulls give the reference."""
        return torch.where(self.pad.view((-1,) + (1,) * (t.dim() - 1)), torch.zeros_like(t), t)

    @property
    def ref_experts(self) -> torch.Tensor:
        """The reference's expert per row: padding rows belong to some real expert."""
        return torch.where(self.pad, torch.arange(len(self.experts)) % self.wg.shape[0], self.experts)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        El, I, H = self.wg.shape
        return self.x.shape[0], H, I, El


def make_case(
    M: int, H: int, I: int, El: int, routing: str, pad: float, limit: float | None, seed: int, scale: float = 1.0
) -> Case:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(BF16)

    if routing == "skewed":  # most rows to expert 0, one expert with no rows
        experts = torch.where(torch.rand(M, generator=g) < 0.8, 0, torch.randint(0, El - 1, (M,), generator=g))
    else:
        experts = torch.randint(0, El, (M,), generator=g)
    if routing == "sorted":
        experts = experts.sort().values
    experts = torch.where(torch.rand(M, generator=g) < pad, -1, experts).to(torch.int64)
    w = torch.rand(M, generator=g)
    w[torch.rand(M, generator=g) < 0.15] = 0.0  # router weight 0: d_w must still be exact
    return Case(
        x=randn(M, H),
        dy=randn(M, H),
        w=w,
        experts=experts,
        wg=randn(El, I, H, std=scale / max(H, 1) ** 0.5),
        wu=randn(El, I, H, std=scale / max(H, 1) ** 0.5),
        wd=randn(El, H, I, std=1 / max(I, 1) ** 0.5),
        limit=limit,
    )


# ------------------------------------------------------------------ mok_bf16 calls


def ours_forward(c: Case, threads: int = 2, outputs: bool = True) -> tuple[torch.Tensor, ...]:
    M, H, I, El = c.shape
    a = torch.full((M, I), 7.0, dtype=BF16)  # sentinels: every element must be written
    b = torch.full((M, I), 7.0, dtype=BF16)
    y = torch.full((M, H), 7.0, dtype=BF16)
    mok_bf16.swiglu_forward(
        "cpu", c.x.data_ptr(), c.experts.data_ptr(), c.wg.data_ptr(), c.wu.data_ptr(), c.wd.data_ptr(),
        a.data_ptr(), b.data_ptr(), y.data_ptr() if outputs else 0, M, H, I, El, c.limit, threads,
    )  # fmt: skip
    return a, b, y


def ours_backward(
    c: Case,
    a: torch.Tensor,
    b: torch.Tensor,
    threads: int = 2,
    rows: slice = slice(None),
    acc: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    _, H, I, El = c.shape
    x, dy, w, e, a, b = (t[rows].contiguous() for t in (c.x, c.dy, c.w, c.experts, a, b))
    m = x.shape[0]
    dx = torch.full((m, H), 7.0, dtype=BF16)
    d_w = torch.full((m,), 7.0)
    d_gate_up, d_down = acc if acc is not None else (torch.zeros(El, 2 * I, H), torch.zeros(El, H, I))
    mok_bf16.swiglu_backward(
        "cpu", x.data_ptr(), a.data_ptr(), b.data_ptr(), dy.data_ptr(), w.data_ptr(), e.data_ptr(),
        c.wg.data_ptr(), c.wu.data_ptr(), c.wd.data_ptr(), dx.data_ptr(), d_w.data_ptr(), d_gate_up.data_ptr(),
        d_down.data_ptr(), m, H, I, El, c.limit, threads,
    )  # fmt: skip
    return dx, d_w, d_gate_up, d_down


# ------------------------------------------------------------------ the reference


def ref_per_row(c: Case) -> dict[str, torch.Tensor]:
    """The reference on flat rows, each with its expert (PerRow layout)."""
    _, H, I, El = c.shape
    weights = ExpertWeights.from_weights(c.wg, c.wu, c.wd)
    layout = PerRow(c.ref_experts)
    x, dy, w = c.zeroed(c.x), c.zeroed(c.dy), c.zeroed(c.w)
    a, b = gate_up(x, weights, layout)
    y = down(swiglu(a, b, c.limit), weights, layout)
    rg = row_backward(x, a, b, dy, w, weights, c.limit, layout)
    d_gate_up, d_down = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    accumulate_wgrads(x, dy, w, rg, d_gate_up, d_down, layout)
    return dict(a=a, b=b, y=y, dx=rg.dx, d_w=rg.d_w, d_gate_up=d_gate_up, d_down=d_down)


def ref_grouped(c: Case) -> dict[str, torch.Tensor]:
    """The reference on an [El, L] grid of each expert's rows in order (Grouped layout)."""
    M, H, I, El = c.shape
    weights = ExpertWeights.from_weights(c.wg, c.wu, c.wd)
    rows = [torch.nonzero(c.experts == e).flatten() for e in range(El)]
    L = max(len(r) for r in rows)
    index = torch.full((El, L), -1, dtype=torch.int64)
    for e, r in enumerate(rows):
        index[e, : len(r)] = r
    real = index >= 0

    def grid(t: torch.Tensor) -> torch.Tensor:
        g = t[index.clamp(min=0)]
        return torch.where(real.view(real.shape + (1,) * (t.dim() - 1)), g, torch.zeros_like(g))

    def flat(g: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((M,) + g.shape[2:], dtype=g.dtype)
        out[index[real]] = g[real]
        return out

    x, dy, w = grid(c.x), grid(c.dy), grid(c.w)
    a, b = gate_up(x, weights, GROUPED)
    y = down(swiglu(a, b, c.limit), weights, GROUPED)
    rg = row_backward(x, a, b, dy, w, weights, c.limit, GROUPED)
    d_gate_up, d_down = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    accumulate_wgrads(x, dy, w, rg, d_gate_up, d_down, GROUPED)
    return dict(a=flat(a), b=flat(b), y=flat(y), dx=flat(rg.dx), d_w=flat(rg.d_w), d_gate_up=d_gate_up, d_down=d_down)


def ours_all(c: Case, threads: int = 2) -> dict[str, torch.Tensor]:
    a, b, y = ours_forward(c, threads)
    # mok_bf16 gets garbage pre-activations in padding rows (it must not read them).
    garbage = torch.full_like(a, -3.0)
    a_in, b_in = torch.where(c.pad[:, None], garbage, a), torch.where(c.pad[:, None], garbage, b)
    dx, d_w, d_gate_up, d_down = ours_backward(c, a_in, b_in, threads)
    return dict(a=a, b=b, y=y, dx=dx, d_w=d_w, d_gate_up=d_gate_up, d_down=d_down)


def assert_bits(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str = "") -> None:
    for key, w in want.items():
        g = got[key]
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}{key}: {g.dtype} {g.shape} != {w.dtype} {w.shape}"
        nan_w, nan_g = torch.isnan(w), torch.isnan(g)
        assert torch.equal(nan_w, nan_g), f"{what}{key}: NaN at different places"
        zero = torch.zeros_like(w)
        same = torch.equal(torch.where(nan_w, zero, w), torch.where(nan_g, zero, g))
        diff = (w.float() - g.float()).abs().nan_to_num().max().item() if w.numel() else 0.0
        assert same, f"{what}{key}: not bitwise equal (max |diff| {diff:.3e})"


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("limit", LIMITS, ids=["no-limit", "limit"])
@pytest.mark.parametrize("M,H,I,El,routing,pad", SHAPES)
def test_bitwise_the_reference(M, H, I, El, routing, pad, limit):
    c = make_case(M, H, I, El, routing, pad, limit, seed=M * 31 + H)
    got = ours_all(c)
    assert_bits(ref_per_row(c), got, "PerRow: ")
    assert_bits(ref_grouped(c), got, "Grouped: ")


@pytest.mark.parametrize("limit", LIMITS, ids=["no-limit", "limit"])
def test_bitwise_on_many_elements(limit):
    """A million SwiGLU elements: a single fp32 rounding out of order (a fused multiply-add, a
    product rounded late) shows in the bf16 results only about once in 2**16 elements."""
    c = make_case(4096, 8, 256, 2, "sorted", 0.0, limit, seed=2)
    assert_bits(ref_per_row(c), ours_all(c))


def test_a_and_b_only():
    """out_y = 0 (and w_down = 0) computes only the pre-activations, with the same bits."""
    c = make_case(21, 24, 12, 3, "random", 0.2, 0.5, seed=3)
    M, H, I, El = c.shape
    a, b, _ = ours_forward(c)
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    mok_bf16.swiglu_forward(
        "cpu", c.x.data_ptr(), c.experts.data_ptr(), c.wg.data_ptr(), c.wu.data_ptr(), 0, a2.data_ptr(),
        b2.data_ptr(), 0, M, H, I, El, c.limit,
    )  # fmt: skip
    assert torch.equal(a, a2) and torch.equal(b, b2)


def test_unweighted_rows_are_weight_one():
    """router_weights = 0 (the shared expert) gives the reference's w = None, which equals w = 1."""
    c = make_case(17, 16, 8, 1, "random", 0.0, None, seed=4)
    M, H, I, El = c.shape
    a, b, _ = ours_forward(c)
    dx, d_w = torch.empty(M, H, dtype=BF16), torch.empty(M)
    d_gate_up, d_down = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    mok_bf16.swiglu_backward(
        "cpu", c.x.data_ptr(), a.data_ptr(), b.data_ptr(), c.dy.data_ptr(), 0, c.experts.data_ptr(),
        c.wg.data_ptr(), c.wu.data_ptr(), c.wd.data_ptr(), dx.data_ptr(), d_w.data_ptr(), d_gate_up.data_ptr(),
        d_down.data_ptr(), M, H, I, El, None,
    )  # fmt: skip
    weights = ExpertWeights.from_weights(c.wg, c.wu, c.wd)
    x1, dy1 = c.x[None], c.dy[None]
    rg = row_backward(x1, a[None], b[None], dy1, None, weights, None)
    ref_gate_up, ref_down = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    accumulate_wgrads(x1, dy1, None, rg, ref_gate_up, ref_down)
    assert torch.equal(dx, rg.dx[0])
    assert torch.equal(d_w, rg.d_w[0])
    assert torch.equal(d_gate_up, ref_gate_up) and torch.equal(d_down, ref_down)


@pytest.mark.parametrize("split", [0, 1, 10, 22, 39, 40])
def test_weight_gradients_split_invariant(split):
    """Backward over rows [0, m) then [m, M), carrying the accumulators, equals one call."""
    c = make_case(40, 20, 12, 3, "sorted", 0.15, 0.5, seed=11)
    a, b, _ = ours_forward(c)
    one = ours_backward(c, a, b)
    first = ours_backward(c, a, b, rows=slice(0, split))
    second = ours_backward(c, a, b, rows=slice(split, None), acc=(first[2], first[3]))
    assert torch.equal(torch.cat([first[0], second[0]]), one[0])
    assert torch.equal(torch.cat([first[1], second[1]]), one[1])
    assert torch.equal(second[2], one[2]) and torch.equal(second[3], one[3])


@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_bits_do_not_depend_on_threads(routing):
    c = make_case(53, 33, 21, 4, routing, 0.1, None, seed=5)
    results = [ours_all(c, threads) for threads in (1, 2, 3, 8)]
    for r in results[1:]:
        assert_bits(results[0], r)


def test_exp_overflow_and_underflow():
    """Pre-activations of a few hundred: sigmoid's exp under- and overflows, like the reference."""
    c = make_case(30, 32, 16, 2, "random", 0.1, None, seed=6, scale=400.0)
    a, _, _ = ours_forward(c)
    assert a.float().abs().max() > 700, "the case must reach exp's clamp"
    got = ours_all(c)
    assert_bits(ref_per_row(c), got)
    assert_bits(ref_grouped(c), got)


@pytest.mark.parametrize("limit", LIMITS, ids=["no-limit", "limit"])
def test_non_finite_inputs_propagate_like_the_reference(limit):
    c = make_case(16, 12, 8, 2, "random", 0.0, limit, seed=7)
    c.x[3, 5] = float("nan")
    c.x[7, 0] = float("inf")
    c.dy[9, 2] = float("nan")
    c.dy[11, 1] = float("-inf")
    c.wd[1, 4, 3] = float("nan")  # a NaN weight spreads through its expert's rows
    got = ours_all(c)
    want = ref_per_row(c)
    assert torch.isnan(want["y"]).any() and torch.isnan(want["d_gate_up"]).any()
    assert_bits(want, got)
    assert_bits(ref_grouped(c), got)


def test_limit_applies_in_fp32():
    """A limit that is not an fp32 value is rounded to fp32 first, as torch does with a Python float."""
    limit = 1.0 - 2.0**-30  # fp32(limit) = 1.0: a = 1.0 passes `a <= limit` in fp32, not in float64
    c = make_case(24, 16, 8, 2, "random", 0.0, limit, seed=8)
    c.x.fill_(0)
    c.x[:, 0] = 1.0
    c.wg.fill_(0)
    c.wg[:, :, 0] = 1.0  # every a is exactly 1.0
    got = ours_all(c)
    assert (got["a"] == 1.0).all()
    assert_bits(ref_per_row(c), got)


def test_exp_f64_is_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    wide = (torch.rand(200_000, generator=g, dtype=torch.float64) - 0.5) * 1500
    narrow = torch.randn(200_000, generator=g, dtype=torch.float64) * 4
    tiny = torch.randn(10_000, generator=g, dtype=torch.float64) * 1e-300
    # Half-way points of the reduction (x * INV_LN2 = n + 0.5) and their neighbours.
    half = (torch.arange(-1000, 1000, dtype=torch.float64) + 0.5) * math.log(2)
    up, below = torch.full_like(half, math.inf), torch.full_like(half, -math.inf)
    half = torch.cat([half, half.nextafter(up), half.nextafter(below)])
    edges = torch.tensor(
        [0.0, -0.0, 700.0, -700.0, 700.0000000001, -700.0000000001, 709.7, -745.2, 1e-320, -1e-320, 88.7, -103.9,
         math.inf, -math.inf, math.nan, -math.nan, 1e308, -1e308],
        dtype=torch.float64,
    )  # fmt: skip
    x = torch.cat([wide, narrow, tiny, half, edges]).contiguous()
    want = exp_f64(x)
    got = torch.empty_like(x)
    mok_bf16.exp_f64(x.data_ptr(), got.data_ptr(), x.numel())
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))  # NaN payloads too


def test_sigmoid_is_the_reference_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 2**31, (300_000,), generator=g, dtype=torch.int64)
    signs = torch.randint(0, 2, (300_000,), generator=g, dtype=torch.int64) << 31
    every_magnitude = (bits | signs).to(torch.int32).view(torch.float32)  # every exponent, NaN and inf
    usual = torch.randn(300_000, generator=g) * 20
    a = torch.cat([every_magnitude, usual]).contiguous()
    want = sigmoid(a)
    got = torch.empty_like(a)
    mok_bf16.sigmoid(a.data_ptr(), got.data_ptr(), a.numel())
    assert_bits({"sigmoid": want}, {"sigmoid": got})


def test_native_cpu_backend_runs_the_entry_points():
    """The cpu backend computes its experts with mok_bf16 (a missing entry point must not pass silently)."""
    backend = NativeBackend("cpu")
    assert backend.expert_kernels is mok_bf16
    assert not backend.reference_experts
    assert NativeBackend("cuda").expert_kernels is None  # the per-row entry points are CPU only


# ------------------------------------------------------------------ argument checks


class ForwardCall:
    """A valid swiglu_forward call on a case (with its output tensors), then one argument changed."""

    def __init__(self, c: Case) -> None:
        M, H, I, El = c.shape
        self.a, self.b, self.y = (torch.empty(M, n, dtype=BF16) for n in (I, I, H))
        self.args: dict[str, Any] = dict(
            device="cpu", x=c.x.data_ptr(), experts=c.experts.data_ptr(), w_gate=c.wg.data_ptr(),
            w_up=c.wu.data_ptr(), w_down=c.wd.data_ptr(), out_a=self.a.data_ptr(), out_b=self.b.data_ptr(),
            out_y=self.y.data_ptr(), num_rows=M, hidden=H, inner=I, num_experts=El, limit=c.limit, num_threads=2,
        )  # fmt: skip

    def __call__(self, **over: Any) -> None:
        mok_bf16.swiglu_forward(**{**self.args, **over})


@pytest.mark.parametrize(
    "over,error,match",
    [
        (dict(device="tpu"), ValueError, "device must be"),
        (dict(device="cuda"), RuntimeError, "no CUDA implementation"),
        (dict(num_rows=-1), ValueError, "num_rows must be >= 0"),
        (dict(hidden=-2), ValueError, "hidden must be >= 0"),
        (dict(inner=-3), ValueError, "inner must be >= 0"),
        (dict(num_experts=0), ValueError, "num_experts must be >= 1"),
        (dict(hidden=2**40, inner=2**40), ValueError, "too large"),
        (dict(x=0), ValueError, "x must not be 0"),
        (dict(experts=0), ValueError, "experts must not be 0"),
        (dict(w_gate=0), ValueError, "w_gate must not be 0"),
        (dict(out_b=0), ValueError, "out_b must not be 0"),
        (dict(w_down=0), ValueError, "w_down must not be 0"),
        (dict(experts="misaligned"), ValueError, "experts must be aligned to 8"),
        (dict(limit=-1.0), ValueError, "limit must be None or a number >= 0"),
        (dict(limit=math.nan), ValueError, "limit must be None or a number >= 0"),
        (dict(num_threads=0), ValueError, r"num_threads must be in \[1, 1024\]"),
        (dict(num_threads=5000), ValueError, r"num_threads must be in \[1, 1024\]"),
    ],
)
def test_forward_argument_errors(over, error, match):
    c = make_case(8, 8, 4, 2, "random", 0.0, None, seed=9)
    if over.get("experts") == "misaligned":
        over = dict(experts=c.experts.data_ptr() + 4)
    with pytest.raises(error, match=match):
        ForwardCall(c)(**over)


@pytest.mark.parametrize("bad", [2, -2, 100])
def test_expert_ids_checked_before_writing(bad):
    c = make_case(8, 8, 4, 2, "random", 0.0, None, seed=10)
    c.experts[5] = bad
    call = ForwardCall(c)
    a = call.a.fill_(7.0)
    with pytest.raises(
        ValueError, match=rf"swiglu_forward: experts\[5\] must be in \[-1, num_experts = 2\), got {bad}"
    ):
        call()
    assert (a == 7.0).all(), "nothing is written when an argument is bad"
    with pytest.raises(ValueError, match=r"swiglu_backward: experts\[5\]"):
        ours_backward(c, a, a)


def test_backward_argument_errors():
    c = make_case(8, 8, 4, 2, "random", 0.0, None, seed=12)
    M, H, I, El = c.shape
    a, b, _ = ours_forward(c)
    dx, d_w = torch.empty(M, H, dtype=BF16), torch.empty(M)
    acc_gate_up, acc_down = torch.zeros(El, 2 * I, H), torch.zeros(El, H, I)
    ptrs = dict(
        x=c.x, a=a, b=b, dy=c.dy, router_weights=c.w, experts=c.experts, w_gate=c.wg, w_up=c.wu, w_down=c.wd,
        out_dx=dx, out_d_w=d_w, acc_gate_up=acc_gate_up, acc_down=acc_down,
    )  # fmt: skip
    base = {k: t.data_ptr() for k, t in ptrs.items()}
    sizes = dict(num_rows=M, hidden=H, inner=I, num_experts=El)
    for name in ptrs:
        if name == "router_weights":  # 0 means all ones
            continue
        with pytest.raises(ValueError, match=f"swiglu_backward: {name} must not be 0"):
            mok_bf16.swiglu_backward("cpu", **{**base, name: 0}, **sizes)
    with pytest.raises(ValueError, match="acc_down must be aligned to 4 bytes"):
        mok_bf16.swiglu_backward("cpu", **{**base, "acc_down": base["acc_down"] + 2}, **sizes)
    with pytest.raises(RuntimeError, match="swiglu_backward: no CUDA implementation"):
        mok_bf16.swiglu_backward("cuda", **base, **sizes)
    with pytest.raises(TypeError):  # a pointer is a non-negative int
        mok_bf16.swiglu_backward("cpu", **{**base, "x": -8}, **sizes)


def test_no_rows_needs_no_pointers():
    mok_bf16.swiglu_forward("cpu", 0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 32, 4)
    mok_bf16.swiglu_backward("cpu", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 32, 4)
    with pytest.raises(RuntimeError, match="no CUDA implementation"):
        mok_bf16.swiglu_forward("cuda", 0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 32, 4)


def test_helpers_check_their_arguments():
    with pytest.raises(ValueError, match="exp_f64: count must be >= 0"):
        mok_bf16.exp_f64(0, 0, -1)
    with pytest.raises(ValueError, match="sigmoid: a must not be 0"):
        mok_bf16.sigmoid(0, 0, 3)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
        ),
    ],
)
@pytest.mark.parametrize("limit", LIMITS, ids=["no-limit", "limit"])
def test_every_finite_gate_value_gives_the_reference_h(limit, device):
    """The CPU loops and the GPU's h kernel take the sigmoid from a table of all bf16 arguments
    (sigmoid_lookup.h, sigmoid_table.cuh): h for every finite bf16 pre-activation a is bitwise the
    reference's. Expert e's rows are one-hot
    (row r has x[r, r % 64] = 1), so a[r, i] = Wg[e, i, r % 64] exactly; 16 experts of 64 x 64
    weights hold all 65,536 bf16 patterns (non-finite ones replaced: 0 * inf would spread)."""
    from mok_torch.backends.native.grouped import grouped_forward

    El, H, I = 16, 64, 64
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(BF16)
    patterns = torch.where(torch.isfinite(patterns.float()), patterns, torch.zeros_like(patterns))
    wg = patterns.reshape(El, H, I).transpose(1, 2).contiguous()  # wg[e, i, c]: pattern (e, c, i)
    wu = torch.ones(El, I, H, dtype=BF16)
    x = torch.eye(H, dtype=BF16).repeat(El, 1)  # row r: one-hot at r % 64
    offsets = torch.arange(El + 1, dtype=torch.int64) * H
    dev = torch.device(device)
    out = grouped_forward(x.to(dev), offsets.to(dev), wg.to(dev), wu.to(dev), None, limit)
    out = type(out)(*(None if t is None else t.cpu() for t in out))
    assert out.h is not None
    seen = torch.unique(out.a.view(torch.int16)).numel()
    assert seen >= (1 << 16) - 2 * 256, f"only {seen} distinct pre-activations reached the SwiGLU"
    assert_bits({"h": swiglu(out.a, out.b, limit)}, {"h": out.h})
