"""The reference arithmetic: accurate, and the same bits on every code path."""

from __future__ import annotations

import math

import torch

from mok_torch.spec.arith import exp_f64, seq_matmul, seq_row_outer_sum, seq_sum_last, sigmoid


def test_exp_is_accurate():
    x = torch.linspace(-700, 700, 100_003, dtype=torch.float64)
    rel = ((exp_f64(x) - torch.exp(x)) / torch.exp(x)).abs().max().item()
    assert rel < 1e-15


def test_exp_special_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 800.0, -800.0, 0.0], dtype=torch.float64)
    out = exp_f64(x)
    assert math.isnan(out[0]) and out[1] == math.inf and out[2] == 0 and out[3] == math.inf and out[4] == 0
    assert out[5] == 1.0


def test_sigmoid_does_not_depend_on_position_or_length():
    """ATen runs a vector loop and a scalar tail; library exp differs between them."""
    v = torch.randn(1001) * 8
    whole = sigmoid(v)
    pieces = torch.cat([sigmoid(v[i : i + 7]) for i in range(0, 1001, 7)])
    assert torch.equal(whole, pieces)
    assert (whole.double() - torch.sigmoid(v.double())).abs().max() < 1e-7


def test_seq_matmul_is_sequential_and_row_independent():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 33, generator=g).bfloat16().float()
    b = torch.randn(33, 7, generator=g).bfloat16().float()
    got = seq_matmul(a, b)
    want = torch.zeros(5, 7)
    for k in range(33):  # the definition, element by element
        want = want + a[:, k : k + 1] * b[k : k + 1, :]
    assert torch.equal(got, want)
    assert torch.equal(seq_matmul(a[2:3], b), got[2:3])  # one row alone: same bits


def test_seq_row_outer_sum_splits_exactly():
    g = torch.Generator().manual_seed(1)
    u = torch.randn(2, 40, 6, generator=g).bfloat16().float()
    v = torch.randn(2, 40, 9, generator=g).bfloat16().float()
    whole = seq_row_outer_sum(u, v, torch.zeros(2, 6, 9))
    split = torch.zeros(2, 6, 9)
    for lo, hi in ((0, 13), (13, 14), (14, 40)):
        seq_row_outer_sum(u[:, lo:hi], v[:, lo:hi], split)
    assert torch.equal(whole, split)


def test_seq_sum_last_order():
    p = torch.tensor([[1e8, 1.0, -1e8, 1.0]])
    assert seq_sum_last(p).item() == 1.0  # ((1e8 + 1) - 1e8) + 1 in fp32: the 1 is lost, then added
