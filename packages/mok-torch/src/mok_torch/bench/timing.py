"""Timing and the few cross-rank reductions the benchmark needs.

Every timed iteration starts from an idle device with every rank lined up (synchronize,
then a barrier when R > 1), so one iteration's time is the whole call as a training step
sees it: host work such as reading split sizes, kernel launches and waits on other ranks.
A GPU iteration is timed with CUDA events around the call; a CPU one with perf_counter.
With several ranks an iteration takes as long as its slowest rank: the per-iteration
maximum over ranks is what gets reported (its median over iterations).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """Where this process runs: its device, the expert-parallel group (None = one rank)."""

    device: torch.device
    group: Any
    rank: int
    world: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def lead(self) -> bool:
        return self.rank == 0


def synchronize(ranks: Ranks) -> None:
    if ranks.cuda:
        torch.cuda.synchronize(ranks.device)


def line_up(ranks: Ranks) -> None:
    """Idle device, every rank at the same point."""
    synchronize(ranks)
    if ranks.world > 1:
        dist.barrier(group=ranks.group)
        synchronize(ranks)


def gather_floats(ranks: Ranks, values: Sequence[float]) -> list[list[float]]:
    """values of every rank (each rank passes as many), rank order."""
    local = torch.tensor(list(values), dtype=torch.float64, device=ranks.device)
    if ranks.world == 1:
        return [local.tolist()]
    out = [torch.empty_like(local) for _ in range(ranks.world)]
    dist.all_gather(out, local, group=ranks.group)
    return [t.tolist() for t in out]


def reduce_max(ranks: Ranks, values: Sequence[float]) -> list[float]:
    """Element-wise maximum over ranks."""
    per_rank = gather_floats(ranks, values)
    return [max(column) for column in zip(*per_rank, strict=True)]


def all_ranks(ranks: Ranks, flag: bool) -> bool:
    """True when `flag` holds on every rank."""
    return min(reduce_max(ranks, [0.0 if flag else 1.0])) == 0.0


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def time_ms(
    ranks: Ranks,
    fn: Callable[[], Any],
    *,
    iters: int,
    warmup: int,
    before: Callable[[], None] | None = None,
) -> list[float]:
    """Per-iteration times in ms of `fn()` (maximum over ranks), after `warmup` untimed calls.

    `before()` runs ahead of every call, untimed (e.g. dropping last iteration's gradients).
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times: list[float] = []
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    for _ in range(iters):
        if before is not None:
            before()
        line_up(ranks)
        if ranks.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if ranks.cuda:
        synchronize(ranks)
        times = [start.elapsed_time(end) for start, end in events]
    return reduce_max(ranks, times)


def host_ms(ranks: Ranks, fn: Callable[[], Any], *, iters: int = 5, before: Callable[[], None] | None = None) -> float:
    """Median host time in ms to issue `fn()` from an idle device: the time until the call returns,
    the device still working. A call that waits for the device inside shows its device time here."""
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        line_up(ranks)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        synchronize(ranks)
    return median(reduce_max(ranks, times))


def back_to_back_ms(
    ranks: Ranks,
    fn: Callable[[], Any],
    *,
    calls: int = 10,
    rounds: int = 3,
    before: Callable[[], None] | None = None,
) -> float:
    """Time in ms per call of `fn()` issued `calls` times back to back, as a training loop issues
    its steps (the median over `rounds`, each from a lined-up idle device; maximum over ranks):
    the host issues call i + 1 while the device runs call i, so what shows is the device's time
    wherever the host keeps ahead of it, and the host's where it does not. `before()` runs ahead
    of every call, inside the timing (keep it to host work such as dropping gradients)."""
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls and rounds must be >= 1, got {calls} and {rounds}")
    per_call = []
    for _ in range(rounds):
        line_up(ranks)
        if ranks.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            if before is not None:
                before()
            fn()
        if ranks.cuda:
            end.record()
            synchronize(ranks)
            per_call.append(start.elapsed_time(end) / calls)
        else:
            per_call.append((time.perf_counter() - t0) * 1e3 / calls)
    return median(reduce_max(ranks, per_call))


def back_to_back_in_turns(
    ranks: Ranks,
    fns: dict[str, Callable[[], Any]],
    *,
    calls: int = 10,
    rounds: int | None = None,
    before: Callable[[], None] | None = None,
) -> dict[str, float | Exception]:
    """back_to_back_ms of several calls with their rounds taken in turns: round r of every call
    before round r + 1 of any, each round's order from balanced_turns, so that every call's rounds
    follow every other call's equally often (a round starts on the device state the round before
    it left: measured one call after another, the later ones would always inherit the earlier
    ones'). The median over `rounds` per call (default: 3, or twice balanced_turns' orders where
    that is more). A call that raises gets its exception instead; the others go on."""
    names = list(fns)
    orders = balanced_turns(len(names))
    rounds = max(3, 2 * len(orders)) if rounds is None else rounds
    per_round: dict[str, list[float]] = {name: [] for name in names}
    failed: dict[str, Exception] = {}
    for r in range(rounds):
        for name in [names[j] for j in orders[r % len(orders)]]:
            if name in failed:
                continue
            try:
                per_round[name].append(back_to_back_ms(ranks, fns[name], calls=calls, rounds=1, before=before))
            except Exception as exc:  # reported by the caller, not dropped (its frames let go)
                failed[name] = exc.with_traceback(None)
    return {name: failed[name] if name in failed else median(per_round[name]) for name in names}


def balanced_turns(n: int) -> list[list[int]]:
    """Orders of n calls for consecutive iterations of time_in_turns, used cyclically: each order
    a permutation of range(n), and in the orders' cyclic concatenation every call follows every
    other call equally often and never itself. So no call always runs right after the same one
    (a long, hot call ahead leaves the device's power budget lower for the next: session 28's
    reading of the H200). n <= 2: one order ([0, 1] alternates already); n >= 3: n - 1 orders, each
    ordered pair of two calls once, found by a search (depth-first, deterministic), or rotations
    of range(n) where the search gives up (n > 7)."""
    if n <= 2:
        return [list(range(n))]
    seq: list[int] = [0]
    used: set[tuple[int, int]] = set()
    length = n * (n - 1)
    budget = 200_000  # steps of the search

    def extend() -> bool:
        nonlocal budget
        if len(seq) == length:
            return (seq[-1], seq[0]) not in used and seq[-1] != seq[0]
        budget -= 1
        if budget < 0:
            return False
        block = seq[len(seq) - len(seq) % n :]
        for c in range(n):
            pair = (seq[-1], c)
            if c in block or c == seq[-1] or pair in used:
                continue
            seq.append(c)
            used.add(pair)
            if extend():
                return True
            used.discard(pair)
            seq.pop()
        return False

    if n <= 7 and extend():
        return [seq[i : i + n] for i in range(0, length, n)]
    return [[(i + j) % n for j in range(n)] for i in range(n)]


def time_in_turns(
    ranks: Ranks,
    fns: dict[str, Callable[[], Any]],
    *,
    iters: int,
    warmup: int,
    before: Callable[[], None] | None = None,
    preceded_by: dict[str, list[str | None]] | None = None,
) -> dict[str, list[float] | Exception]:
    """Per-iteration times in ms of several calls taken in turns: after each call's `warmup`
    untimed runs, iteration i of every call is timed before iteration i + 1 of any (each as
    time_ms times one iteration). The device's clock and power state drift over a run (the
    H200's power cap engages after seconds of load): in turns, the drift falls on every call
    alike instead of on whichever ran last. The order within an iteration changes from one
    iteration to the next (balanced_turns), so that each call follows each other one equally
    often: what a call leaves behind (the device's heat, its power budget) falls on every call
    alike too. `preceded_by`, when given, gets for each call the name of the call that ran just
    before each of its timed iterations (None: none did). `before()` runs ahead of every call,
    untimed. A call that raises gets its exception instead of times; the others go on.
    """
    results: dict[str, list[float] | Exception] = {}
    live: dict[str, Callable[[], Any]] = {}
    last: str | None = None
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                if before is not None:
                    before()
                fn()
                last = name
            synchronize(ranks)
        except Exception as exc:  # reported by the caller, not dropped (its frames let go)
            results[name] = exc.with_traceback(None)
            continue
        live[name] = fn
        results[name] = []
    names = list(fns)
    orders = balanced_turns(len(names))
    for it in range(iters):
        for name in [names[j] for j in orders[it % len(orders)]]:
            if name not in live:
                continue
            try:
                times = time_ms(ranks, live[name], iters=1, warmup=0, before=before)
            except Exception as exc:
                results[name] = exc.with_traceback(None)
                del live[name]
                last = name
                continue
            kept = results[name]
            assert isinstance(kept, list)
            kept.extend(times)
            if preceded_by is not None:
                preceded_by.setdefault(name, []).append(last)
            last = name
    return results
