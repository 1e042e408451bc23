#!/usr/bin/env python3
"""Regenerate the README's performance tables from the committed benchmark results.

    python benchmarks/readme_table.py            # rewrite README.md in place
    python benchmarks/readme_table.py --check    # exit 1 if README.md is out of date

Reads every JSON that `mok bench` wrote under benchmarks/results/, keeps the latest result
per (device, EP size, precision, shape, routing, provider) and writes the table between
the markers `<!-- bench-table:start -->` and `<!-- bench-table:end -->`. Only GPU runs
that are not `--quick` smoke runs count, and not runs marked `"not_on_main"` (code that did not
land), unless `--all-runs`. The component benchmarks get
a table each from their latest GPU run: `mok bench-experts` between
`<!-- experts-table:start/end -->`, `mok bench-mxfp8` between `<!-- mxfp8-table:... -->`,
`mok bench-quantize` between `<!-- quantize-table:... -->`
(a README without those markers is left without them). Numbers are never typed by hand: edit
the results, then run this.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mok_torch.bench.report import markdown_table

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- bench-table:start -->"
END = "<!-- bench-table:end -->"
SCHEMA = "mok-bench-layer/1"
LEADING = (("device", "_device"), ("EP", "_world"), ("precision", "_precision"))


def _reports(results: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(path, JSON object) of every JSON file under `results`, by path."""
    out = []
    for path in sorted(results.rglob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"readme_table: cannot read {path}: {exc}") from exc
        if isinstance(report, dict):
            out.append((path, report))
    return out


def load_runs(results: Path, all_runs: bool) -> list[tuple[dict[str, Any], Path]]:
    """(report, path) of every benchmark JSON under `results`, oldest first."""
    runs = []
    for path, report in _reports(results):
        if report.get("schema") != SCHEMA:
            continue
        if not all_runs and (report["device"]["type"] != "cuda" or report["config"].get("quick")):
            continue
        # The table compares with torch-a2a measured in the same run: a run without it (a study of
        # mok's own settings, such as the transfer directions) stays in its file, out of the table.
        if not all_runs and "torch-a2a" not in report["config"].get("providers", ["torch-a2a"]):
            continue
        # A run of code that did not land on main (noted after the run, in a top-level
        # "not_on_main" saying why) stays in its file: the table shows the code of main.
        if not all_runs and report.get("not_on_main"):
            continue
        runs.append((report, path))
    runs.sort(key=lambda rp: (rp[0]["created"], rp[1].name))
    return runs


def latest_rows(runs: list[tuple[dict[str, Any], Path]]) -> tuple[list[dict[str, Any]], list[Path]]:
    """The latest row per key, sorted, and the files they come from."""
    latest: dict[tuple, tuple[dict[str, Any], Path]] = {}
    for report, path in runs:
        for row in report["results"]:
            extended = dict(
                row,
                _device=report["device"]["name"],
                _world=report["world_size"],
                _precision=row.get("precision", report["config"]["precision"]),
                _created=report["created"],
            )
            key = (
                extended["_device"],
                extended["_world"],
                extended["_precision"],
                row["shape"]["name"],
                row["routing"],
                row["provider"],
            )
            latest[key] = (extended, path)
    # A skip (its reason is a fact about the code of its run) gives way once a newer run has
    # measured the same provider on the same shape, under any routing.
    measured_at: dict[tuple, str] = {}
    for k, (row, _) in latest.items():
        if row.get("status") != "skipped":
            case = k[:4] + k[5:]
            measured_at[case] = max(measured_at.get(case, ""), row["_created"])
    keys = sorted(
        k
        for k, (row, _) in latest.items()
        if row.get("status") != "skipped" or measured_at.get(k[:4] + k[5:], "") <= row["_created"]
    )
    rows = [latest[k][0] for k in keys]
    sources = sorted({latest[k][1] for k in keys}, key=lambda p: p.name)
    return rows, sources


def render(rows: list[dict[str, Any]], sources: list[Path], root: Path) -> str:
    """The measured rows as a table; skipped cases folded into one line per (provider, reason)."""
    if not rows:
        return "_No GPU benchmark results are committed yet._"
    names = []
    for p in sources:
        try:
            names.append(f"`{p.resolve().relative_to(root)}`")
        except ValueError:
            names.append(f"`{p.name}`")
    measured = [r for r in rows if r.get("status") != "skipped"]
    skipped: dict[str, tuple[list[str], list[str]]] = {}
    for r in rows:
        if r.get("status") == "skipped":
            providers, cases = skipped.setdefault(r.get("reason") or "skipped", ([], []))
            case = f"{r['shape']['name']} EP {r['_world']}"
            providers.extend([r["provider"]] if r["provider"] not in providers else [])
            cases.extend([case] if case not in cases else [])
    parts = [markdown_table(measured, LEADING) if measured else "_No case was measured._"]
    if skipped:
        lines = [f"- {', '.join(p)} — {reason}: {', '.join(c)}" for reason, (p, c) in sorted(skipped.items())]
        parts.append("Not measured:\n\n" + "\n".join(lines))
    parts.append("From " + ", ".join(names) + ".")
    return "\n\n".join(parts)


def rewrite(text: str, table: str, start_marker: str = START, end_marker: str = END) -> str:
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < start:
        raise SystemExit(f"readme_table: the README has no {start_marker} ... {end_marker} markers")
    return text[: start + len(start_marker)] + "\n" + table + "\n" + text[end:]


def component_runs(results: Path, schema: str) -> list[tuple[dict[str, Any], Path]]:
    """The GPU runs of a component benchmark (JSON and path), oldest first."""
    found = []
    for path, report in _reports(results):
        if report.get("schema") == schema and report["device"].get("type") == "cuda":
            found.append((report["created"], path.name, report, path))
    return [(report, path) for _, _, report, path in sorted(found, key=lambda f: (f[0], f[1]))]


def latest_component(results: Path, schema: str) -> tuple[dict[str, Any], Path] | None:
    """The newest GPU run of a component benchmark (its JSON and path), or None."""
    runs = component_runs(results, schema)
    return runs[-1] if runs else None


def latest_experts(results: Path, schema: str) -> list[tuple[dict[str, Any], dict[str, Any], Path]]:
    """Per (shape, routing), the newest GPU row of `mok bench-experts` with its run: a run of
    some rows only (one routing, say) replaces those rows and keeps the others. Rows by shape,
    then routing, each in the order the newest runs list them."""
    newest: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any], Path]] = {}
    shapes: list[str] = []
    routings: list[str] = []
    for report, path in reversed(component_runs(results, schema)):
        for r in report["results"]:
            if r.get("status") == "skipped":
                continue
            key = (r["shape_name"], r["routing"])
            newest.setdefault(key, (r, report, path))
            shapes += [] if key[0] in shapes else [key[0]]
            routings += [] if key[1] in routings else [key[1]]
    return [newest[k] for k in sorted(newest, key=lambda k: (shapes.index(k[0]), routings.index(k[1])))]


def _source(path: Path, root: Path) -> str:
    try:
        return f"`{path.resolve().relative_to(root)}`"
    except ValueError:
        return f"`{path.name}`"


def render_experts(rows: list[tuple[dict[str, Any], dict[str, Any], Path]], root: Path) -> str:
    """`mok bench-experts`: TFLOP/s of mok's GEMMs and torch._grouped_mm (forward, forward + backward),
    each row the newest of its shape and routing (latest_experts); ratios are within one run."""
    if not rows:
        return "_No expert-GEMM results are committed yet._"
    head = "| shape | routing | rows | mok fwd | gate+up with h | gate+up, a and b only | torch._grouped_mm "
    head += "| mok / torch | mok fwd+bwd | torch fwd+bwd | mok / torch | bitwise |"
    lines = [head, "| --- " * 13 + "|"]
    names = ("mok", "mok-gate-up", "mok-gate-up-ab", "torch-grouped-mm", "mok-fwd-bwd", "torch-fwd-bwd")
    sources: dict[Path, dict[str, Any]] = {}
    for r, report, path in rows:
        sources[path] = report
        # Runs before the backward kernels have no fwd+bwd columns: "-".
        cell = [
            "-" if n not in r else f"{r[n]['TFLOPs']:.0f}" if r[n]["status"] == "ok" else r[n]["status"] for n in names
        ]
        speed = f"{r['speedup_vs_torch']:.2f}x" if "speedup_vs_torch" in r else "-"
        speed_fb = f"{r['fwd_bwd_speedup_vs_torch']:.2f}x" if "fwd_bwd_speedup_vs_torch" in r else "-"
        same = "yes" if r["mok"].get("bitwise_repeatable") else "NO"
        if "mok-fwd-bwd" in r:
            same += "/yes" if r["mok-fwd-bwd"].get("bitwise_repeatable") else "/NO"
        cells = " | ".join([*cell[:4], speed, *cell[4:], speed_fb])
        lines.append(f"| {r['shape_name']} | {r['routing']} | {r['rows']} | {cells} | {same} |")
    runs = []
    for path, report in sorted(sources.items(), key=lambda kv: kv[0].name):
        mm = (report["ceilings"].get("bf16_matmul") or {}).get("value")
        dense = f" (dense BF16 matmul {mm:.0f} TFLOP/s in that run)" if mm else ""
        runs.append(f"{_source(path, root)}{dense}")
    device = rows[0][1]["device"]["name"]
    return "\n".join(lines) + f"\n\nTFLOP/s, {device}. From {', '.join(runs)}."


def render_quantize(run: tuple[dict[str, Any], Path] | None, root: Path) -> str:
    """`mok bench-quantize`: GB/s of mok-mxfp8's quantizer and the PyTorch one."""
    if run is None:
        return "_No quantizer results are committed yet._"
    report, path = run
    hbm = (report["ceilings"].get("hbm") or {}).get("value")
    lines = [
        "| shape | what | mok-mxfp8 GB/s | in a CUDA graph | PyTorch GB/s | same bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        c, t = r["compiled"], r["torch"]
        cell = f"{c['GBps']:.0f}" if c["status"] == "ok" else c["status"]
        graph = f"{c['graph_GBps']:.0f}" if "graph_GBps" in c else "-"
        torch_cell = f"{t['GBps']:.0f}" if t["status"] == "ok" else t["status"]
        same = {True: "yes", False: "NO"}.get(r.get("same_bytes"), "-")
        lines.append(f"| {r['shape_name']} | {r['what']} | {cell} | {graph} | {torch_cell} | {same} |")
    ceiling = f"; HBM copy {hbm:.0f} GB/s in the same run" if hbm else ""
    return (
        "\n".join(lines)
        + f"\n\nBytes read + written per second, {report['device']['name']}{ceiling}. From {_source(path, root)}."
    )


def _tflops(row: dict[str, Any], name: str) -> str:
    if name not in row:
        return "-"
    return f"{row[name]['TFLOPs']:.0f}" if row[name]["status"] == "ok" else row[name]["status"]


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def render_mxfp8(run: tuple[dict[str, Any], Path] | None, root: Path) -> str:
    """`mok bench-mxfp8`: TFLOP/s of mok's MXFP8 GEMMs against mok's BF16 ones and torch's FP8 rowwise."""
    if run is None:
        return "_No MXFP8 GEMM results are committed yet._"
    report, path = run
    ceil = report["ceilings"]
    mm, mm8 = ((ceil.get(k) or {}).get("value") for k in ("bf16_matmul", "fp8_matmul"))
    # Runs from 2026-12-01 on also time the input gradients' GEMMs (g and dx).
    dgrad = any("mok-mxfp8-dgrad" in r for r in report["results"])
    wgrad = any("mok-mxfp8-wgrad" in r for r in report["results"])
    head = "| shape | routing | rows | MXFP8 fwd | MXFP8 gate+up | BF16 fwd | BF16 gate+up | torch FP8 fwd "
    head += "| torch FP8 gate+up | torch FP8 gate+up, fast accum | gate+up vs torch FP8 | gate+up vs BF16 "
    head += "| MXFP8 g + dx | torch FP8 g + dx | torch BF16 g + dx | g + dx vs torch FP8 " if dgrad else ""
    head += "| MXFP8 weight grads | torch BF16 weight grads " if wgrad else ""
    head += "| bitwise |"
    lines = [head, "| --- " * (13 + 4 * dgrad + 2 * wgrad) + "|"]
    names = ("mok-mxfp8", "mok-mxfp8-gate-up", "mok-bf16", "mok-bf16-gate-up", "torch-scaled", "torch-scaled-gate-up")
    names += ("torch-scaled-fast-gate-up",)
    keys = ("gate_up_speedup_vs_torch_scaled", "gate_up_speedup_vs_bf16")
    for r in report["results"]:
        if r.get("status") == "skipped":
            continue
        cell = [_tflops(r, n) for n in names]
        speeds = [_ratio(r, k) for k in keys]
        if dgrad:
            speeds += [_tflops(r, n) for n in ("mok-mxfp8-dgrad", "torch-scaled-dgrad", "torch-bf16-dgrad")]
            speeds.append(_ratio(r, "dgrad_speedup_vs_torch_scaled"))
        if wgrad:
            speeds += [_tflops(r, n) for n in ("mok-mxfp8-wgrad", "torch-bf16-wgrad")]
        same = "yes" if r["mok-mxfp8"].get("bitwise_repeatable") else "NO"
        lines.append(f"| {r['shape_name']} | {r['routing']} | {r['rows']} | {' | '.join(cell + speeds)} | {same} |")
    dense = f"; dense BF16 matmul {mm:.0f}, FP8 {mm8:.0f} TFLOP/s in the same run" if mm and mm8 else ""
    return "\n".join(lines) + f"\n\nTFLOP/s, {report['device']['name']}{dense}. From {_source(path, root)}."


COMPONENTS = (
    ("<!-- experts-table:start -->", "<!-- experts-table:end -->", "mok-bench-experts/1", render_experts),
    ("<!-- mxfp8-table:start -->", "<!-- mxfp8-table:end -->", "mok-bench-mxfp8/1", render_mxfp8),
    ("<!-- quantize-table:start -->", "<!-- quantize-table:end -->", "mok-bench-quantize/1", render_quantize),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--all-runs", action="store_true", help="include CPU and --quick runs")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the README is out of date")
    args = p.parse_args(argv)
    rows, sources = latest_rows(load_runs(args.results, args.all_runs))
    old = args.readme.read_text()
    root = args.readme.resolve().parent
    new = rewrite(old, render(rows, sources, root))
    for start, end, schema, render_component in COMPONENTS:
        if start in new:
            found = latest_experts if render_component is render_experts else latest_component
            new = rewrite(new, render_component(found(args.results, schema), root), start, end)
    if args.check:
        if new != old:
            print(f"{args.readme} is out of date: run python benchmarks/readme_table.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.readme.write_text(new)
        print(f"rewrote the performance table of {args.readme} ({len(rows)} rows)")
    else:
        print(f"{args.readme} is up to date ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
