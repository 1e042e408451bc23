"""The bench's SonicMoE provider computes the layer mok computes: y, dx and the router-weight
gradient within bf16 tolerance of mok's, on the GPU (run before timing SonicMoE; its first call of a
shape also autotunes its GEMMs, so this warms the cache the bench then reads).

    python3 benchmarks/probes/sonicmoe_check.py [shape ...] [--profile FILE]   (default: qwen3-30b-a3b)

With --profile, after each shape's check: for mok and SonicMoE in turn, one eager forward + backward
kernel by kernel (layer_time.py's timeline) into FILE, and the clock and power the GPU ran at over
forwards, then forward + backwards back to back (layer_time.py's sustained_clocks), printed.

Exit status 1 when a figure is off (or SonicMoE is not importable).
"""

from __future__ import annotations

import sys
import time

import torch

from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.providers import MokProvider, Settings, SonicMoEProvider
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def main(names: list[str], profile: str | None = None) -> int:
    ranks = Ranks(torch.device("cuda", 0), None, 0, 1)
    settings = Settings(allow_slow=False)
    ok = True
    report: list[str] = []
    for shape in resolve_shapes(",".join(names or ["qwen3-30b-a3b"]), 1):
        sonic, mok = SonicMoEProvider(), MokProvider("mok", "auto", "bf16")
        why = sonic.unavailable(shape, ranks, settings)
        if why is not None:
            print(f"{shape.name}: sonicmoe unavailable: {why}")
            return 1
        call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
        out = {}
        for provider in (mok, sonic):
            t0 = time.perf_counter()
            call.drop_grads()
            y = provider.prepare(call, ranks, settings)()
            y.backward(call.dy_TH)
            torch.cuda.synchronize()
            out[provider.name] = (y.detach().clone(), call.x_TH.grad.clone(), call.router_weights_TK.grad.clone())
            print(f"{shape.name}: {provider.name} first forward+backward {time.perf_counter() - t0:.1f} s")
        for i, what in enumerate(("y", "dx", "d_router_weights")):
            err = rel_l2(out["sonicmoe"][i], out["mok"][i])
            good = err <= 2e-2 and bool(torch.isfinite(out["sonicmoe"][i]).all())
            ok &= good
            print(f"{shape.name}: sonicmoe vs mok {what}: relative L2 {err:.2e} {'ok' if good else 'OFF'}")
        if profile is not None:
            report.extend(profile_providers(shape.name, call, (mok, sonic), ranks, settings))
    if profile is not None:
        with open(profile, "w") as f:
            f.write("\n".join(report) + "\n")
    return 0 if ok else 1


def profile_providers(name: str, call, providers, ranks: Ranks, settings: Settings) -> list[str]:
    """Each provider's kernels (one eager forward + backward) and its clocks under load."""
    from layer_time import WARM_CALLS, sustained_clocks, timeline

    lines = []
    for provider in providers:
        forward = provider.prepare(call, ranks, settings)

        def forward_backward(forward=forward) -> None:
            call.drop_grads()
            forward().backward(call.dy_TH)

        lines.extend(timeline(name, forward_backward, label=provider.name))
        # The same call as the last of WARM_CALLS + 1 back to back (the bench's loop): which
        # kernels slow down under sustained load.
        lines.extend(timeline(name, forward_backward, label=provider.name, warm=WARM_CALLS))
        for label, fn in (("forward", forward), ("forward+backward", forward_backward)):
            clocks = f"{name} {provider.name} {label}: {sustained_clocks(fn)}"
            print(clocks, flush=True)
            lines.append(clocks)
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*")
    parser.add_argument("--profile", metavar="FILE")
    args = parser.parse_args()
    sys.exit(main(args.shapes, args.profile))
