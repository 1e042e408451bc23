"""A forward that no backward follows against the same forward through autograd: what mok.moe saves
when no gradient can be asked for (it keeps no context: on the megakernel's path the launch stores
no routed x rows, a or b; ops.run_forward_only).

    python3 benchmarks/probes/forward_only.py [shape ...] [--iters N] [--out FILE.json]

Per shape (bench names; default sonic-7b, qwen3-30b-a3b, deepseek-v3-e32), balanced routing, the
default config, the bench's inputs (x and the weights require gradients):

- "autograd": the bench's forward, `mok.moe(...)` with autograd on (the context kept);
- "no_grad": the same call under `torch.no_grad()`.

Each is timed with the bench's helpers: the median of --iters iterations from an idle device, the
two taken in balanced turns (timing.time_in_turns), the time per call of 10 calls issued back to
back (the median of 8 rounds, the two's rounds in turns: timing.back_to_back_in_turns), and its
peak memory above what was allocated before the call. Prints a table; --out writes the figures as
JSON (schema "mok-probe-forward-only/1").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import mok_torch as mok
from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.report import device_info, git_state, versions
from mok_torch.bench.runner import peak_mib
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks, back_to_back_in_turns, median, time_in_turns

DEFAULT_SHAPES = ("sonic-7b", "qwen3-30b-a3b", "deepseek-v3-e32")
B2B_ROUNDS = 8


def measure(shape_name: str, ranks: Ranks, iters: int) -> dict[str, Any]:
    shape = resolve_shapes(shape_name, 1)[0]
    call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
    cfg = mok.MoKConfig()

    def autograd() -> torch.Tensor:
        return mok.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, call.shared,
                       config=cfg, max_tokens=shape.tokens)  # fmt: skip

    def no_grad() -> torch.Tensor:
        with torch.no_grad():
            return autograd()

    runs = {"autograd": autograd, "no_grad": no_grad}
    assert torch.equal(autograd().detach(), no_grad()), "the two give different bits"
    timed = time_in_turns(ranks, runs, iters=iters, warmup=5)
    b2b = back_to_back_in_turns(ranks, runs, rounds=B2B_ROUNDS)
    row: dict[str, Any] = {"shape": shape.describe()}
    for name, fn in runs.items():
        times, per_call = timed[name], b2b[name]
        if isinstance(times, Exception):
            raise times
        if isinstance(per_call, Exception):
            raise per_call
        row[name] = {
            "ms": median(times),
            "times_ms": times,
            "back_to_back_ms": per_call,
            "peak_mib": peak_mib(ranks, fn, call),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="*", default=list(DEFAULT_SHAPES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    ranks = Ranks(torch.device("cuda", 0) if cuda else torch.device("cpu"), None, 0, 1)
    rows = [measure(name, ranks, args.iters) for name in args.shapes]
    lines = [f"{'shape':18s} {'median ms autograd / no_grad':>30s} {'back to back ms':>22s} {'peak MiB':>16s}"]
    for r in rows:
        a, n = r["autograd"], r["no_grad"]
        peaks = "-" if a["peak_mib"] is None else f"{a['peak_mib']:.0f} / {n['peak_mib']:.0f}"
        b2b_a, b2b_n = a["back_to_back_ms"], n["back_to_back_ms"]
        lines.append(
            f"{r['shape']['name']:18s} {a['ms']:13.3f} / {n['ms']:7.3f} ({a['ms'] / n['ms']:.2f}x)"
            f" {b2b_a:8.3f} / {b2b_n:7.3f} ({b2b_a / b2b_n:.2f}x) {peaks:>16s}"
        )
    print("\n".join(lines))
    if args.out is not None:
        report = {
            "schema": "mok-probe-forward-only/1",
            "device": device_info(ranks.device),
            "versions": versions(),
            "git": git_state(),
            "command": " ".join(["python3", *sys.argv]),
            "results": rows,
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
