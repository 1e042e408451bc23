"""What a benchmark run leaves behind: the JSON, the plot, and the tables.

The JSON holds every figure; the plain-text table printed at the end of a run and the
README's markdown table (benchmarks/readme_table.py) are both made from its rows by
`table_cells`, so the two always show the same columns.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .timing import median

COLUMNS = (
    "shape",
    "routing",
    "provider",
    "fwd ms",
    "fwd+bwd ms",
    "host ms fwd / f+b",
    "back to back ms fwd / f+b",
    "TFLOP/s/GPU fwd / f+b",
    "floor frac fwd / f+b",
    "vs torch-a2a fwd / f+b",
    "vs sonicmoe fwd / f+b",
    "peak MiB",
    "saved MiB",
    "bitwise",
)
PASSES = ("forward", "forward+backward")


def _num(value: float | None) -> str:
    """Three significant digits, never an exponent above 1."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _pair(values: dict[str, float | None], suffix: str = "") -> str:
    """ "forward / forward+backward"."""
    parts = [_num(values.get(p)) for p in PASSES]
    return " / ".join(p + suffix if p != "-" else p for p in parts)


def table_cells(row: dict[str, Any]) -> tuple[list[str], str | None]:
    """(the cells of COLUMNS for an ok row, or the first three cells; the skip/error note or None)."""
    head = [row["shape"]["name"], row["routing"], row["provider"]]
    if row["status"] != "ok":
        word = "skipped" if row["status"] == "skipped" else "error"
        return head, f"{word}: {row['reason']}"
    peak = row["peak_mib"].get("forward+backward", row["peak_mib"].get("forward"))
    det = row["deterministic"]
    cells = head + [
        _num(row["ms"].get("forward")),
        _num(row["ms"].get("forward+backward")),
        _pair(row.get("host_ms", {})),
        _pair(row.get("back_to_back_ms", {})),
        _pair(row["tflops"]),
        _pair(row["floor_fraction"]),
        _pair(row["speedup_vs_torch_a2a"], "x"),
        _pair(row.get("speedup_vs_sonicmoe", {}), "x"),
        _num(peak),
        _num(row["saved_mib"]),
        "-" if det is None else ("yes" if det else "NO"),
    ]
    return cells, None


def text_table(rows: Sequence[dict[str, Any]]) -> str:
    """The end-of-run table: aligned columns; skipped and failed cases say why on their line."""
    cells = [table_cells(r) for r in rows]
    widths = [len(c) for c in COLUMNS]
    for row_cells, note in cells:
        if note is None:
            widths = [max(w, len(c)) for w, c in zip(widths, row_cells, strict=True)]
        else:
            widths[:3] = [max(w, len(c)) for w, c in zip(widths[:3], row_cells, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row_cells, note in cells:
        if note is None:
            line = "  ".join(c.ljust(w) for c, w in zip(row_cells, widths, strict=True))
        else:
            line = "  ".join(c.ljust(w) for c, w in zip(row_cells, widths[:3], strict=True)) + "  " + note
        lines.append(line.rstrip())
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict[str, Any]], leading: Sequence[tuple[str, str]] = ()) -> str:
    """A markdown table of `rows`; `leading` adds (header, key) columns read from each row first."""
    header = [h for h, _ in leading] + list(COLUMNS)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        cells, note = table_cells(row)
        if note is not None:
            cells = cells + [note] + [""] * (len(COLUMNS) - 4)
        lead = [str(row.get(key, "")) for _, key in leading]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in lead + cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# the run's record


def git_state() -> dict[str, Any]:
    """The commit of the working directory's repository and whether it has local changes; or, where
    MOK_GIT_COMMIT is set (tools/gpu-check on a GPU machine, whose copy of the tree has older git
    metadata: tools/gpu_wheels.py commit), that commit and MOK_GIT_DIRTY ("1": local changes)."""
    given = os.environ.get("MOK_GIT_COMMIT")
    if given:
        return {"commit": given, "dirty": os.environ.get("MOK_GIT_DIRTY") == "1"}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return {"commit": commit or None, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def device_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "count": torch.cuda.device_count(),
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    return {
        "type": "cpu",
        "name": platform.processor() or platform.machine() or "cpu",
        "count": 0,
        "cores": os.cpu_count(),
    }


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # builds without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def versions() -> dict[str, Any]:
    from .. import __version__

    return {
        "mok_torch": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "python": platform.python_version(),
    }


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_slug(info: dict[str, Any]) -> str:
    return slug(info["name"]) if info["type"] == "cuda" else "cpu"


def output_path(out_dir: Path, report: dict[str, Any], what: str | None = None) -> Path:
    """`<out>/<YYYY-MM-DD>_<device>_<what>.json`, never overwriting an earlier run (`-2`, `-3`,
    ... after the first); `what` defaults to the layer benchmark's `layer-ep<R>[-<precision>]`."""
    date = report["created"][:10]
    if what is None:
        what = f"layer-ep{report['world_size']}"
        if report["config"]["precision"] != "bf16":
            what += f"-{report['config']['precision']}"
        if report["config"]["quick"]:
            what += "-quick"
    stem = f"{date}_{device_slug(report['device'])}_{what}"
    path, n = out_dir / f"{stem}.json", 2
    while path.exists():
        path, n = out_dir / f"{stem}-{n}.json", n + 1
    return path


def write_component(doc: dict[str, Any], out: str | Path, what: str) -> Path:
    """A component benchmark's JSON under `out` (created if needed), named by output_path."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = output_path(out_dir, doc, what)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return path


# A row whose timed iterations spread more than this (slowest / fastest) is flagged.
NOISY_SPREAD = 1.5
# A provider whose medians after two different predecessors differ by more than this fraction
# is flagged: the call before it left the device in a state that moves its time.
PREDECESSOR_EFFECT = 0.03
PREDECESSOR_LEAST = 5  # iterations after a predecessor for its median to count (a --quick run has fewer)


def predecessor_medians(times: Sequence[float], preceded_by: Sequence[str | None], least: int = 1) -> dict[str, float]:
    """The median of a provider's iterations grouped by the call that ran before each (`preceded_by`
    of the same length; iterations after no call, or without a record, left out), by name; groups
    of fewer than `least` iterations left out."""
    groups: dict[str, list[float]] = {}
    if len(preceded_by) == len(times):
        for t, name in zip(times, preceded_by, strict=True):
            if name is not None:
                groups.setdefault(name, []).append(t)
    return {name: median(ts) for name, ts in sorted(groups.items()) if len(ts) >= least}


def timing_warnings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What makes a row's times untrustworthy, one line each: a forward slower than its forward +
    backward, or iterations that spread more than NOISY_SPREAD (a busy machine, too few
    iterations): the ratios of such rows mean nothing. And a provider whose times depend on the
    call that ran before it (medians by predecessor, `preceded_by`, of PREDECESSOR_LEAST iterations
    or more each, more than PREDECESSOR_EFFECT apart): its median, over every predecessor alike,
    holds; one order would not have."""
    out = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        what = f"{r['shape']['name']} {r['routing']} {r['provider']}"
        ms = r["ms"]
        if ms.get("forward") and ms.get("forward+backward") and ms["forward"] > ms["forward+backward"]:
            out.append(
                f"{what}: the forward ({ms['forward']:.3g} ms) took longer than the forward + backward "
                f"({ms['forward+backward']:.3g} ms): noise"
            )
        for p, times in r.get("times_ms", {}).items():
            if times and min(times) > 0 and max(times) / min(times) > NOISY_SPREAD:
                out.append(
                    f"{what} {p}: iterations spread {min(times):.3g}-{max(times):.3g} ms "
                    f"({max(times) / min(times):.1f}x): noisy, more --iters or a quieter machine"
                )
            by = predecessor_medians(times, r.get("preceded_by", {}).get(p, []), PREDECESSOR_LEAST)
            if len(by) > 1 and max(by.values()) > (1 + PREDECESSOR_EFFECT) * min(by.values()):
                after = ", ".join(f"after {name} {ms:.3g} ms" for name, ms in by.items())
                out.append(f"{what} {p}: its time depends on the call before it ({after})")
    return out


def make_report(
    *, device: torch.device, world: int, options: dict[str, Any], argv: list[str], ceilings: dict[str, Any], rows: list
) -> dict[str, Any]:
    return {
        "schema": "mok-bench-layer/1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(device),
        "world_size": world,
        "versions": versions(),
        "git": git_state(),
        "command": " ".join(["mok", "bench", *argv]),
        "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else sys.argv[0],
        "config": options,
        "ceilings": ceilings,
        "results": rows,
        "warnings": timing_warnings(rows),
    }


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = output_path(out_dir, report)
    path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    return path


# ---------------------------------------------------------------------------------------
# the plot


def _case_label(r: dict[str, Any]) -> str:
    """A case on the plot's axis: the shape's name and sizes, then the routing."""
    sh = r["shape"]
    sizes = " ".join(f"{k}{sh[k]}" for k in ("T", "H", "I", "E", "K") if k in sh)
    if sh.get("Is"):
        sizes += f" Is{sh['Is']}"
    return f"{sh['name']}\n{sizes}\n{r['routing']}"


def plot(report: dict[str, Any], path: Path) -> bool:
    """Time per provider per case, each bar with its value; and, where the ceilings were measured
    (GPUs), a second panel of the fraction of the floor. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["results"]
    cases: list[str] = []
    providers: list[str] = []
    for r in rows:
        case = _case_label(r)
        if case not in cases:
            cases.append(case)
        if r["provider"] not in providers and r["status"] == "ok":
            providers.append(r["provider"])
    timed = "forward+backward" if any("forward+backward" in r["ms"] for r in rows) else "forward"
    floors = any(r["status"] == "ok" and r["floor_fraction"].get(timed) is not None for r in rows)
    width_in = min(max(8.0, 1.6 * len(cases) + 3), 30.0)
    fig, axes = plt.subplots(2 if floors else 1, 1, figsize=(width_in, 9 if floors else 5), constrained_layout=True)
    ax_t, ax_f = (axes[0], axes[1]) if floors else (axes, None)
    width = 0.8 / max(len(providers), 1)
    top_fraction = 0.0
    for i, name in enumerate(providers):
        xs, times, fracs, fxs = [], [], [], []
        for r in rows:
            if r["provider"] != name or r["status"] != "ok" or timed not in r["ms"]:
                continue
            x = cases.index(_case_label(r)) + (i - (len(providers) - 1) / 2) * width
            xs.append(x)
            times.append(r["ms"][timed])
            frac = r["floor_fraction"].get(timed)
            if frac is not None:
                fxs.append(x)
                fracs.append(frac)
        # One colour per provider in both panels; one that never ran stays out of the legends.
        if xs:
            bars = ax_t.bar(xs, times, width, label=name, color=f"C{i}")
            ax_t.bar_label(bars, labels=[f"{t:.3g}" for t in times], fontsize=7, padding=1)
        if fracs and ax_f is not None:
            top_fraction = max(top_fraction, *fracs)
            bars = ax_f.bar(fxs, fracs, width, label=name, color=f"C{i}")
            ax_f.bar_label(bars, labels=[f"{f:.2f}" for f in fracs], fontsize=7, padding=1)
    for ax in (ax_t, ax_f):
        if ax is None:
            continue
        ax.set_xticks(range(len(cases)), cases, fontsize=8, rotation=30 if len(cases) > 10 else 0)
        ax.set_xlim(-0.5, len(cases) - 0.5)
    ax_t.set_yscale("log")
    ax_t.set_ylabel(f"{timed} ms (median)")
    if ax_t.get_legend_handles_labels()[0]:
        ax_t.legend(fontsize=8)
    dev = report["device"]["name"]
    title = f"mok layer benchmark, {dev}, EP {report['world_size']}, {report['config']['precision']}"
    if not floors:
        title += "\nno floors: the ceilings are measured on GPUs only"
    ax_t.set_title(title)
    if ax_f is not None:
        ax_f.set_ylabel(f"fraction of floor ({timed})")
        ax_f.set_ylim(0, max(1.05, 1.1 * top_fraction))
        ax_f.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
