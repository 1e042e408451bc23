"""Shared test machinery: the backend and device under test, tolerances, and layer runners."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import mok_torch as mok
from mok_torch.testing import LayerInputs

# The backend the suite tests (nox parametrises it) and the device it runs on.
BACKEND = os.environ.get("MOK_TEST_BACKEND", "reference")
DEVICE = os.environ.get("MOK_TEST_DEVICE", "cpu")


@dataclass(frozen=True)
class Tolerance:
    """Relative L2 error and cosine similarity bounds against the float64 loop."""

    rel_l2: float
    min_cosine: float


# One table for every precision; outputs and gradients share it.
TOLERANCES = {"bf16": Tolerance(rel_l2=1e-2, min_cosine=0.9999)}


def config(**kw: Any) -> mok.MoKConfig:
    kw.setdefault("backend", BACKEND)
    return mok.MoKConfig(**kw)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    denom = want.norm().item()
    return (got - want).norm().item() / denom if denom > 0 else (got - want).norm().item()


def cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu().flatten(), want.double().cpu().flatten()
    if want.norm() == 0 and got.norm() == 0:
        return 1.0
    return torch.nn.functional.cosine_similarity(got, want, dim=0).item()


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, precision: str = "bf16") -> None:
    tol = TOLERANCES[precision]
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    assert torch.isfinite(got.float()).all(), f"{name}: non-finite values"
    err, cos = rel_l2(got, want), cosine(got, want)
    assert err <= tol.rel_l2 and cos >= tol.min_cosine, (
        f"{name}: rel_l2 {err:.3e} (<= {tol.rel_l2}), cosine {cos:.6f} (>= {tol.min_cosine})"
    )


def run_functional(
    inp: LayerInputs,
    cfg: mok.MoKConfig,
    *,
    group: Any = None,
    rank: int = 0,
    world: int = 1,
    tokens: slice = slice(None),
    max_tokens: int | None = None,
    device: str | torch.device = DEVICE,
    wgrad_dtype: torch.dtype = torch.bfloat16,
    saved: Any = None,
) -> dict[str, torch.Tensor]:
    """forward + backward through the functional API for this rank's token slice; CPU results.
    `saved`: a function of the ForwardContext giving the one the backward gets (as the autograd
    op saves it), or None."""
    dev = torch.device(device)
    x = inp.x_TH[tokens].contiguous().to(dev)
    top = inp.top_experts_TK[tokens].contiguous().to(dev)
    w = inp.router_weights_TK[tokens].contiguous().to(dev)
    dy = inp.dy_TH[tokens].contiguous().to(dev)
    routed = tuple(t.to(dev) for t in inp.local_routed(rank, world))
    shared = None if inp.shared is None else tuple(t.to(dev) for t in inp.shared)
    E, K, H = inp.routed[0].shape[0], top.shape[1], x.shape[1]
    ws = mok.get_workspace(
        cfg, group, device=dev, max_tokens=max_tokens or max(x.shape[0], 1), hidden_size=H, topk=K, num_experts=E
    )
    sched = mok.build_schedule(ws, cfg, top)
    y, ctx = mok.forward(cfg, ws, sched, x, w, routed, shared)
    ctx = ctx if saved is None else saved(ctx)
    asked = BACKEND if cfg.backend == "auto" else cfg.backend
    assert ctx.backend == asked, f"asked for backend {asked!r}, ran {ctx.backend!r}"
    g = mok.backward(cfg, ws, sched, ctx, dy, x, w, routed, shared, wgrad_dtype=wgrad_dtype)
    out = {
        "y": y,
        "dx": g.dx,
        "d_router_weights": g.d_router_weights,
        "dWg": g.d_routed[0],
        "dWu": g.d_routed[1],
        "dWd": g.d_routed[2],
        "saved_rows": torch.tensor(ctx.x_routed_MH.shape[0]),
        "x_routed": ctx.x_routed_MH,
    }
    if g.d_shared is not None:
        out.update(dWg_s=g.d_shared[0], dWu_s=g.d_shared[1], dWd_s=g.d_shared[2])
    return {k: v.detach().cpu() for k, v in out.items()}


def assert_fused_forward_is_the_two_calls(
    inp: LayerInputs, cfg: mok.MoKConfig, device: str | torch.device = DEVICE
) -> None:
    """functional.schedule_and_forward (mok.moe's eager call) gives the schedule, y and context of
    build_schedule then forward, bit for bit, and the backward from its schedule the same gradients.
    (Its context may keep no routed x where the native backend's one-call backward gathers x's
    rows itself: then the other context's x is left out, and the gradients must still agree.)"""
    from mok_torch import functional

    dev = torch.device(device)
    x, top, w = inp.x_TH.to(dev), inp.top_experts_TK.to(dev), inp.router_weights_TK.to(dev)
    routed = tuple(t.to(dev) for t in inp.routed)
    shared = None if inp.shared is None else tuple(t.to(dev) for t in inp.shared)
    E, (T, K), H = inp.routed[0].shape[0], top.shape, x.shape[1]
    ws = mok.get_workspace(cfg, None, device=dev, max_tokens=max(T, 1), hidden_size=H, topk=K, num_experts=E)
    runs = []
    kept_x = []
    for fused in (False, True):
        if fused:
            sched, y, ctx = functional.schedule_and_forward(cfg, ws, top, x, w, routed, shared)
        else:
            sched = mok.build_schedule(ws, cfg, top)
            y, ctx = mok.forward(cfg, ws, sched, x, w, routed, shared)
        g = mok.backward(cfg, ws, sched, ctx, inp.dy_TH.to(dev), x, w, routed, shared)
        fields = [
            getattr(sched, f.name)
            for f in dataclasses.fields(sched)
            if isinstance(getattr(sched, f.name), torch.Tensor)
        ]
        kept_x.append(ctx.x_routed_MH)
        kept = [t for t in (ctx.a_MI, ctx.b_MI, ctx.shared_a_TIs, ctx.shared_b_TIs) if t is not None]
        grads = [t for t in torch.utils._pytree.tree_leaves(tuple(g)) if t is not None]
        runs.append([t.detach().cpu().clone() for t in (*fields, y, *kept, *grads)])
    assert kept_x[0] is not None, "build_schedule then forward keeps the routed x"
    if kept_x[1] is not None:
        assert torch.equal(kept_x[0].cpu(), kept_x[1].cpu()), "the routed x differs"
    assert len(runs[0]) == len(runs[1])
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"output {i} differs"


# What the determinism contract covers across configurations and EP sizes (docs/determinism.md).
CONTRACT_KEYS = ("y", "dx", "d_router_weights", "dWg", "dWu", "dWd")


def assert_bitwise(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: tuple[str, ...] = CONTRACT_KEYS, what: str = ""
) -> None:
    for k in keys:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (
            f"{what}{k}: {a[k].dtype}{list(a[k].shape)} vs {b[k].dtype}{list(b[k].shape)}"
        )
        if not torch.equal(a[k], b[k]):
            diff = (a[k].float() - b[k].float()).abs()
            raise AssertionError(
                f"{what}{k} differs bitwise: {int((diff > 0).sum())} elements, max |diff| {diff.max().item():.3e}"
            )


# (segment lengths, H, I) of the grouped expert kernels' GPU tests, as pytest params named by
# case: mixed sizes, one row, all experts empty, H not a multiple of 128, segments on and off
# tile edges, skewed.
GROUPED_CASES = [
    pytest.param(lengths, H, I, id=name)
    for name, lengths, H, I in (
        ("H128-I192-mixed", [300, 0, 129, 1], 128, 192),
        ("one-row", [1], 64, 64),
        ("all-empty", [0, 0, 0], 64, 128),
        ("one-expert-H320", [517], 320, 256),
        ("tile-edges", [64, 128, 127, 255, 257], 256, 128),
        ("skewed", [1000, 3, 5, 0, 0, 2, 1, 24], 512, 384),
        # K of more k-blocks than the deferred epilogue's pieces (16 and 10 blocks of 64)
        ("long-K", [300, 77, 0, 200], 1024, 640),
        # segments longer than the gathering weight gradients' chunk of 2,048 routes (2,049 rows:
        # one row into a second chunk), starting off multiples of 4 rows
        ("long-segments", [2200, 0, 37, 2049], 128, 64),
    )
]
