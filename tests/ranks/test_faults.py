"""A rank that dies, exits, hangs or is slow: every other rank gets an error within timeout_s
(a slow rank inside it: none at all), no step completes with a wrong result, the workspace is
refused afterwards, and no shared-memory segment is left behind.

Each scenario runs a few training steps on R ranks over gloo (the native CPU backend: mok-core's
shared-memory transport and barriers, the protocol the GPU transport runs; the reference backend:
its bounded collectives), first all in step (the reference bits), then again with the fault
injected into the last rank before step 1.
"""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch
from multiproc import run_ranks_with_faults

import mok_torch as mok
from mok_torch.testing import make_inputs

pytestmark = pytest.mark.multiprocess

T, H, I, E, K = 12, 32, 16, 6, 2
TIMEOUT_S = 2.0
MARGIN_S = 3.0  # a loaded 2-core CI machine
STEPS = 3


def _steps(rank: int, group, backend: str, fault: str | None) -> list:
    """STEPS training steps; per step ("ok", y, dx, seconds) or ("error", message, seconds)."""
    cfg = mok.MoKConfig(backend=backend, expert_alignment=8, timeout_s=TIMEOUT_S)
    world = torch.distributed.get_world_size(group)
    out: list = []
    for step in range(STEPS):
        if step == 1 and fault is not None and rank == world - 1:
            if fault == "exit":
                os._exit(0)  # no clean-up of any kind, as a crashing script
            elif fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "stuck":
                time.sleep(3600)
            elif fault == "slow":
                time.sleep(TIMEOUT_S / 3)
        inp = make_inputs(T, H, I, E, K, seed=40 + step)
        routed = tuple(w.requires_grad_() for w in inp.local_routed(rank, world))
        x = inp.x_TH.clone().requires_grad_()
        start = time.perf_counter()
        try:
            y = mok.moe(x, inp.top_experts_TK, inp.router_weights_TK, routed, config=cfg, group=group, max_tokens=16)
            (y.float() * inp.dy_TH.float()).sum().backward()
            out.append(("ok", y.detach(), x.grad, time.perf_counter() - start))
        except Exception as exc:  # the test asserts on what each rank got
            out.append(("error", f"{type(exc).__name__}: {exc}", time.perf_counter() - start))
    return out


def fault_scenario(rank: int, world: int, group, backend: str, fault: str) -> dict:
    reference = _steps(rank, group, backend, None)
    mok.clear_workspace_cache()  # a fresh workspace (and transport) for the faulty run
    return {"reference": reference, "faulty": _steps(rank, group, backend, fault)}


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/mok-*"))


@pytest.mark.parametrize(
    "backend,fault,world",
    [
        ("cpu", "kill", 2),
        ("cpu", "kill", 3),
        ("cpu", "exit", 2),
        ("cpu", "stuck", 2),
        ("cpu", "slow", 2),
        ("reference", "kill", 2),
        ("reference", "stuck", 2),
    ],
)
def test_a_rank_that_fails_ends_in_errors_on_every_other_rank(backend, fault, world):
    before = _segments()
    survivors = list(range(world - 1)) if fault != "slow" else list(range(world))
    results, codes = run_ranks_with_faults(
        world, "test_faults.fault_scenario", backend, fault, survivors=survivors, deadline_s=240
    )
    left = _segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
    for rank in survivors:
        got = results[rank]
        assert got is not None, f"rank {rank} saved no result (exit code {codes[rank]})"
        assert all(s[0] == "ok" for s in got["reference"]), f"rank {rank}: {got['reference']}"
        steps = got["faulty"]
        # What completed is right: the reference run's bits.
        done = [s for s in steps if s[0] == "ok"]
        for want, have in zip(got["reference"], done, strict=False):
            assert torch.equal(want[1], have[1]) and torch.equal(want[2], have[2]), f"rank {rank}: a wrong step"
        if fault == "slow":  # within timeout_s: no error, every step done
            assert len(done) == STEPS, f"rank {rank}: {[s[1] if s[0] == 'error' else 'ok' for s in steps]}"
            continue
        assert steps[0][0] == "ok", f"rank {rank}: the step before the fault failed: {steps[0]}"
        first = steps[1]
        assert first[0] == "error", f"rank {rank}: the step with a peer {fault} did not fail"
        assert first[2] <= TIMEOUT_S + MARGIN_S, f"rank {rank}: the error came after {first[2]:.1f} s"
        if backend == "cpu":
            assert f"waited more than {TIMEOUT_S:g} s for rank {world - 1}" in first[1], f"rank {rank}: {first[1]}"
        else:  # gloo's own error for a peer that is gone, or mok's bound on the wait
            assert "TimeoutError" in first[1] or "RuntimeError" in first[1], f"rank {rank}: {first[1]}"
        # Later steps are refused at once (the group is out of step), not run.
        for s in steps[2:]:
            assert s[0] == "error", f"rank {rank}: a step after the error ran"
            if backend == "cpu":
                assert "unusable" in s[1], f"rank {rank}: {s[1]}"
    if fault == "kill":
        assert codes[world - 1] == -signal.SIGKILL
