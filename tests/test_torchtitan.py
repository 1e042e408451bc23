"""The torchtitan-style dispatcher: rows reach their experts in global token order and come back."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE
from multiproc import run_ranks

from mok_torch import MoKConfig
from mok_torch.integrations.torchtitan import MoKExpertParallel, MoKTokenDispatcher

E, H = 6, 8


def _rows(rank: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A source's routes sorted by expert: rows [n, H] and counts [E]."""
    g = torch.Generator().manual_seed(seed + rank)
    experts = torch.sort(torch.randint(0, E, (n,), generator=g)).values
    rows = torch.randn(n, H, generator=g) + experts[:, None] * 10  # the expert is visible in the row
    return rows, torch.bincount(experts, minlength=E)


def scenario(rank: int, world: int, group, device: str) -> dict:
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    rows, counts = _rows(rank, 9 + 4 * rank)
    rows = rows.to(dev).requires_grad_()
    dispatcher = MoKExpertParallel(group, MoKConfig(expert_alignment=4))
    local, per_expert = dispatcher._token_dispatch(None, (rows, counts.to(dev)), None)
    El = E // world
    # the experts: expert e scales its rows by (e + 1)
    scale = torch.repeat_interleave(torch.arange(rank * El, (rank + 1) * El, device=dev) + 1.0, per_expert)
    out = dispatcher._token_combine(None, local * scale[:, None], None)
    out.backward(torch.ones_like(out))
    return {
        "local": local.detach().cpu(),
        "per_expert": per_expert.cpu(),
        "out": out.detach().cpu(),
        "grad": rows.grad.cpu(),
    }


def _expected(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    sources = [_rows(r, 9 + 4 * r) for r in range(world)]
    El = E // world
    locals_ = []
    for r in range(world):
        parts = []
        for e in range(r * El, (r + 1) * El):
            seg = torch.cat([rows[counts[:e].sum() : counts[: e + 1].sum()] for rows, counts in sources])
            parts += [seg, torch.zeros(-seg.shape[0] % 4, H)]
        locals_.append(torch.cat(parts))
    outs = [rows * (torch.repeat_interleave(torch.arange(E) + 1.0, counts)[:, None]) for rows, counts in sources]
    return locals_, outs


@pytest.mark.parametrize("world", [1, 2])
def test_dispatch_combine(world):
    if world == 1:
        results = [scenario(0, 1, None, DEVICE)]
    else:
        if DEVICE == "cuda" and torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs")
        results = run_ranks(world, "test_torchtitan.scenario", DEVICE, device=DEVICE)
    want_local, want_out = _expected(world)
    for r, res in enumerate(results):
        assert torch.equal(res["local"], want_local[r]), f"rank {r}: rows reach experts in global token order"
        assert res["per_expert"].sum() == res["local"].shape[0]
        assert torch.equal(res["out"], want_out[r])
        scale = want_out[r] / _rows(r, 9 + 4 * r)[0]  # d out / d rows = the expert's scale
        assert torch.allclose(res["grad"], scale)


def test_combine_without_dispatch_and_bad_counts():
    d = MoKTokenDispatcher()
    with pytest.raises(ValueError, match="needs a dispatch"):
        d.combine(torch.zeros(2, H))
    with pytest.raises(ValueError, match="sum to the rows"):
        d.dispatch(torch.zeros(3, H), torch.tensor([1, 1, 0, 0, 0, 0]))
