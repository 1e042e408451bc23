"""`mok bench-mxfp8`: the MXFP8 expert GEMMs' component benchmark (issue 6, docs/benchmarks.md).

For every shape, on one GPU, the routed SwiGLU experts' forward over the rows one rank receives
(T * K rows, `--routing` balanced or skewed over its El local experts, rounded up to 16 per
expert, as `mok bench-experts` makes them), the same inputs for every provider:

- `mok-mxfp8`: mok-mxfp8's grouped forward (FP8 wgmma with per-32 scaling: gate+up, then h and
  its MXFP8 copy, then down), x already MXFP8 rows (as dispatch delivers them);
  `mok-mxfp8-gate-up`: its gate+up GEMM alone (a and b);
- `mok-bf16`, `mok-bf16-gate-up`: mok-bf16's grouped forward and its gate+up GEMM writing a and b
  only, on the bf16 values;
- `torch-scaled`: `torch._scaled_grouped_mm` (FP8 rowwise scales) for gate+up in one call and
  down, with `silu(gate) * up` and the rowwise quantization of h between;
  `torch-scaled-gate-up`: its gate+up call alone; both with `use_fast_accum=False` (the
  default: partial sums promoted to fp32 as they go);
  `torch-scaled-fast-gate-up`: the gate+up call with `use_fast_accum=True` (the whole K summed
  inside the FP8 tensor-core accumulator: fastest, least precise);
- the input gradients' two GEMMs, on MXFP8 rows of a random dy [M, H] and d_ab [M, 2I]:
  `mok-mxfp8-dgrad`: mok-mxfp8's grouped GEMM for g = dy_q @ Q_H(Wd^T)^T (fp32 out) and
  dx = Q_2I(d_ab) @ [Q_I(Wg^T); Q_I(Wu^T)]^T (bf16 out, K split over the two transposed copies);
  `torch-scaled-dgrad`: the same two products by `torch._scaled_grouped_mm` (rowwise scales,
  bf16 out); `torch-bf16-dgrad`: by `torch._grouped_mm` on the bf16 values;
- the weight gradients' two GEMMs (rows as the reduction), on random h [M, I] and the operands
  above: `mok-mxfp8-wgrad`: mok-mxfp8's grouped weight-gradient GEMM for dWd = Q(dy)^T Q(h) and
  d[Wg; Wu] = Q(d_ab)^T Q(x) from transposed copies quantized along the rows (bf16 out);
  `torch-bf16-wgrad`: the same two products by `torch._grouped_mm` (offsets along K) on the bf16
  values;

and reports ms and TFLOP/s (6 * rows * H * I for a forward and for the input or weight
gradients' GEMMs, 4 for gate+up) against the dense
BF16 and FP8 matmul rates measured in the same run, the MXFP8 speedups over torch's FP8 and
over mok's BF16, whether two MXFP8 runs gave the same bits, and the MXFP8 output's relative
difference from the BF16 kernels'.

    mok bench-mxfp8 --out DIR [--shapes seed|public|all|...] [--ep 8] [--routing balanced,skewed]

Writes `<out>/<date>_<device>_mxfp8.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..backends.native.grouped import grouped_forward
from ..backends.native.mxfp8_grouped import (
    mxfp8_grouped_forward,
    mxfp8_grouped_gemm,
    mxfp8_grouped_wgrad,
    pack_split_rows,
)
from ..mxfp8 import mxfp8_quantize, pack_rows
from . import ceilings as ceilings_mod
from . import report
from .experts import case_inputs, each_case, expert_parser, run_config, time_providers
from .launch import one_device_main
from .shapes import Shape
from .timing import Ranks

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
PROVIDERS = (
    "mok-mxfp8",
    "mok-mxfp8-gate-up",
    "mok-bf16",
    "mok-bf16-gate-up",
    "torch-scaled",
    "torch-scaled-gate-up",
    "torch-scaled-fast-gate-up",
    "mok-mxfp8-dgrad",
    "torch-scaled-dgrad",
    "torch-bf16-dgrad",
    "mok-mxfp8-wgrad",
    "torch-bf16-wgrad",
)


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [..., R, C] as E4M3 with one fp32 scale per row (amax / 448), and the scales [..., R]."""
    amax = t.float().abs().amax(dim=-1).clamp(min=1e-12)
    scale = amax / 448.0
    return (t.float() / scale[..., None]).to(E4M3), scale


def _case(ranks: Ranks, shape: Shape, El: int, routing: str, ns: argparse.Namespace, g: torch.Generator) -> dict:
    x, wg, wu, wd, ends, offsets, row = case_inputs(ranks, shape, El, routing, g)
    H, I, M, dev = shape.hidden, shape.inner, x.shape[0], ranks.device
    # MXFP8 operands: x as the layer's tables hold it (MXFP8 rows in 2H-byte rows), the weights
    # as mok.mxfp8_quantize makes them.
    x_rows = torch.zeros(M, 2 * H, dtype=torch.uint8, device=dev)
    x_rows[:, : H + H // 32] = pack_rows(x)
    q = [mxfp8_quantize(w) for w in (wg, wu, wd)]
    # torch's FP8 rowwise operands: [Wg; Wu] as one [El, 2I, H] weight, B column-major.
    x8, sx = rowwise_fp8(x)
    gu8, sgu = rowwise_fp8(torch.cat([wg, wu], dim=1))
    d8, sd = rowwise_fp8(wd)
    offs32 = ends.to(torch.int32)
    flops = row["flops_forward"]

    def mx() -> Any:
        return mxfp8_grouped_forward(x_rows, H, offsets, q[0], q[1], q[2])

    def mx_gate_up() -> Any:
        return mxfp8_grouped_forward(x_rows, H, offsets, q[0], q[1], None)

    def bf() -> Any:
        return grouped_forward(x, offsets, wg, wu, wd)

    def bf_gate_up() -> Any:
        return grouped_forward(x, offsets, wg, wu, None, with_h=False)

    def scaled_gate_up(fast: bool = False) -> torch.Tensor:
        return torch._scaled_grouped_mm(
            x8, gu8.transpose(-2, -1), sx, sgu, offs=offs32, out_dtype=BF16, use_fast_accum=fast
        )

    def scaled() -> torch.Tensor:
        gu = scaled_gate_up()
        h = F.silu(gu[:, :I]) * gu[:, I:]
        h8, sh = rowwise_fp8(h)
        return torch._scaled_grouped_mm(h8, d8.transpose(-2, -1), sh, sd, offs=offs32, out_dtype=BF16)

    # The input gradients' operands: dy and d_ab as MXFP8 rows, the weights' transposed copies.
    dy = torch.randn(M, H, generator=g, device=g.device).to(dev, BF16)
    dab = (torch.randn(M, 2 * I, generator=g, device=g.device) / 8).to(dev, BF16)
    dy_rows, dab_rows = pack_rows(dy), pack_split_rows(dab, I)  # dx's A: the split layout
    dy8, sdy = rowwise_fp8(dy)
    dab8, sdab = rowwise_fp8(dab)
    wdt8, swdt = rowwise_fp8(wd.transpose(1, 2).contiguous())  # [El, I, H]: rows of Wd^T, reduced along H
    gut8, sgut = rowwise_fp8(torch.cat([wg, wu], dim=1).transpose(1, 2).contiguous())  # [El, H, 2I]

    def mx_dgrad() -> Any:
        g_MI = mxfp8_grouped_gemm(dy_rows, H, offsets, q[2].operand(transposed=True), out_dtype=torch.float32)
        dx = mxfp8_grouped_gemm(dab_rows, 2 * I, offsets, q[0].operand(True), q[1].operand(True))
        return g_MI, dx

    def scaled_dgrad() -> Any:
        g_MI = torch._scaled_grouped_mm(dy8, wdt8.transpose(-2, -1), sdy, swdt, offs=offs32, out_dtype=BF16)
        dx = torch._scaled_grouped_mm(dab8, gut8.transpose(-2, -1), sdab, sgut, offs=offs32, out_dtype=BF16)
        return g_MI, dx

    def bf16_dgrad() -> Any:
        g_MI = torch._grouped_mm(dy, wd, offs=offs32)
        dx = torch._grouped_mm(dab, torch.cat([wg, wu], dim=1), offs=offs32)
        return g_MI, dx

    # The weight gradients' operands: transposed copies quantized along the rows, in 32-row
    # blocks from each segment start. The bench's segments are multiples of 16 rows, so for these
    # GEMMs alone the segment bounds are rounded down to 32 and the rows cut to M32.
    M32 = M // 32 * 32
    h = torch.randn(M, I, generator=g, device=g.device).to(dev, BF16)
    dy_t, h_t, dab_t, x_t = (mxfp8_quantize(t[:M32], normal=False).operand(True) for t in (dy, h, dab, x))
    offsets32 = (offsets // 32 * 32).clamp(max=M32)
    dyT, dabT, h32, x32 = dy[:M32].t().contiguous(), dab[:M32].t().contiguous(), h[:M32], x[:M32]
    offs32_k = offsets32[1:].to(torch.int32)

    def mx_wgrad() -> Any:
        d_down = mxfp8_grouped_wgrad(dy_t, h_t, offsets32)
        d_gate_up = mxfp8_grouped_wgrad(dab_t, x_t, offsets32)
        return d_down, d_gate_up

    def bf16_wgrad() -> Any:
        d_down = torch._grouped_mm(dyT, h32, offs=offs32_k)
        d_gate_up = torch._grouped_mm(dabT, x32, offs=offs32_k)
        return d_down, d_gate_up

    providers = (
        ("mok-mxfp8", mx, flops),
        ("mok-mxfp8-gate-up", mx_gate_up, 4 * M * H * I),
        ("mok-bf16", bf, flops),
        ("mok-bf16-gate-up", bf_gate_up, 4 * M * H * I),
        ("torch-scaled", scaled, flops),
        ("torch-scaled-gate-up", scaled_gate_up, 4 * M * H * I),
        ("torch-scaled-fast-gate-up", lambda: scaled_gate_up(fast=True), 4 * M * H * I),
        ("mok-mxfp8-dgrad", mx_dgrad, 6 * M * H * I),
        ("torch-scaled-dgrad", scaled_dgrad, 6 * M * H * I),
        ("torch-bf16-dgrad", bf16_dgrad, 6 * M * H * I),
        ("mok-mxfp8-wgrad", mx_wgrad, 6 * M32 * H * I),
        ("torch-bf16-wgrad", bf16_wgrad, 6 * M32 * H * I),
    )
    row.update(time_providers(ranks, providers, ns))
    ok = lambda n: row[n]["status"] == "ok"  # noqa: E731
    if ok("mok-mxfp8"):
        first, second = mx(), mx()
        row["mok-mxfp8"]["bitwise_repeatable"] = all(
            torch.equal(u, v) for u, v in zip(first, second, strict=True) if u is not None
        )
        if ok("mok-bf16"):
            ref = bf().y.float()
            row["mok-mxfp8"]["rel_diff_vs_bf16"] = ((first.y.float() - ref).norm() / ref.norm()).item()
    for ours, theirs, key in (
        ("mok-mxfp8-gate-up", "torch-scaled-gate-up", "gate_up_speedup_vs_torch_scaled"),
        ("mok-mxfp8-gate-up", "mok-bf16-gate-up", "gate_up_speedup_vs_bf16"),
        ("mok-mxfp8", "torch-scaled", "forward_speedup_vs_torch_scaled"),
        ("mok-mxfp8", "mok-bf16", "forward_speedup_vs_bf16"),
        ("mok-mxfp8-dgrad", "torch-scaled-dgrad", "dgrad_speedup_vs_torch_scaled"),
        ("mok-mxfp8-dgrad", "torch-bf16-dgrad", "dgrad_speedup_vs_torch_bf16"),
        ("mok-mxfp8-wgrad", "torch-bf16-wgrad", "wgrad_speedup_vs_torch_bf16"),
    ):
        if ok(ours) and ok(theirs):
            row[key] = row[theirs]["ms"] / row[ours]["ms"]
    return row


def bench(ns: argparse.Namespace, ranks: Ranks) -> dict[str, Any]:
    # The CPU run checks the plumbing only (torch's FP8 grouped GEMM is reported as failed there).
    mm = ceilings_mod.bf16_matmul(ranks) if ranks.cuda else None
    mm8 = ceilings_mod.fp8_matmul(ranks) if ranks.cuda else None
    results = each_case(ns, ranks, _case)
    for row in results:
        for name in PROVIDERS:
            if name in row and row[name]["status"] == "ok":
                if mm is not None and mm.value:
                    row[name]["fraction_of_dense_bf16"] = row[name]["TFLOPs"] / mm.value
                if mm8 is not None and mm8.value:
                    row[name]["fraction_of_dense_fp8"] = row[name]["TFLOPs"] / mm8.value
    doc = {
        "schema": "mok-bench-mxfp8/1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": report.device_info(ranks.device),
        "versions": report.versions(),
        "git": report.git_state(),
        "command": " ".join(["mok", "bench-mxfp8", *ns.argv]),
        "config": run_config(ns),
        "ceilings": {
            "bf16_matmul": None if mm is None else mm.asdict(),
            "fp8_matmul": None if mm8 is None else mm8.asdict(),
        },
        "results": results,
    }
    _print(doc)
    report.write_component(doc, ns.out, "mxfp8")
    return doc


def _print(doc: dict[str, Any]) -> None:
    mm = (doc["ceilings"]["bf16_matmul"] or {}).get("value") or 0
    mm8 = (doc["ceilings"]["fp8_matmul"] or {}).get("value") or 0
    print(f"\nmok bench-mxfp8: {doc['device']['name']}, dense bf16 {mm:.0f}, fp8 {mm8:.0f} TFLOP/s (TFLOP/s)")
    print(
        f"{'shape':<20}{'routing':<9}{'rows':>7}{'mx fwd':>7}{'mx g-u':>7}{'bf fwd':>7}{'bf g-u':>7}"
        f"{'t8 fwd':>7}{'t8 g-u':>7}{'t8fast':>7}{'mx dg':>7}{'t8 dg':>7}{'bf dg':>7}{'mx wg':>7}{'bf wg':>7}"
        f"{'xT8':>6}{'xBF':>6}  same bits"
    )
    for r in doc["results"]:
        if r.get("status") == "skipped":
            print(f"{r['shape_name']:<20}skipped: {r['why']}")
            continue
        cells = "".join(f"{r[n]['TFLOPs']:>7.0f}" if r[n]["status"] == "ok" else f"{'fail':>7}" for n in PROVIDERS)
        x8 = r.get("gate_up_speedup_vs_torch_scaled")
        xb = r.get("gate_up_speedup_vs_bf16")
        speeds = f"{x8:>6.2f}" if x8 else f"{'-':>6}"
        speeds += f"{xb:>6.2f}" if xb else f"{'-':>6}"
        same = r["mok-mxfp8"].get("bitwise_repeatable", "-")
        print(f"{r['shape_name']:<20}{r['routing']:<9}{r['rows']:>7}{cells}{speeds}  {same}")
    failed = {n: r[n]["why"] for r in doc["results"] if "rows" in r for n in PROVIDERS if r[n]["status"] != "ok"}
    for name, why in failed.items():
        print(f"  {name} failed: {why}")


def parser() -> argparse.ArgumentParser:
    return expert_parser("mok bench-mxfp8", __doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    return one_device_main(parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
