"""The layer benchmark: every (shape, routing, provider) case, every figure, in one run.

For each shape the runner makes this rank's weights, x and dy once; for each routing the
routes; for each provider it measures, in order (each a collective when R > 1):

1. the forward and forward+backward times (median of --iters after --warmup, every provider
   timed in turns; the forward is the whole call, schedule or split sizes included;
   forward+backward is the forward and `y.backward(dy)` timed together), and the host time to
   issue each (from an idle device, until the call returns);
2. the peak device memory of each pass (max_memory_allocated over what was allocated before);
3. the activation bytes kept for backward;
4. determinism: forward+backward twice from the same inputs, outputs and every gradient
   compared with torch.equal.

Then TFLOP/s (seed counting), the fraction of the floor and the speedup over torch-a2a.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..workspace import clear_workspace_cache
from . import floors
from .ceilings import Ceilings, describe_error
from .inputs import LayerCall, make_call, make_weights, route_counts
from .providers import Forward, Provider, Settings
from .shapes import Shape
from .timing import (
    Ranks,
    all_ranks,
    back_to_back_in_turns,
    gather_floats,
    host_ms,
    median,
    reduce_max,
    synchronize,
    time_in_turns,
)

PASSES = ("forward", "forward+backward")
BASELINES = {"torch-a2a": "speedup_vs_torch_a2a", "sonicmoe": "speedup_vs_sonicmoe"}
# Past this many forward flops per rank a CPU run takes minutes per call (the real shapes
# have ~1000x more): skipped unless --allow-slow.
CPU_MAX_FLOPS = 6 * 2**28


@dataclass(frozen=True)
class Options:
    shapes: str
    precision: str
    providers: list[str]
    backends: list[str]
    routings: list[str]
    passes: tuple[str, ...]
    iters: int
    warmup: int
    quick: bool
    allow_slow: bool
    out: str
    plot: bool = True
    argv: list[str] = field(default_factory=list)

    def asdict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("argv")
        return d


def _empty_row(shape: Shape, routing: str, provider: Provider, ranks: Ranks) -> dict[str, Any]:
    return {
        "shape": shape.describe(),
        "routing": routing,
        "provider": provider.name,
        "backend": provider.backend(ranks),
        "precision": provider.precision,
        "status": "ok",
        "reason": None,
        "ms": {},
        "times_ms": {},
        "preceded_by": {},
        "tflops": {},
        "floor": {},
        "floor_fraction": {},
        "speedup_vs_torch_a2a": {},
        "peak_mib": {},
        "host_ms": {},
        "back_to_back_ms": {},
        "saved_mib": None,
        "saved_method": None,
        "deterministic": None,
    }


def peak_mib(ranks: Ranks, run: Callable[[], object], call: LayerCall) -> float | None:
    """Peak device memory of `run()` above what was allocated before it (max over ranks)."""
    if not ranks.cuda:
        return None
    call.drop_grads()
    synchronize(ranks)
    torch.cuda.reset_peak_memory_stats(ranks.device)
    base = torch.cuda.memory_allocated(ranks.device)
    out = run()
    synchronize(ranks)
    peak = torch.cuda.max_memory_allocated(ranks.device) - base
    del out
    return reduce_max(ranks, [peak / 2**20])[0]


def bitwise_repeatable(ranks: Ranks, forward: Forward, call: LayerCall) -> bool:
    """Two forward+backward runs from the same inputs give the same bits, on every rank.

    The first run's output and gradients are kept; the second's are compared in place (one
    extra copy of the weight gradients, not two).
    """

    def once() -> torch.Tensor:
        call.drop_grads()
        y = forward()
        y.backward(call.dy_TH)
        return y.detach()

    first = [once().clone(), *(None if g is None else g.clone() for g in call.grads())]
    second = [once(), *call.grads()]
    same = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(first, second, strict=True)
    )
    del first, second
    call.drop_grads()
    return all_ranks(ranks, same)


def measure_case(
    providers: list[Provider],
    reasons: list[str | None],
    call: LayerCall,
    ranks: Ranks,
    opts: Options,
    settings: Settings,
    layer_floors: dict[str, dict[str, floors.Floor]],
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Every figure of one (shape, routing) case for every provider. The times of a pass are taken
    in turns (timing.time_in_turns: iteration i of every provider before iteration i + 1 of any,
    so the device's clock drift falls on all of them alike), then the time per call of calls issued
    back to back, their rounds in turns too (timing.back_to_back_in_turns); then, per provider, the
    host time to issue a call, the peak memory, the saved activations and the bitwise repeat."""
    rows = [
        skipped_row(call.shape, call.routing, p, ranks, str(r)) if r is not None
        else _empty_row(call.shape, call.routing, p, ranks)
        for p, r in zip(providers, reasons, strict=True)
    ]  # fmt: skip
    runs: dict[int, tuple[Forward, dict[str, Callable[[], object]]]] = {}
    for i, (provider, row) in enumerate(zip(providers, rows, strict=True)):
        if row["status"] != "ok":
            continue
        try:
            forward = provider.prepare(call, ranks, settings)
        except Exception as exc:
            row.update(status="error", reason=describe_error(exc))
            continue

        def forward_backward(forward: Forward = forward) -> None:
            forward().backward(call.dy_TH)

        runs[i] = (forward, {"forward": forward, "forward+backward": forward_backward})
    for p in opts.passes:
        if progress is not None:
            progress.set_postfix_str(f"{call.shape.name} {call.routing} {p}")
        preceded_by: dict[str, list[str | None]] = {}
        timed = time_in_turns(
            ranks, _live(runs, rows, p), iters=opts.iters, warmup=opts.warmup, before=call.drop_grads,
            preceded_by=preceded_by,
        )  # fmt: skip
        for key, times in timed.items():
            row = rows[int(key)]
            if isinstance(times, Exception):
                row.update(status="error", reason=describe_error(times))
                continue
            ms = median(times)
            row["times_ms"][p] = times
            row["preceded_by"][p] = [None if k is None else providers[int(k)].name for k in preceded_by.get(key, [])]
            row["ms"][p] = ms
            row["tflops"][p] = floors.pass_flops(call.shape, p) / (ms * 1e-3) / 1e12
            floor = layer_floors[providers[int(key)].precision][p]
            row["floor"][p] = floor.asdict()
            row["floor_fraction"][p] = None if floor.ms is None else floor.ms / ms
        call.drop_grads()
        b2b = back_to_back_in_turns(ranks, _live(runs, rows, p), before=call.drop_grads)
        for key, ms_or_exc in b2b.items():
            if isinstance(ms_or_exc, Exception):
                rows[int(key)].update(status="error", reason=describe_error(ms_or_exc))
            else:
                rows[int(key)]["back_to_back_ms"][p] = ms_or_exc
        call.drop_grads()
    for i, (forward, run) in runs.items():
        row, provider = rows[i], providers[i]
        if progress is not None:
            progress.set_postfix_str(f"{call.shape.name} {call.routing} {provider.name}")
        try:
            if row["status"] == "ok":
                for p in opts.passes:
                    row["host_ms"][p] = host_ms(ranks, run[p], before=call.drop_grads)
                    row["peak_mib"][p] = peak_mib(ranks, run[p], call)
                call.drop_grads()
                saved, method = provider.saved_bytes(call, forward, ranks)
                if saved is not None:
                    row["saved_mib"] = reduce_max(ranks, [saved / 2**20])[0]
                row["saved_method"] = method
                row["deterministic"] = bitwise_repeatable(ranks, forward, call)
        except Exception as exc:  # a provider that fails is reported, the run goes on
            row.update(status="error", reason=describe_error(exc))
        finally:
            call.drop_grads()
    _free(ranks)
    for row in rows:
        if not all_ranks(ranks, row["status"] != "error") and row["status"] == "ok":
            row.update(status="error", reason="failed on another rank")
    if progress is not None:
        progress.update(len(providers))
    return rows


def _live(
    runs: dict[int, tuple[Forward, dict[str, Callable[[], object]]]], rows: list[dict[str, Any]], p: str
) -> dict[str, Callable[[], object]]:
    """Pass `p` of every provider still without an error, keyed by its row's index (as a str)."""
    return {str(i): passes[p] for i, (_, passes) in runs.items() if rows[i]["status"] == "ok"}


def _free(ranks: Ranks) -> None:
    gc.collect()
    if ranks.cuda:
        torch.cuda.empty_cache()


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_<baseline>[pass] = the baseline's time / the provider's, within one (shape,
    routing), for the baselines torch-a2a and sonicmoe (where each ran)."""
    for baseline, key in BASELINES.items():
        base = next((r for r in rows if r["provider"] == baseline and r["status"] == "ok"), None)
        for row in rows:
            row.setdefault(key, {})
            if base is None or row["status"] != "ok":
                continue
            for p, ms in row["ms"].items():
                if p in base["ms"]:
                    row[key][p] = base["ms"][p] / ms


def case_floors(
    call: LayerCall, ranks: Ranks, ceilings: Ceilings, precisions: set[str]
) -> dict[str, dict[str, floors.Floor]]:
    """Floors per provider precision and pass, from every rank's routes (collective)."""
    routes, tokens = route_counts(call, ranks.world)
    per_rank = gather_floats(ranks, routes + tokens)
    routes_RR = [r[: ranks.world] for r in per_rank]
    pairs_RR = [r[ranks.world :] for r in per_rank]
    return {
        precision: floors.layer_floors(
            call.shape,
            routes_RR,
            pairs_RR,
            matmul_tflops=ceilings.matmul(precision),
            hbm_gbps=ceilings.hbm.value,
            nvlink_gbps=ceilings.nvlink.value,
        )
        for precision in precisions
    }


def skip_reasons(shape: Shape, providers: list[Provider], ranks: Ranks, settings: Settings) -> list[str | None]:
    """Why each provider cannot run `shape` (None: it can), agreed by every rank.

    Every rank must take the same branch: a rank that skipped alone would leave the others
    waiting in a collective.
    """
    too_big = None
    if not ranks.cuda and not settings.allow_slow and floors.forward_flops(shape) > CPU_MAX_FLOPS:
        too_big = "too big for a CPU run (use --allow-slow)"
    reasons = [shape.skip or p.unavailable(shape, ranks, settings) or too_big for p in providers]
    skipped_somewhere = reduce_max(ranks, [0.0 if r is None else 1.0 for r in reasons])
    return [
        r if r is not None or flag == 0.0 else "unavailable on another rank"
        for r, flag in zip(reasons, skipped_somewhere, strict=True)
    ]


def skipped_row(shape: Shape, routing: str, provider: Provider, ranks: Ranks, reason: str) -> dict[str, Any]:
    row = _empty_row(shape, routing, provider, ranks)
    row.update(status="skipped", reason=reason)
    return row


def run_cases(
    shapes: list[Shape],
    providers: list[Provider],
    ranks: Ranks,
    opts: Options,
    ceilings: Ceilings,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Rows of every (shape, routing, provider), in that order."""
    settings = Settings(allow_slow=opts.allow_slow, passes=tuple(opts.passes))
    precisions = {p.precision for p in providers}
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        reasons = skip_reasons(shape, providers, ranks, settings)
        if all(r is not None for r in reasons):  # nothing to run: make no inputs
            for routing in opts.routings:
                for provider, reason in zip(providers, reasons, strict=True):
                    rows.append(skipped_row(shape, routing, provider, ranks, str(reason)))
                    if progress is not None:
                        progress.update()
            continue
        weights = make_weights(shape, ranks)
        for routing in opts.routings:
            call = make_call(shape, routing, weights, ranks)
            layer_floors = case_floors(call, ranks, ceilings, precisions)
            case_rows = measure_case(providers, reasons, call, ranks, opts, settings, layer_floors, progress)
            add_speedups(case_rows)
            rows += case_rows
            del call
        del weights
        clear_workspace_cache()
        _free(ranks)
    return rows
