"""`mok bench-quantize`: the MXFP8 quantizer's component benchmark (docs/benchmarks.md).

For every shape (seed slices by default; `--shapes quick` for a CPU smoke run) it times, on
one device, the quantization a training step does:

- activations: x [T, H] to MXFP8 rows (blocks along H), as before dispatch;
- weights: the gate projection [El, I, H] of one rank at EP 8, normal and transposed copies
  (what a user does once per optimizer step for each expert weight);

with mok-mxfp8's quantizer (`compiled`) and the pure-PyTorch one (`torch`), and reports GB/s
(bytes read + written) against the HBM copy rate measured in the same run, per call as a
training step makes it (host work included) and, on a GPU, replayed from a CUDA graph (the
device time alone). Both must give the same bytes; the run checks it and records the result.

    mok bench-quantize --out DIR [--shapes seed|quick|...] [--device auto|cpu|cuda]

Writes `<out>/<date>_<device>_quantize.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from typing import Any

import torch

from ..mxfp8 import BLOCK, _compiled, mxfp8_quantize
from . import ceilings as ceilings_mod
from . import report
from .launch import component_parser, one_device_main
from .shapes import resolve_shapes
from .timing import Ranks, median, time_ms

WEIGHT_EP = 8  # weights are sized as one rank's experts at this EP degree


def _bytes(numel: int, src_bytes: int, copies: int) -> int:
    """Bytes read and written by quantizing `numel` elements into `copies` copies."""
    return copies * (numel * src_bytes + numel + numel // BLOCK)


def _case(ranks: Ranks, what: str, w: torch.Tensor, normal: bool, transposed: bool, ns: argparse.Namespace) -> dict:
    copies = int(normal) + int(transposed)
    nbytes = _bytes(w.numel(), w.element_size(), copies)
    row: dict[str, Any] = {"what": what, "shape": list(w.shape), "dtype": str(w.dtype), "bytes": nbytes}
    outputs = {}
    for impl in ("compiled", "torch"):
        if impl == "compiled" and _compiled(w.device.type) is None:
            row[impl] = {"status": "skipped", "why": f"mok-mxfp8 has no quantizer for {w.device.type} here"}
            continue

        def run(impl: str = impl) -> Any:
            return mxfp8_quantize(w, normal, transposed, compiled=impl == "compiled")

        ms = median(time_ms(ranks, run, iters=ns.iters, warmup=ns.warmup))
        outputs[impl] = run()
        row[impl] = {"status": "ok", "ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9}
        if ranks.cuda:  # the device time alone: the call replayed from a CUDA graph (no host work)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(ranks.device)
            with torch.cuda.graph(graph):
                run()
            ms = median(time_ms(ranks, graph.replay, iters=ns.iters, warmup=ns.warmup))
            row[impl].update(graph_ms=ms, graph_GBps=nbytes / (ms * 1e-3) / 1e9)
            del graph
    if len(outputs) == 2:
        a, b = outputs["compiled"], outputs["torch"]
        row["same_bytes"] = all(
            (x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in ((a.data, b.data), (a.scales, b.scales), (a.data_t, b.data_t), (a.scales_t, b.scales_t))
        )
    return row


def bench(ns: argparse.Namespace, ranks: Ranks) -> dict[str, Any]:
    hbm = ceilings_mod.hbm_copy(ranks) if ranks.cuda else None
    results = []
    g = torch.Generator(device=ranks.device).manual_seed(0)
    for shape in resolve_shapes(ns.shapes, WEIGHT_EP):
        if shape.skip:
            continue
        x = torch.randn(shape.tokens, shape.hidden, generator=g, device=ranks.device).to(torch.bfloat16)
        El = shape.experts // WEIGHT_EP
        w = torch.randn(El, shape.inner, shape.hidden, generator=g, device=ranks.device).to(torch.bfloat16)
        for what, t, normal, transposed in (("activations", x, True, False), ("weights", w, True, True)):
            row = _case(ranks, what, t, normal, transposed, ns)
            row["shape_name"] = shape.name
            if hbm is not None and hbm.value:
                for impl in ("compiled", "torch"):
                    if row[impl]["status"] == "ok":
                        row[impl]["fraction_of_hbm_copy"] = row[impl]["GBps"] / hbm.value
            results.append(row)
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    device = report.device_info(ranks.device)
    doc = {
        "schema": "mok-bench-quantize/1",
        "created": created,
        "device": device,
        "versions": report.versions(),
        "git": report.git_state(),
        "command": " ".join(["mok", "bench-quantize", *ns.argv]),
        "config": {"shapes": ns.shapes, "iters": ns.iters, "warmup": ns.warmup, "weight_ep": WEIGHT_EP},
        "ceilings": {"hbm": None if hbm is None else hbm.asdict()},
        "results": results,
    }
    _print(doc)
    report.write_component(doc, ns.out, "quantize")
    return doc


def _print(doc: dict[str, Any]) -> None:
    hbm = doc["ceilings"]["hbm"]
    rate = "-" if not hbm or hbm["value"] is None else f"{hbm['value']:.0f} GB/s"
    print(f"\nmok bench-quantize: {doc['device']['name']}, HBM copy {rate}")
    print(f"{'shape':<20}{'what':<13}{'compiled GB/s':>15}{'in a graph':>12}{'torch GB/s':>12}  same bytes")
    for r in doc["results"]:
        cells = [f"{r[i]['GBps']:.1f}" if r[i]["status"] == "ok" else "skipped" for i in ("compiled", "torch")]
        graph = f"{r['compiled']['graph_GBps']:.1f}" if "graph_GBps" in r["compiled"] else "-"
        print(
            f"{r['shape_name']:<20}{r['what']:<13}{cells[0]:>15}{graph:>12}{cells[1]:>12}  {r.get('same_bytes', '-')}"
        )


def parser() -> argparse.ArgumentParser:
    return component_parser("mok bench-quantize", __doc__.split("\n\n")[0], iters=20, warmup=3)


def main(argv: list[str] | None = None) -> int:
    return one_device_main(parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
