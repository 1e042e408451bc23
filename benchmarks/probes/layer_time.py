"""Where a layer call's time goes on the GPU: eager against a CUDA graph of the same call (no host
work at all), the host time to issue it, and torch.profiler's kernels, for the megakernel path and
the chain of kernels (MoKConfig.megakernel=False).

    python3 benchmarks/probes/layer_time.py [shape ...] [--profile FILE] [--host-profile FILE]
                                            [--host-layers FILE]

Shapes by bench name (default qwen3-30b-a3b), balanced routing, no shared expert unless the shape
has one. Prints one line per (shape, path, pass): eager ms, graph ms, host ms; with --profile, the
profiler's table of one forward + backward per (shape, path) goes to FILE; with --host-profile,
cProfile's view of the host's Python while it issues forwards and forward + backwards of the
megakernel path (the device synchronized only around the batch: what the host itself spends;
its self times are not to be trusted across torch's custom-op layer, whose Dynamo-disabled frames
cProfile attributes to their caller as well); with --host-layers, the host time of one forward
of the megakernel path issued at each layer of mok's stack, from mok.moe down to the backend,
each the median of 30 calls on an idle device (the differences are what each layer costs), and
of one forward + backward through mok.moe; with --timeline, one eager forward + backward of the
megakernel path from an idle device under torch.profiler, kernel by kernel in the order the
device ran them: when each started after the call began on the host, how long it ran, and the
device's idle time before it (what the host's issue leaves exposed); then the same call as the last
of 20 issued back to back (the kernels' times under the sustained load of the bench's loop); with
--compiled, a training step of the megakernel path (the routed weights as an nn.Module's
parameters, x an input) eager and compiled in each of --compiled-modes: "cudagraphs"
(torch.compile(backend="cudagraphs"): AOT autograd's graphs replayed as CUDA graphs by cudagraph
trees), "static" (the same with the module's parameters and buffers and x marked as static
addresses, torch._dynamo.mark_static_address, so that cudagraph trees read them in place instead of
copying them into the graphs' buffers each step) and "reduce-overhead" (torch.compile(mode=
"reduce-overhead"): inductor, whose cudagraph trees know the parameters as static): each step's
time from an idle device, its host time to issue, and the time a step back to back (20 steps, no
synchronization), with the compiled step's y and gradients compared bit for bit with the eager
step's; --compiled-only skips everything else; with --compiled-profile FILE as well,
torch.profiler's host view of 5 steps of the first compiled mode (CPU time by op, inclusive and
self) goes to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import mok_torch as mok
from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks

ITERS = 20


def median_ms(fn, iters: int = ITERS) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, iters: int = 5) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph (after eager warm-up calls); the replay as a function."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b"])
    p.add_argument("--profile", default=None)
    p.add_argument("--host-profile", default=None)
    p.add_argument("--host-layers", default=None)
    p.add_argument("--timeline", default=None)
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--compiled-profile", default=None, help="with --compiled: the compiled steps' host profile")
    p.add_argument("--compiled-modes", default=",".join(COMPILED_MODES), help="with --compiled: which compiled steps")
    p.add_argument("--compiled-only", action="store_true", help="with --compiled: only the compiled steps")
    ns = p.parse_args()
    modes = [m for m in ns.compiled_modes.split(",") if m]
    unknown = sorted(set(modes) - set(COMPILED_MODES))
    if unknown:
        p.error(f"--compiled-modes: unknown {unknown}; known: {list(COMPILED_MODES)}")
    ranks = Ranks(torch.device("cuda", 0), None, 0, 1)
    report, report_host, report_layers, report_timeline = [], [], [], []
    for shape in resolve_shapes(",".join(ns.shapes), 1):
        call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
        for fused in (True,) if ns.compiled_only else (True, False):
            cfg = mok.MoKConfig(megakernel=fused)
            if ns.compiled_only:
                report.extend(compiled_steps(shape, call, cfg, modes, profile_to=ns.compiled_profile))
                continue
            path = "megakernel" if fused else "chain"

            def forward(cfg: mok.MoKConfig = cfg, call=call, T: int = shape.tokens) -> torch.Tensor:
                return mok.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, call.shared,
                               config=cfg, max_tokens=T)  # fmt: skip

            def forward_backward(forward=forward, call=call) -> None:
                call.drop_grads()
                forward().backward(call.dy_TH)

            for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
                fn()
                eager, host = median_ms(fn), host_ms(fn)
                try:
                    if name == "forward":
                        with torch.no_grad():
                            replay = f"{median_ms(graphed(fn)):7.3f} ms"
                    else:
                        replay = f"{median_ms(graphed(fn)):7.3f} ms"
                except Exception as exc:  # a capture that fails is reported, the probe goes on
                    replay = f"(capture failed: {type(exc).__name__}: {str(exc)[:80]})"
                line = f"{shape.name:16s} {path:10s} {name:16s} eager {eager:7.3f} ms graph {replay} host {host:.3f} ms"
                print(line, flush=True)
                report.append(line)
            if ns.profile:
                from torch.profiler import ProfilerActivity, profile

                forward_backward()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    forward_backward()
                    torch.cuda.synchronize()
                report.append(f"\n== {shape.name} {path}: one forward + backward\n")
                report.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                report.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
            if ns.host_profile and fused:
                report_host.append(host_profile(shape.name, forward, forward_backward))
            if ns.host_layers and fused:
                report_layers.extend(host_layers(shape, call, cfg))
            if ns.timeline and fused:
                report_timeline.extend(timeline(shape.name, forward_backward))
                report_timeline.extend(timeline(shape.name, forward_backward, warm=WARM_CALLS))
            if ns.compiled and fused:
                report.extend(compiled_steps(shape, call, cfg, modes, profile_to=ns.compiled_profile))
    if ns.profile:
        with open(ns.profile, "w") as f:
            f.write("\n".join(report))
    if ns.host_profile:
        with open(ns.host_profile, "w") as f:
            f.write("\n".join(report_host))
    if ns.timeline:
        with open(ns.timeline, "w") as f:
            f.write("\n".join(report_timeline) + "\n")
    if ns.host_layers:
        with open(ns.host_layers, "w") as f:
            f.write("\n".join(report_layers) + "\n")
        print("\n".join(report_layers), flush=True)


class _RoutedLayer(torch.nn.Module):
    """The call's routed experts as parameters (their storage) and its routing as buffers: what a
    model holds, so that a compiled step's CUDA graphs read the weights where they are."""

    def __init__(self, call, cfg: mok.MoKConfig) -> None:
        super().__init__()
        self.cfg, self.T = cfg, call.x_TH.shape[0]
        self.wg, self.wu, self.wd = (torch.nn.Parameter(w.detach()) for w in call.routed)
        self.register_buffer("top", call.top_experts_TK)
        self.register_buffer("w", call.router_weights_TK.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mok.moe(x, self.top, self.w, (self.wg, self.wu, self.wd), None, config=self.cfg, max_tokens=self.T)


COMPILED_MODES = ("cudagraphs", "static", "reduce-overhead")


def _compile(layer: _RoutedLayer, x: torch.Tensor, mode: str):
    """The layer compiled as `mode` says (COMPILED_MODES, the module docstring)."""
    if mode == "reduce-overhead":
        return torch.compile(layer, mode="reduce-overhead")
    if mode == "static":
        for t in (*layer.parameters(), *layer.buffers(), x):
            torch._dynamo.mark_static_address(t)
    return torch.compile(layer, backend="cudagraphs")


def compiled_steps(shape, call, cfg: mok.MoKConfig, modes: list[str], iters: int = 20,
                   profile_to: str | None = None) -> list[str]:  # fmt: skip
    """A training step (forward, backward, the gradients kept) eager and compiled in each of
    `modes`: from an idle device, its host time, back to back; with `profile_to`, torch.profiler's
    CPU tables of 5 steps of the first mode appended to that file."""
    if call.shared is not None:
        return [f"{shape.name:16s} compiled: skipped (a shared expert: the probe holds the routed experts only)"]

    def step(run) -> tuple[torch.Tensor, list[torch.Tensor]]:
        _, layer, module, x = run
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if module is not layer:
            torch.compiler.cudagraph_mark_step_begin()
        y = module(x)
        y.backward(call.dy_TH)
        return y, [t.grad for t in (x, layer.wg, layer.wu, layer.wd)]

    eager_layer = _RoutedLayer(call, cfg)
    eager = ("eager", eager_layer, eager_layer, call.x_TH.detach().clone().requires_grad_())
    y_eager, g_eager = step(eager)
    y_eager, g_eager = y_eager.detach().clone(), [g.clone() for g in g_eager]
    lines = []
    for i, mode in enumerate(["eager", *modes]):
        if i == 0:
            run = eager
        else:
            # Each mode its own module and x (the same weights' storage) and a fresh Dynamo, so
            # that no mode's marks or compiled frames serve another.
            torch._dynamo.reset()
            layer, x = _RoutedLayer(call, cfg), call.x_TH.detach().clone().requires_grad_()
            run = (mode, layer, _compile(layer, x, mode), x)
        try:
            for _ in range(3):  # cudagraph trees: a warm-up step, then the recording
                step(run)
        except Exception as exc:  # a mode that does not compile is reported, the probe goes on
            lines.append(f"{shape.name:16s} step {mode:15s} failed: {type(exc).__name__}: {str(exc)[:160]}")
            print(lines[-1], flush=True)
            continue
        y, g = step(run)
        same = torch.equal(y, y_eager) and all(torch.equal(a, b) for a, b in zip(g, g_eager, strict=True))
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step(run)
        end.record()
        torch.cuda.synchronize()
        b2b = start.elapsed_time(end) / iters
        idle, host = median_ms(lambda r=run: step(r)), host_ms(lambda r=run: step(r), iters=iters)
        lines.append(f"{shape.name:16s} step {mode:15s} from idle {idle:7.3f} ms  back to back {b2b:7.3f} ms  "
                     f"host {host * 1e3:7.1f} us  bitwise the eager step: {'yes' if same else 'NO'}")  # fmt: skip
        print(lines[-1], flush=True)
        if profile_to and i == 1:
            _profile_steps(shape.name, mode, lambda r=run: step(r), profile_to)
    return lines


def _profile_steps(name: str, mode: str, step, path: str) -> None:
    """torch.profiler's host and device tables of 5 steps (the ops by input shape as well: which
    inputs cudagraph trees copy into the graphs' static buffers), then cProfile's, appended to
    `path`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    with open(path, "a") as f:
        f.write(f"== {name}: 5 compiled steps ({mode}), host and device\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        f.write(f"== {name}: the copies by input shape\n")
        by_shape = prof.key_averages(group_by_input_shape=True)
        f.write(by_shape.table(sort_by="cpu_time_total", row_limit=25, max_shapes_column_width=120) + "\n")
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(5):
        step()
    cp.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(cp, stream=out).sort_stats("cumulative").print_stats(45)
    with open(path, "a") as f:
        f.write(f"== {name}: 5 compiled steps ({mode}), cProfile (cumulative)\n{out.getvalue()}\n")


def host_layers(shape, call, cfg: mok.MoKConfig) -> list[str]:
    """Host ms of one forward (megakernel path) issued at each layer of mok's stack."""
    from mok_torch import functional as mok_functional
    from mok_torch.backends import resolve_backend

    T, H = call.x_TH.shape
    K = call.top_experts_TK.shape[1]
    El = call.routed[0].shape[0]
    bf16 = torch.bfloat16
    x, w = call.x_TH.detach().to(bf16), call.router_weights_TK.detach()
    routed = tuple(t.detach().to(bf16) for t in call.routed)
    shared = None if call.shared is None else tuple(t.detach().to(bf16) for t in call.shared)
    top = call.top_experts_TK
    ws = mok.get_workspace(cfg, None, device=x.device, max_tokens=T, hidden_size=H, topk=K, num_experts=El)
    backend = resolve_backend(cfg, ws.device)
    s = (None, None, None) if shared is None else shared
    top32 = top.to(torch.int32).contiguous()

    def moe() -> None:
        mok.moe(call.x_TH, top, call.router_weights_TK, call.routed, call.shared, config=cfg, max_tokens=T)

    def moe_no_grad() -> None:
        with torch.no_grad():
            mok.moe(x, top, w, routed, shared, config=cfg, max_tokens=T)

    def custom_ops() -> None:
        with torch.no_grad():
            sched = torch.ops.mok.build_schedule(top.contiguous(), "", T, H, El, cfg.key)
            torch.ops.mok.forward(x, w, *routed, *s, sched, top, "", T, cfg.key)

    def functional() -> None:
        sched = mok.build_schedule(ws, cfg, top)
        mok.forward(cfg, ws, sched, x, w, routed, shared)

    def fused_functional() -> None:
        mok_functional.schedule_and_forward(cfg, ws, top, x, w, routed, shared)

    def fused_backend() -> None:
        backend.schedule_and_forward(cfg, ws, top32, x, w, routed, shared)

    def backend_calls() -> None:
        sched = backend.build_schedule(ws, cfg, top32)
        backend.forward(cfg, ws, sched, x, w, routed, shared)

    sched = backend.build_schedule(ws, cfg, top32)

    def backend_forward() -> None:
        backend.forward(cfg, ws, sched, x, w, routed, shared)

    def empties() -> None:
        for _ in range(10):
            torch.empty(64, device=x.device)

    def moe_backward() -> None:
        call.drop_grads()
        y = mok.moe(call.x_TH, top, call.router_weights_TK, call.routed, call.shared, config=cfg, max_tokens=T)
        y.backward(call.dy_TH)

    rows = []
    layers = (
        ("mok.moe forward + backward", moe_backward),
        ("mok.moe (autograd)", moe),
        ("mok.moe (no_grad)", moe_no_grad),
        ("torch.ops.mok.build_schedule + forward", custom_ops),
        ("mok.build_schedule + mok.forward", functional),
        ("functional.schedule_and_forward (mok.moe's)", fused_functional),
        ("backend.schedule_and_forward", fused_backend),
        ("backend.build_schedule + forward", backend_calls),
        ("backend.build_schedule", lambda: backend.build_schedule(ws, cfg, top32)),
        ("backend.forward", backend_forward),
        ("10 x torch.empty (a yardstick)", empties),
    )
    for _, fn in layers:  # every layer warm before any is timed
        for _ in range(3):
            fn()
    for label, fn in layers:
        rows.append(f"{shape.name:16s} host {host_ms(fn, iters=30) * 1e3:8.1f} us  {label}")
    return rows


def host_profile(name: str, forward, forward_backward, calls: int = 50) -> str:
    """cProfile of `calls` forwards, then of `calls` forward + backwards, issued back to back."""
    out = []
    for label, fn in (("forward", forward), ("forward+backward", forward_backward)):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        host = (time.perf_counter() - t0) / calls * 1e3
        torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        out.append(f"== {name} {label}: {calls} calls, {host:.3f} ms of host time each under cProfile\n")
        out.append(text.getvalue())
    return "\n".join(out)


# The calls a sustained timeline issues back to back before the one it lists (timeline's warm).
WARM_CALLS = 19


def timeline(name: str, forward_backward, label: str = "megakernel", warm: int = 0) -> list[str]:
    """One eager forward + backward under torch.profiler: its kernels in the order they ran
    (start after the call's first host event, duration, the device idle before each), then the
    totals. `label`: what ran (the path, or a peer's name). warm = 0: from an idle device; warm
    = N: the call is the last of N + 1 issued back to back with no wait between them (as the
    bench's timed loop issues them, the device drawing its sustained power): only that last
    call's kernels are listed (each call launches the same kernels), its first kernel's idle
    measured from the end of the call before it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    forward_backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(warm + 1):
            forward_backward()
        torch.cuda.synchronize()
    events = prof.events()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not host or not kernels:
        return [f"== {name}: no events"]
    if len(kernels) % (warm + 1) != 0:
        return [f"== {name} {label}: {len(kernels)} kernels in {warm + 1} calls: not the same kernels each call"]
    per_call = len(kernels) // (warm + 1)
    before = kernels[:-per_call]
    kernels = kernels[-per_call:]
    if before:
        t0 = kernels[0].time_range.start
        end = max(k.time_range.end for k in before)
        when = f"the last of {warm + 1} calls issued back to back (us from its first kernel)"
    else:
        t0 = min(e.time_range.start for e in host)
        end = t0
        when = "one eager forward + backward from an idle device (us)"
    lines = [f"== {name} {label}: {when}",
             f"{'start':>9s} {'dur':>8s} {'idle before':>11s}  kernel"]  # fmt: skip
    idle = 0.0
    for k in kernels:
        gap = max(0.0, k.time_range.start - end)
        idle += gap
        lines.append(f"{k.time_range.start - t0:9.1f} {k.time_range.elapsed_us():8.1f} {gap:11.1f}  {k.name[:90]}")
        end = max(end, k.time_range.end)
    busy = sum(k.time_range.elapsed_us() for k in kernels)
    lines.append(f"first kernel at {kernels[0].time_range.start - t0:.1f} us; last ends at {end - t0:.1f} us; "
                 f"kernels {busy:.1f} us; device idle {idle:.1f} us (before the first kernel included)")  # fmt: skip
    print("\n".join(lines[-1:]), flush=True)
    return lines


def sustained_clocks(fn, iters: int = 40) -> str:
    """fn run `iters` times back to back (as the bench's timed loop runs it) while nvidia-smi
    samples the GPU every 50 ms: the SM clock and the power of the samples taken during the loop,
    as median and range (large GEMMs draw the board to its power limit, and the clock drops)."""
    import datetime
    import subprocess

    fn()
    torch.cuda.synchronize()
    query = ["nvidia-smi", "-i", str(torch.cuda.current_device()), "--query-gpu=timestamp,clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", "50"]  # fmt: skip
    with subprocess.Popen(query, stdout=subprocess.PIPE, text=True) as smi:
        time.sleep(1.0)  # nvidia-smi's start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = datetime.datetime.now()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        t1 = datetime.datetime.now()
        smi.terminate()
        text = smi.communicate()[0]
    samples = []
    for line in text.splitlines():
        try:
            stamp, mhz, watts = (v.strip() for v in line.split(","))
            when = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f")
            if t0 <= when <= t1:
                samples.append((float(mhz), float(watts)))
        except ValueError:
            continue
    ms = start.elapsed_time(end) / iters
    if not samples:
        return f"{ms:.3f} ms a call over {iters}; no nvidia-smi samples in the loop"
    mhz = sorted(s[0] for s in samples)
    watts = sorted(s[1] for s in samples)
    return (f"{ms:.3f} ms a call over {iters}; SM clock median {statistics.median(mhz):.0f} MHz "
            f"({mhz[0]:.0f}-{mhz[-1]:.0f}), power median {statistics.median(watts):.0f} W "
            f"({watts[0]:.0f}-{watts[-1]:.0f}), {len(samples)} samples")  # fmt: skip


if __name__ == "__main__":
    main()
