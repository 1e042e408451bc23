"""Where the host's time goes while it issues one layer call, step by step, and how late the device
starts the expert kernels because of it.

    python3 benchmarks/probes/host_steps.py [shape ...] [--calls N] [--out FILE]
    python3 benchmarks/probes/host_steps.py [shape ...] --profile [--profile-pass PASS] [--calls N] [--out FILE]

Each call starts from an idle device (synchronized before it), as the bench's timed iterations do.
Every step listed in STEPS is wrapped with a timer: per step the median over the calls of its
inclusive host time (us) and of when it was first entered after the call began ("at"; the start of
mok.moe is 0). Device side: a CUDA event recorded just before the call and one recorded on the
stream just before the forward's expert kernel is issued (the megakernel, or the chain's first
grouped GEMM) give the device's start of the experts ("experts start"); with an idle device that is
the host's issue time up to there plus the few small kernels before it (the schedule's). Three
passes: the forward through autograd (the context kept), forward + backward, and the forward under
torch.no_grad (a forward that no backward follows, as in evaluation and RL's rollouts). Shapes by
bench name (default qwen3-30b-a3b and sonic-7b), balanced routing, the default config.

With --profile no step is wrapped: cProfile runs over one pass alone (--profile-pass: "forward",
the default, "forward+backward" or "forward, no_grad"; each call from an idle device) and the
functions that took the most host time by their own time are listed, per call (us), with the time
spent inside them (cumulative): what the steps' inclusive times cannot split, as the allocations,
the stream lookups and the extensions' argument parsing. Under each built-in of 5 us or more a
call, its callers with their share of its time (which copy, which allocation).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import pstats
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

import mok_torch as mok
from mok_torch import autograd as mok_autograd
from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks

# (module, attribute path): what a call passes through, outermost first. A step that the installed
# version lacks is skipped (so that one probe times two builds against each other).
STEPS = (
    ("mok_torch.autograd", "moe"),
    ("mok_torch.autograd", "Layer.forward"),
    ("mok_torch.ops", "run_forward_only"),
    ("mok_torch.functional", "schedule_and_forward"),
    ("mok_torch.functional", "_checked_routes"),
    ("mok_torch.functional", "_check_layer_args"),
    ("mok_torch.backends.native", "NativeBackend.schedule_and_forward"),
    ("mok_torch.backends.native", "NativeBackend._transport"),
    ("mok_torch.backends.native", "expert_path"),
    ("mok_torch.backends.native", "NativeBackend._table"),
    ("mok_torch.backends.native", "NativeBackend._megakernel_launch"),
    ("mok_torch.backends.native", "NativeBackend._source_side"),
    ("mok_torch.backends.native", "NativeBackend._megakernel_rest"),
    ("mok_torch.backends.native", "NativeBackend._forward_rest"),
    ("mok_torch.backends.native", "NativeBackend._combine"),
    ("mok_torch.backends.native", "NativeBackend._after_call"),
    ("mok_core", "build_table"),
    ("mok_core", "build_send_side"),
    ("mok_core", "combine"),
    ("mok_bf16", "moe_forward"),
    ("mok_bf16", "moe_forward_call"),
    ("mok_torch.backends.native", "NativeBackend._forward"),
    ("mok_torch.backends.native", "NativeBackend._forward_on"),
    ("mok_torch.backends.native", "NativeBackend._scatter_x"),
    ("mok_torch.backends.native", "NativeBackend._scattered_experts"),
    ("mok_torch.backends.native", "NativeBackend._issue_source_side"),
    ("mok_torch.backends.native", "NativeBackend._routed_forward"),
    ("mok_torch.backends.native", "NativeBackend._rows_plan"),
    ("mok_torch.backends.native", "NativeBackend._routed_experts"),
    ("mok_torch.backends.native", "gpu_forward_kernels"),
    ("mok_torch.backends.native", "gpu_mxfp8_forward_kernels"),
    ("mok_torch.backends.native", "NativeBackend._y_rows"),
    ("mok_torch.backends.native", "NativeBackend._shared_forward"),
    ("mok_torch.backends.native.transport", "Transport.scatter_local"),
    ("mok_torch.backends.native", "grouped_forward"),
    ("mok_torch.backends.native", "launch_forward"),
    ("mok_bf16", "grouped_forward"),
    ("mok_torch.autograd", "Layer.backward"),
    ("mok_torch.functional", "backward"),
    ("mok_torch.backends.native", "NativeBackend._backward"),
    ("mok_torch.backends.native", "NativeBackend._shared_backward"),
    # The backward's steps before its first launch (the native backend's own names: it imports
    # grouped_backward and launch_backward by name, so the grouped module's attribute is not what it calls).
    ("mok_torch.backends.native", "_log_path"),
    ("mok_torch.backends.native", "_wgrad_tensors"),
    ("mok_torch.backends.native", "NativeBackend._send_inputs"),
    ("mok_torch.backends.native", "NativeBackend._movers"),
    ("mok_torch.backends.native", "NativeBackend._output_rows"),
    ("mok_torch.backends.native", "grouped_backward"),
    ("mok_torch.backends.native", "launch_backward"),
    ("mok_torch.backends.native", "backward_scratch"),
    ("mok_bf16", "grouped_backward"),
    # one rank's direct backward in one extension call (session 40)
    ("mok_torch.backends.native", "NativeBackend._backward_call"),
    ("mok_torch.backends.native", "backward_call"),
    ("mok_bf16", "moe_backward_call"),
)
# The launch before which the device's start of the experts is marked (the first one a call makes).
# With the one call of table, megakernel and combine (mok_bf16.moe_forward_call) the mark stands
# before the table's kernels, which run first in it: ~10-20 us of the device earlier than the mark
# before a separate megakernel's launch.
EXPERT_LAUNCHES = (("mok_bf16", "moe_forward"), ("mok_bf16", "moe_forward_call"), ("mok_bf16", "grouped_forward"))


class Recorder:
    def __init__(self) -> None:
        self.t0 = 0.0
        self.inclusive: dict[str, float] = defaultdict(float)
        self.first: dict[str, float] = {}
        self.mark: torch.cuda.Event | None = None

    def begin(self) -> None:
        self.inclusive.clear()
        self.first.clear()
        self.mark = None
        self.t0 = time.perf_counter()


def _resolve(module: str, path: str) -> tuple[Any, str, Any] | None:
    try:
        owner: Any = importlib.import_module(module)
    except ImportError:
        return None
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    return None if fn is None else (owner, name, fn)


def instrument(rec: Recorder) -> None:
    for module, path in STEPS:
        found = _resolve(module, path)
        if found is None:
            continue
        owner, name, fn = found
        label = f"{module.split('.')[-1]}.{path}"
        marks = (module, path) in EXPERT_LAUNCHES
        wrapped = _wrap(rec, label, fn.__func__ if isinstance(fn, staticmethod) else fn, marks)
        setattr(owner, name, staticmethod(wrapped) if isinstance(fn, staticmethod) else wrapped)
    for module, path in EXPERT_LAUNCHES:  # marked even where not timed as a step
        found = _resolve(module, path)
        if found is not None and (module, path) not in STEPS:
            owner, name, fn = found
            setattr(owner, name, _wrap(rec, None, fn, True))


def _wrap(rec: Recorder, label: str | None, fn: Any, marks: bool) -> Any:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if marks and rec.mark is None and torch.cuda.is_available():
            rec.mark = torch.cuda.Event(enable_timing=True)
            rec.mark.record()
        t = time.perf_counter()
        if label is not None and label not in rec.first:
            rec.first[label] = t - rec.t0
        try:
            return fn(*args, **kwargs)
        finally:
            if label is not None:
                rec.inclusive[label] += time.perf_counter() - t

    return timed


def _setup(shape_name: str) -> tuple[Any, Any, Any, Any]:
    """(shape, the bench's call at one rank, its forward (autograd on: the context is kept), sync)."""
    cuda = torch.cuda.is_available()
    ranks = Ranks(torch.device("cuda", 0) if cuda else torch.device("cpu"), None, 0, 1)
    sync = torch.cuda.synchronize if cuda else lambda: None
    shape = resolve_shapes(shape_name, 1)[0]
    call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
    cfg = mok.MoKConfig()

    def forward() -> torch.Tensor:
        return mok_autograd.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, call.shared,
                       config=cfg, max_tokens=shape.tokens)  # fmt: skip

    return shape, call, forward, sync


def run(shape_name: str, calls: int) -> list[str]:
    cuda = torch.cuda.is_available()
    shape, call, forward, sync = _setup(shape_name)
    rec = Recorder()
    instrument(rec)
    out = []
    for label, fn in _passes(call, forward).items():
        for _ in range(3):
            fn()
        per_step: dict[str, list[float]] = defaultdict(list)
        at: dict[str, list[float]] = defaultdict(list)
        host, start, device = [], [], []
        for _ in range(calls):
            sync()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            rec.begin()
            fn()
            host.append(time.perf_counter() - rec.t0)
            if cuda:
                end.record()
            sync()
            device.append(begin.elapsed_time(end) * 1e3 if cuda else float("nan"))
            if rec.mark is not None:
                start.append(begin.elapsed_time(rec.mark) * 1e3)
            for step, seconds in rec.inclusive.items():
                per_step[step].append(seconds * 1e6)
                at[step].append(rec.first[step] * 1e6)
        med = statistics.median
        out.append(f"== {shape.name} {label}: {calls} calls from an idle device (us, medians)")
        out.append(
            f"   call: host {med(host) * 1e6:8.1f}  device {med(device):8.1f}  "
            f"experts start {med(start) if start else float('nan'):8.1f}"
        )
        out.append(f"   {'step':52s} {'host':>8s} {'at':>8s}")
        for step in sorted(per_step, key=lambda s: med(at[s])):
            out.append(f"   {step:52s} {med(per_step[step]):8.1f} {med(at[step]):8.1f}")
    return out


def _passes(call: Any, forward: Any) -> dict[str, Any]:
    """The passes a call is timed in: the forward through autograd (the context kept), forward +
    backward, and the forward under torch.no_grad (no context: ops.run_forward_only)."""

    def forward_backward() -> None:
        call.drop_grads()
        forward().backward(call.dy_TH)

    def forward_alone() -> None:
        with torch.no_grad():
            forward()

    return {"forward": forward, "forward+backward": forward_backward, "forward, no_grad": forward_alone}


def profile(shape_name: str, calls: int, top: int = 32, pass_: str = "forward") -> list[str]:
    """cProfile over `calls` passes (`pass_`: one of _passes'), each from an idle device: the top
    functions by own time."""
    shape, call, forward, sync = _setup(shape_name)
    fn = _passes(call, forward)[pass_]
    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    host = []
    for _ in range(calls):
        sync()
        t = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        host.append(time.perf_counter() - t)
    sync()
    stats = pstats.Stats(prof, stream=io.StringIO())
    table = stats.stats  # type: ignore[attr-defined]
    rows = []
    for key, (_, ncalls, own, cum, callers) in table.items():
        rows.append((own, cum, ncalls, _where(key), callers))
    rows.sort(key=lambda r: r[:3], reverse=True)
    out = [f"== {shape.name} {pass_} under cProfile: {calls} calls from an idle device "
           f"(host {statistics.median(host) * 1e6:.1f} us a call by the median, the profiler's cost included)",
           f"   {'own us/call':>11s} {'cum us/call':>11s} {'calls/call':>10s}  function"]  # fmt: skip
    for own, cum, ncalls, where, callers in rows[:top]:
        out.append(f"   {own / calls * 1e6:11.1f} {cum / calls * 1e6:11.1f} {ncalls / calls:10.1f}  {where}")
        if "(" not in where and own / calls >= 5e-6:  # a built-in (torch's, an extension's): who calls it
            for caller, (_, n, own_in, _) in sorted(callers.items(), key=lambda c: -c[1][2]):
                out.append(f"   {'':11s} {own_in / calls * 1e6:11.1f} {n / calls:10.1f}    from {_where(caller)}")
    return out


def _where(key: tuple[str, int, str]) -> str:
    """A cProfile function key as file:line(name), or the built-in's name."""
    file, line, name = key
    return name if file == "~" else f"{file.split('site-packages/')[-1]}:{line}({name})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b", "sonic-7b"])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="cProfile the passes instead of timing the steps")
    p.add_argument(
        "--profile-pass",
        default="forward",
        choices=["forward", "forward+backward", "forward, no_grad"],
        help="with --profile: which pass",
    )
    ns = p.parse_args()
    lines = []
    for name in ns.shapes:
        lines.extend(profile(name, ns.calls, pass_=ns.profile_pass) if ns.profile else run(name, ns.calls))
    text = "\n".join(lines) + "\n"
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
