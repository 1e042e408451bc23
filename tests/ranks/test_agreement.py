"""Ranks that disagree on what they pass get a clear error on every rank, before any row moves.

Each scenario runs on 2 ranks (gloo on CPU; NCCL with MOK_TEST_DEVICE=cuda when two GPUs are
there) and returns, per rank, what its call raised; the test asserts on every rank.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import BACKEND, DEVICE
from multiproc import run_ranks

import mok_torch as mok
from mok_torch.testing import make_inputs

pytestmark = pytest.mark.multiprocess

T, H, I, K = 12, 32, 16, 2
TIMEOUT_S = 2.0
MARGIN_S = 3.0  # a loaded 2-core CI machine; the default process-group timeout is 30 minutes


def _needs_ranks(world: int) -> None:
    if DEVICE == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (found {torch.cuda.device_count()})")


def _call(rank: int, group, *, experts: int = 8, max_tokens: int = 16, hidden: int = H, inner: int = I, **cfg):
    """One forward + backward of a layer call with this rank's settings; what it raised, or None."""
    dev = f"cuda:{rank}" if DEVICE == "cuda" else "cpu"
    cfg.setdefault("backend", BACKEND)
    cfg.setdefault("expert_alignment", 8)
    cfg.setdefault("timeout_s", TIMEOUT_S)
    config = mok.MoKConfig(**cfg)
    inp = make_inputs(T, hidden, inner, experts, K, seed=3)
    world = 1 if group is None else torch.distributed.get_world_size(group)
    El = experts // world
    r = 0 if group is None else rank  # alone, a rank holds every expert
    routed = tuple(w[r * El : (r + 1) * El].to(dev).requires_grad_() for w in inp.routed)
    x = inp.x_TH.to(dev).requires_grad_()
    start = time.perf_counter()
    try:
        y = mok.moe(x, inp.top_experts_TK.to(dev), inp.router_weights_TK.to(dev), routed, None, config=config,
                    group=group, max_tokens=max_tokens)  # fmt: skip
        y.float().sum().backward()
    except Exception as exc:  # the scenario reports what each rank got
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.perf_counter() - start}
    return None


SETTINGS = {  # rank 1's change of one setting; rank 0 keeps the defaults (or its own part)
    "num_experts": ({}, {"experts": 12}),  # rank 0: 4 experts of 8; rank 1: 6 of 12
    "precision": ({"expert_alignment": 32, "inner": 32}, {"precision": "mxfp8", "expert_alignment": 32, "inner": 32}),
    "max_tokens": ({}, {"max_tokens": 24}),
    "hidden_size": ({}, {"hidden": 64}),
    "dispatch": ({}, {"dispatch": "push"}),
    "combine": ({}, {"combine": "pull"}),
    "macrobatch_size": ({}, {"minibatch_size": 8, "macrobatch_size": 16}),
    "intermediate size": ({}, {"inner": 32}),
}


def disagree(rank: int, world: int, group) -> dict:
    """Every case of SETTINGS in turn, on fresh workspaces (each leaves the ranks in step: both
    raise at the same check)."""
    out = {}
    for setting, kws in SETTINGS.items():
        mok.clear_workspace_cache()
        out[setting] = _call(rank, group, **kws[rank])
    return out


@pytest.fixture(scope="module")
def disagreements() -> list[dict]:
    _needs_ranks(2)
    return run_ranks(2, "test_agreement.disagree", device=DEVICE)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_setting_the_ranks_disagree_on_is_named_on_every_rank(disagreements, setting):
    for rank, per_setting in enumerate(disagreements):
        got = per_setting[setting]
        assert got is not None, f"rank {rank} finished a call whose settings differ from its peer's ({setting})"
        assert got["type"] == "ValueError", f"rank {rank}: {got}"
        assert "disagree" in got["message"] and setting in got["message"], f"rank {rank}: {got['message']}"
        assert "rank 0 has" in got["message"] and "rank 1 has" in got["message"], got["message"]


def agree_twice(rank: int, world: int, group) -> dict:
    """The same settings on both ranks: calls succeed, and only the first call checks."""
    from mok_torch import agreement

    calls = []
    real = agreement._exchange

    def counting(ws, local, what, timeout_s):
        if what != "the call sequence":  # the reference backend's per-call meeting is not a check
            calls.append(what)
        return real(ws, local, what, timeout_s)

    agreement._exchange = counting
    try:
        first = _call(rank, group)
        after_first = len(calls)
        second = _call(rank, group)
    finally:
        agreement._exchange = real
    return {"first": first, "second": second, "checks_first": after_first, "checks_second": len(calls) - after_first}


def test_ranks_that_agree_are_checked_once():
    _needs_ranks(2)
    for rank, got in enumerate(run_ranks(2, "test_agreement.agree_twice", device=DEVICE)):
        assert got["first"] is None and got["second"] is None, f"rank {rank}: {got}"
        assert got["checks_first"] >= 1, f"rank {rank}: the first call checked nothing"
        assert got["checks_second"] == 0, f"rank {rank}: the second call checked again ({got['checks_second']})"


def missing_peer(rank: int, world: int, group) -> dict | None:
    """Rank 1 never calls: rank 0's check gives up after timeout_s, and its workspace is refused."""
    if rank == 1:
        time.sleep(TIMEOUT_S + MARGIN_S + 5.0)  # past rank 0's warm-up, its wait and its second call
        return None
    assert _call(rank, None) is None  # one rank alone: the first call's imports are not timed
    first = _call(rank, group)
    again = _call(rank, group)
    return {"first": first, "again": again}


def test_a_missing_peer_ends_the_check_within_timeout():
    _needs_ranks(2)
    got = run_ranks(2, "test_agreement.missing_peer", device=DEVICE)[0]
    assert got["first"] is not None and got["first"]["type"] == "TimeoutError", got
    assert "timeout_s" in got["first"]["message"], got["first"]["message"]
    assert got["first"]["elapsed"] < TIMEOUT_S + MARGIN_S, got["first"]["elapsed"]
    assert got["again"] is not None and "unusable" in got["again"]["message"], got["again"]


def other_groups(rank: int, world: int, group) -> dict | None:
    """Each rank passes another process group over the same ranks (rank 0 the world, rank 1 a new
    group of both): the check cannot meet, and both ranks give up within timeout_s."""
    import torch.distributed as dist

    assert _call(rank, None) is None  # one rank alone: the first call's imports are not timed
    mine = group if rank == 0 else dist.new_group(list(range(world)))
    if rank == 0:
        dist.new_group(list(range(world)))  # new_group is collective: rank 0 makes it too
    return _call(rank, mine)


def test_ranks_with_different_groups_time_out_on_every_rank():
    _needs_ranks(2)
    for rank, got in enumerate(run_ranks(2, "test_agreement.other_groups", device=DEVICE)):
        assert got is not None and got["type"] == "TimeoutError", f"rank {rank}: {got}"
        assert "different process groups" in got["message"], got["message"]
        assert got["elapsed"] < TIMEOUT_S + MARGIN_S, f"rank {rank}: {got['elapsed']}"


def outside_the_group(rank: int, world: int, group) -> dict | None:
    """A group of rank 0 alone, passed by rank 1 as well (to whom new_group gave a placeholder)."""
    import torch.distributed as dist

    alone = dist.new_group([0])
    return _call(rank, alone) if rank == 1 else None


def test_a_rank_outside_the_group_is_told_so():
    _needs_ranks(2)
    got = run_ranks(2, "test_agreement.outside_the_group", device=DEVICE)[1]
    assert got is not None and got["type"] == "ValueError", got
    assert "not a member of the group" in got["message"], got["message"]


def _steps(rank: int, group, backend: str, *, extra_at: int | None, steps: int = 4) -> list:
    """Training steps of the native backend (max_tokens given: no all-reduce); with `extra_at`,
    rank 0 makes one more no-grad forward (an evaluation) before that step. Per step: ("ok", y,
    dx) or ("error", message); a step after an error is still tried (it must be refused)."""
    if backend == "native":
        backend = "cuda" if DEVICE == "cuda" else "cpu"
    dev = f"cuda:{rank}" if DEVICE == "cuda" else "cpu"
    cfg = mok.MoKConfig(backend=backend, expert_alignment=8, timeout_s=TIMEOUT_S)
    world = torch.distributed.get_world_size(group)
    out = []
    for step in range(steps):
        inp = make_inputs(T, H, I, 8, K, seed=10 + step)
        routed = tuple(w.to(dev) for w in inp.local_routed(rank, world))
        x = inp.x_TH.to(dev).requires_grad_()
        args = (inp.top_experts_TK.to(dev), inp.router_weights_TK.to(dev), routed, None)
        try:
            if extra_at == step and rank == 0:
                ev = make_inputs(T, H, I, 8, K, seed=99).to(dev)
                with torch.no_grad():
                    mok.moe(
                        ev.x_TH, ev.top_experts_TK, ev.router_weights_TK, routed, config=cfg, group=group, max_tokens=16
                    )
            y = mok.moe(x, *args, config=cfg, group=group, max_tokens=16)
            (y.float() * inp.dy_TH.to(dev).float()).sum().backward()
            ws = mok.get_workspace(cfg, group, device=dev, max_tokens=16, hidden_size=H, topk=K, num_experts=8)
            mok.check_errors(ws)  # the GPU's barriers report here
            out.append(("ok", y.detach().cpu(), x.grad.cpu()))
        except Exception as exc:
            out.append(("error", f"{type(exc).__name__}: {exc}"))
    return out


def extra_call(rank: int, world: int, group, backend: str) -> dict:
    reference = _steps(rank, group, backend, extra_at=None)
    mok.clear_workspace_cache()
    return {"reference": reference, "extra": _steps(rank, group, backend, extra_at=1)}


@pytest.mark.parametrize("backend", ["native", "reference"])  # barriers in mok-core / collectives
def test_an_extra_call_on_one_rank_ends_in_errors_and_no_wrong_step(backend):
    _needs_ranks(2)
    for rank, got in enumerate(run_ranks(2, "test_agreement.extra_call", backend, device=DEVICE)):
        assert all(s[0] == "ok" for s in got["reference"]), f"rank {rank}: {got['reference']}"
        steps = got["extra"]
        assert steps[0][0] == "ok", f"rank {rank}: the step before the extra call failed: {steps[0]}"
        # the extra call's step and every one after it fail, on both ranks ...
        assert all(s[0] == "error" for s in steps[1:]), f"rank {rank}: {[s[0] for s in steps]}"
        assert "out of step" in steps[1][1], f"rank {rank}: {steps[1][1]}"
        assert all("unusable" in s[1] for s in steps[2:]), f"rank {rank}: {[s[1][:90] for s in steps[2:]]}"
        # ... and what completed is right
        for want, have in zip(got["reference"][:1], steps[:1], strict=True):
            assert torch.equal(want[1], have[1]) and torch.equal(want[2], have[2]), f"rank {rank}"
