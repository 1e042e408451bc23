"""GPU-only checks of the reference backend (skipped, with the reason, without a GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise, config, run_functional

from mok_torch.testing import make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
]


@pytest.mark.parametrize("routing", ["balanced", "skewed", "worst"])
def test_reference_on_cuda_equals_cpu_bitwise(routing):
    """The reference arithmetic is device independent: CUDA gives the CPU's bits."""
    inp = make_inputs(37, 64, 32, 8, 2, 16, routing, seed=21)
    cfg = config(backend="reference", expert_alignment=8, minibatch_size=16, macrobatch_size=32)
    cpu = run_functional(inp, cfg, device="cpu")
    gpu = run_functional(inp, cfg, device="cuda")
    assert_bitwise(cpu, gpu, tuple(cpu), what="cuda vs cpu: ")
