"""dWd gathering dy by route against dWd reading the g GEMM's table-ordered copy of dy, one shape at
a time, on the same build: the backward's kernels as the layer at one rank runs them (dy given by
token, each table row's route, bf16 weight gradients from +0), with `dwd_gather` 0 and 1. With
--dw1: dWd as the device's default, and dW1 in modes 0-2 instead (`dw1_mode` 0: [d_a, d_b]^T x
from x's table-ordered rows; 1: x^T [d_a, d_b] stored transposed; 2: as 1 with x gathered by route
from the token rows, as the forward's megakernel would then not store them; --modes= for others,
3 in a build with the measured, not merged, dw1-gather-b.patch). --rounds=N: the modes in turns
N times (default 1). With --fp32: the weight gradients into fp32 accumulators (from +0, no bf16
rounding: fp32 parameters' path) instead of bf16.

    python3 benchmarks/probes/dwd_gather.py [shape ...] [--ncu] [--dw1] [--modes=0,1,2] [--fp32] [--rounds=N]

Prints, per shape and mode, each kernel's mean time under torch.profiler and the call's time by
CUDA events back to back. With --ncu: each mode's backward once (after one warm-up call, which
ncu's `--launch-skip` can pass over), for `ncu --kernel-name regex:"wgrad|grouped_gemm"`: the g
GEMM, dWd, dW1 and dx of mode 0, then of mode 1. Routing: each token's K experts drawn without
repetition (balanced in expectation), each expert's segment padded to 128 rows. Not part of any
package; NOTES.md records what it showed.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from experts_kernels import short

from mok_torch.backends.native.grouped import grouped_backward
from mok_torch.bench.shapes import resolve_shapes

BF16 = torch.bfloat16
ALIGN = 128
ITERS = 5


def problem(T: int, H: int, I: int, E: int, K: int, dev: str = "cuda", fp32: bool = False) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    experts = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices.flatten()  # route t*K+k
    order = torch.sort(experts, stable=True).indices  # routes in expert order
    counts = torch.bincount(experts, minlength=E).tolist()
    padded = [-(-c // ALIGN) * ALIGN for c in counts]
    M = sum(padded)
    route = torch.full((M,), -1, dtype=torch.int32, device=dev)
    at, src = 0, 0
    for c, pc in zip(counts, padded, strict=True):
        route[at : at + c] = order[src : src + c].to(torch.int32)
        at, src = at + pc, src + c
    offsets = torch.tensor([0, *padded], device=dev).cumsum(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    x_tokens = rnd(T, H).to(BF16)  # x's rows in table order: these by route, zeros for padding
    x = torch.where(
        (route >= 0)[:, None], x_tokens[route.clamp(min=0).long() // K], torch.zeros((), dtype=BF16, device=dev)
    )
    return dict(
        x=x, x_tokens=x_tokens, a=rnd(M, I).to(BF16), b=rnd(M, I).to(BF16),
        dy=torch.empty(M, H, dtype=BF16, device=dev),
        w=torch.rand(T * K, device=dev, generator=g), wg=(rnd(E, I, H) / H**0.5).to(BF16),
        wu=(rnd(E, I, H) / H**0.5).to(BF16), wd=(rnd(E, H, I) / I**0.5).to(BF16), offsets=offsets,
        route=route, tokens=rnd(T, H).to(BF16), fp32=fp32,
        out=tuple(torch.empty(s, dtype=torch.float32 if fp32 else BF16, device=dev)
                  for s in ((E, I, H), (E, I, H), (E, H, I))),
    )  # fmt: skip


def backward(d: dict, mode: int, dw1: bool = False) -> None:
    """One backward: dwd_gather=mode, or with dw1 the default dWd and dw1_mode=mode."""
    modes = dict(dw1_mode=mode, x_tokens=d["x_tokens"] if mode in (2, 3) else None) if dw1 else dict(dwd_gather=mode)
    acc, out = (d["out"], None) if d["fp32"] else (None, d["out"])
    grouped_backward(d["x"], d["offsets"], d["a"], d["b"], d["dy"], d["w"], d["wg"], d["wu"], d["wd"], acc,
                     carry_in=False, wgrad_out=out, weight_route=d["route"], dy_tokens=d["tokens"],
                     **modes)  # fmt: skip


def main(argv: list[str]) -> None:
    names = [a for a in argv if not a.startswith("--")] or ["sonic-7b"]
    ncu = "--ncu" in argv
    dw1 = "--dw1" in argv
    fp32 = "--fp32" in argv
    rounds = next((int(a.split("=")[1]) for a in argv if a.startswith("--rounds=")), 1)
    modes, label = ((0, 1, 2), "dw1_mode") if dw1 else ((0, 1), "dwd_gather")
    # --modes: others (3: a build with dw1-gather-b.patch, in git history at b29b6d9)
    modes = next((tuple(int(m) for m in a.split("=")[1].split(",")) for a in argv if a.startswith("--modes=")), modes)
    for shape in resolve_shapes(",".join(names), 1):
        d = problem(shape.tokens, shape.hidden, shape.inner, shape.experts, shape.topk, fp32=fp32)
        M = d["x"].shape[0]
        if ncu:
            backward(d, 0, dw1)
            torch.cuda.synchronize()
            for mode in modes:
                backward(d, mode, dw1)
            torch.cuda.synchronize()
            print(f"{shape.name}: rows {M}, {label} {modes} profiled in turn")
            continue
        digests = []
        for mode in modes * rounds:
            for _ in range(2):
                backward(d, mode, dw1)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(ITERS):
                    backward(d, mode, dw1)
                torch.cuda.synchronize()
            events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                            key=lambda ev: ev.time_range.start)  # fmt: skip
            names = [short(ev.name) for ev in events]
            per: dict[str, float] = {}  # a kernel launched n times a call: its n launches apart
            seen: dict[str, int] = {}
            for ev, name in zip(events, names, strict=True):
                n = names.count(name) // ITERS
                key = f"{name}#{seen.get(name, 0) % n}" if n > 1 else name
                seen[name] = seen.get(name, 0) + 1
                per[key] = per.get(key, 0.0) + ev.device_time / ITERS
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                backward(d, mode, dw1)
            end.record()
            torch.cuda.synchronize()
            bits = torch.int32 if fp32 else torch.int16
            digests.append(tuple(t.view(bits).sum(dtype=torch.int64).item() for t in d["out"]))
            kernels = "  ".join(
                f"{k.replace(' ', '')[:40]}={v:.0f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])
            )
            kind = " fp32" if fp32 else ""
            print(f"{shape.name} rows {M} {label}={mode}{kind}: {start.elapsed_time(end) * 100:.0f} us a backward "
                  f"back to back; kernels (us): {kernels}", flush=True)  # fmt: skip
        same = all(d == digests[0] for d in digests)
        print(f"{shape.name}: weight gradients' checksums {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main(sys.argv[1:])
