"""`mok bench-experts`: the BF16 expert GEMMs' component benchmark (issue 4, docs/benchmarks.md).

For every shape, on one GPU, the routed SwiGLU experts' forward over the rows one rank
receives (T * K rows, `--routing` balanced or skewed over its El local experts, each
expert's rows rounded up to 16 as the schedule's alignment does) with:

- `mok`: mok-bf16's grouped forward (sm_90a wgmma: gate+up with the SwiGLU epilogue, then
  down), its gate+up GEMM alone (`mok-gate-up`), and that GEMM writing a and b only
  (`mok-gate-up-ab`: the difference is what the SwiGLU in the epilogue costs);
- `torch-grouped-mm`: `torch._grouped_mm` for gate, up and down with `silu(gate) * up`
  between;

and forward + backward (unweighted rows, so both compute the same gradients):

- `mok-fwd-bwd`: the grouped forward, then mok-bf16's grouped backward (g = dy @ Wd with the
  SwiGLU backward and d_w, dx, and the three weight gradients in bf16, as a layer call with one
  macrobatch hands them out);
  `mok-bwd`: the backward alone;
- `torch-fwd-bwd`: the `torch._grouped_mm` forward and its autograd backward
  (`torch.autograd.grad` of x and the three weights);

Each provider's iterations are timed in turns with the others' (iteration i of every provider
before iteration i + 1 of any): the H200's power cap engages after seconds of load, and timed
one after another the providers would not see the same clocks (NOTES.md, session 8).

It reports ms and TFLOP/s (6 * rows * H * I for the forward, 12 for the backward) against the
dense BF16 matmul rate measured in the same run, mok's speedups, whether two mok runs gave the
same bits, and mok's relative differences from torch's output and gradients.

    mok bench-experts --out DIR [--shapes seed|public|all|...] [--ep 8] [--routing balanced,skewed]

Seed slices keep their E/64 local experts; public models get E / --ep of them.
Writes `<out>/<date>_<device>_experts.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..backends.native.grouped import grouped_backward, grouped_forward
from . import ceilings as ceilings_mod
from . import report
from .launch import component_parser, one_device_main
from .providers import GROUP_ALIGN
from .shapes import Shape, resolve_shapes
from .timing import Ranks, median, time_in_turns

BF16 = torch.bfloat16
PROVIDERS = ("mok", "mok-gate-up", "mok-gate-up-ab", "torch-grouped-mm", "mok-fwd-bwd", "mok-bwd", "torch-fwd-bwd")


def segment_sizes(shape: Shape, El: int, routing: str, g: torch.Generator) -> list[int]:
    """Rows per local expert for T * K routed rows, each rounded up to GROUP_ALIGN."""
    rows = shape.tokens * shape.topk
    if routing == "skewed":  # Zipf over experts: the hottest gets several times the mean
        p = 1.0 / torch.arange(1, El + 1, dtype=torch.float64)
    else:
        p = torch.ones(El, dtype=torch.float64)
    picks = torch.multinomial(p / p.sum(), rows, replacement=True, generator=g)
    counts = torch.bincount(picks, minlength=El)
    return [-(-int(n) // GROUP_ALIGN) * GROUP_ALIGN for n in counts.tolist()]


def torch_grouped_mm(x, offs32, wg, wu, wd):
    gate = torch._grouped_mm(x, wg.transpose(-2, -1), offs=offs32)
    up = torch._grouped_mm(x, wu.transpose(-2, -1), offs=offs32)
    return torch._grouped_mm(F.silu(gate) * up, wd.transpose(-2, -1), offs=offs32)


class CaseInputs(NamedTuple):
    """One case's rows and weights (bf16), segment ends and offsets, and its result row's header."""

    x: torch.Tensor  # [M, H]
    wg: torch.Tensor  # [El, I, H]
    wu: torch.Tensor  # [El, I, H]
    wd: torch.Tensor  # [El, H, I]
    ends: torch.Tensor  # [El] int64, cumulative
    offsets: torch.Tensor  # [El + 1] int64
    row: dict[str, Any]


def case_inputs(ranks: Ranks, shape: Shape, El: int, routing: str, g: torch.Generator) -> CaseInputs:
    """The inputs every provider of an expert-GEMM benchmark gets for one shape and routing."""
    H, I = shape.hidden, shape.inner
    sizes = segment_sizes(shape, El, routing, torch.Generator().manual_seed(len(shape.name) + El))
    M = sum(sizes)
    dev = ranks.device
    x = torch.randn(M, H, device=dev, generator=g).to(BF16)
    wg = (torch.randn(El, I, H, device=dev, generator=g) / H**0.5).to(BF16)
    wu = (torch.randn(El, I, H, device=dev, generator=g) / H**0.5).to(BF16)
    wd = (torch.randn(El, H, I, device=dev, generator=g) / I**0.5).to(BF16)
    ends = torch.tensor(sizes, device=dev).cumsum(0)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), ends])
    row: dict[str, Any] = {
        "shape_name": shape.name,
        "routing": routing,
        "local_experts": El,
        "hidden": H,
        "inner": I,
        "rows": M,
        "rows_per_expert": {"min": min(sizes), "max": max(sizes)},
        "flops_forward": 6 * M * H * I,
    }
    return CaseInputs(x, wg, wu, wd, ends, offsets, row)


Provider = tuple[str, Callable[[], Any], int]  # name, the call, its flops


def time_providers(ranks: Ranks, providers: Sequence[Provider], ns: argparse.Namespace) -> dict[str, dict]:
    """Each provider's result entry: median ms and TFLOP/s over ns.iters iterations taken in
    turns with the others' (timing.time_in_turns: the device's power state drifts alike for
    every provider), or the error of one that failed (reported, not dropped)."""
    timed = time_in_turns(ranks, {name: fn for name, fn, _ in providers}, iters=ns.iters, warmup=ns.warmup)
    entries: dict[str, dict] = {}
    for name, _, flops in providers:
        got = timed[name]
        if isinstance(got, Exception):
            entries[name] = {"status": "failed", "why": ceilings_mod.describe_error(got)}
        elif not got:
            entries[name] = {"status": "failed", "why": "no timed iterations"}
        else:
            ms = median(got)
            entries[name] = {"status": "ok", "ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12}
    return entries


def run_config(ns: argparse.Namespace) -> dict[str, Any]:
    """The options an expert-GEMM benchmark's JSON records (its providers timed in turns)."""
    return {"shapes": ns.shapes, "ep": ns.ep, "routing": ns.routing, "iters": ns.iters, "warmup": ns.warmup,
            "timing": "providers in turns"}  # fmt: skip


def _case(ranks: Ranks, shape: Shape, El: int, routing: str, ns: argparse.Namespace, g: torch.Generator) -> dict:
    x, wg, wu, wd, ends, offsets, row = case_inputs(ranks, shape, El, routing, g)
    H, I, M, dev = shape.hidden, shape.inner, x.shape[0], ranks.device
    dy = torch.randn(M, H, device=dev, generator=g).to(BF16)
    # The weight gradients as a one-macrobatch layer call hands them out: bf16, from +0.
    wgrads = (torch.empty_like(wg), torch.empty_like(wu), torch.empty_like(wd))
    flops = row["flops_forward"]

    def ours() -> Any:
        return grouped_forward(x, offsets, wg, wu, wd)

    def ours_gate_up() -> Any:
        return grouped_forward(x, offsets, wg, wu, None)

    def ours_gate_up_ab() -> Any:  # the same GEMM without h: what the SwiGLU epilogue costs
        return grouped_forward(x, offsets, wg, wu, None, with_h=False)

    def theirs() -> Any:
        return torch_grouped_mm(x, ends.to(torch.int32), wg, wu, wd)

    saved = ours()

    def ours_backward() -> Any:
        return grouped_backward(x, offsets, saved.a, saved.b, dy, None, wg, wu, wd, None, carry_in=False,
                                wgrad_out=wgrads)  # fmt: skip

    def ours_fwd_bwd() -> Any:
        f = ours()
        b = grouped_backward(x, offsets, f.a, f.b, dy, None, wg, wu, wd, None, carry_in=False, wgrad_out=wgrads)
        return (b.dx, *wgrads)

    leaves = [t.detach().requires_grad_() for t in (x, wg, wu, wd)]

    def theirs_fwd_bwd() -> Any:
        y = torch_grouped_mm(leaves[0], ends.to(torch.int32), *leaves[1:])
        return torch.autograd.grad(y, leaves, dy)

    providers = (
        ("mok", ours, flops),
        ("mok-gate-up", ours_gate_up, 4 * M * H * I),
        ("mok-gate-up-ab", ours_gate_up_ab, 4 * M * H * I),
        ("torch-grouped-mm", theirs, flops),
        ("mok-fwd-bwd", ours_fwd_bwd, 3 * flops),
        ("mok-bwd", ours_backward, 2 * flops),
        ("torch-fwd-bwd", theirs_fwd_bwd, 3 * flops),
    )
    row.update(time_providers(ranks, providers, ns))
    if row["mok"]["status"] == "ok":
        first, second = ours(), ours()
        row["mok"]["bitwise_repeatable"] = all(torch.equal(u, v) for u, v in zip(first, second, strict=True))
        if row["torch-grouped-mm"]["status"] == "ok":
            ref = theirs().float()
            row["mok"]["rel_diff_vs_torch"] = ((first.y.float() - ref).norm() / ref.norm()).item()
            row["speedup_vs_torch"] = row["torch-grouped-mm"]["ms"] / row["mok"]["ms"]
    if row["mok-fwd-bwd"]["status"] == "ok":
        first = [t.clone() for t in ours_fwd_bwd()]
        second = ours_fwd_bwd()
        row["mok-fwd-bwd"]["bitwise_repeatable"] = all(torch.equal(u, v) for u, v in zip(first, second, strict=True))
        if row["torch-fwd-bwd"]["status"] == "ok":
            dx, dwg, dwu, dwd = (t.float() for t in theirs_fwd_bwd())
            ours_grads = tuple(t.float() for t in first)
            row["mok-fwd-bwd"]["rel_diff_vs_torch"] = {
                name: ((u - v).norm() / v.norm()).item()
                for name, u, v in zip(("dx", "dWg", "dWu", "dWd"), ours_grads, (dx, dwg, dwu, dwd), strict=True)
            }
            row["fwd_bwd_speedup_vs_torch"] = row["torch-fwd-bwd"]["ms"] / row["mok-fwd-bwd"]["ms"]
    return row


Case = Callable[[Ranks, Shape, int, str, argparse.Namespace, torch.Generator], dict]


def each_case(ns: argparse.Namespace, ranks: Ranks, case: Case) -> list[dict[str, Any]]:
    """case(ranks, shape, local experts, routing, ns, generator) for every shape and routing asked
    for (a row each; shapes that cannot run: a skipped row with the reason)."""
    results: list[dict[str, Any]] = []
    g = torch.Generator(device=ranks.device).manual_seed(0)
    for shape in resolve_shapes(ns.shapes, ns.ep):
        if shape.skip:
            results.append({"shape_name": shape.name, "status": "skipped", "why": shape.skip})
            continue
        for routing in ns.routing.split(","):
            results.append(case(ranks, shape, shape.experts // shape.world, routing, ns, g))
            torch.cuda.empty_cache()
    return results


def bench(ns: argparse.Namespace, ranks: Ranks) -> dict[str, Any]:
    mm = ceilings_mod.bf16_matmul(ranks) if ranks.cuda else None  # the CPU run checks the plumbing only
    results = each_case(ns, ranks, _case)
    for row in results:
        for name in PROVIDERS:
            if name in row and row[name]["status"] == "ok" and mm is not None and mm.value:
                row[name]["fraction_of_dense"] = row[name]["TFLOPs"] / mm.value
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    device = report.device_info(ranks.device)
    doc = {
        "schema": "mok-bench-experts/1",
        "created": created,
        "device": device,
        "versions": report.versions(),
        "git": report.git_state(),
        "command": " ".join(["mok", "bench-experts", *ns.argv]),
        "config": run_config(ns),
        "ceilings": {"bf16_matmul": None if mm is None else mm.asdict()},
        "results": results,
    }
    _print(doc)
    report.write_component(doc, ns.out, "experts")
    return doc


def _print(doc: dict[str, Any]) -> None:
    mm = (doc["ceilings"]["bf16_matmul"] or {}).get("value")
    print(f"\nmok bench-experts: {doc['device']['name']}, dense bf16 {mm or 0:.0f} TFLOP/s (TFLOP/s)")
    print(
        f"{'shape':<20}{'routing':<9}{'rows':>7}{'mok':>7}{'gate-up':>8}{'g-u ab':>7}{'torch':>7}{'x':>6}"
        f"{'mok f+b':>8}{'bwd':>6}{'torch':>7}{'x':>6}  same bits"
    )
    for r in doc["results"]:
        if r.get("status") == "skipped":
            print(f"{r['shape_name']:<20}skipped: {r['why']}")
            continue
        cells = [f"{r[n]['TFLOPs']:.0f}" if r[n]["status"] == "ok" else "fail" for n in PROVIDERS]
        speed = f"{r['speedup_vs_torch']:.2f}" if "speedup_vs_torch" in r else "-"
        speed_fb = f"{r['fwd_bwd_speedup_vs_torch']:.2f}" if "fwd_bwd_speedup_vs_torch" in r else "-"
        same = f"{r['mok'].get('bitwise_repeatable', '-')}/{r['mok-fwd-bwd'].get('bitwise_repeatable', '-')}"
        head = f"{r['shape_name']:<20}{r['routing']:<9}{r['rows']:>7}"
        fwd = f"{cells[0]:>7}{cells[1]:>8}{cells[2]:>7}{cells[3]:>7}{speed:>6}"
        print(f"{head}{fwd}{cells[4]:>8}{cells[5]:>6}{cells[6]:>7}{speed_fb:>6}  {same}")


def expert_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options of the expert-GEMM benchmarks (`mok bench-experts`, `mok bench-mxfp8`)."""
    p = component_parser(prog, description, iters=20, warmup=3)
    p.set_defaults(shapes="all")
    p.add_argument("--ep", type=int, default=8, help="EP degree that sizes the public models' local experts")
    p.add_argument("--routing", default="balanced,skewed", help="comma list of routings (default %(default)s)")
    return p


def parser() -> argparse.ArgumentParser:
    return expert_parser("mok bench-experts", __doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    return one_device_main(parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
