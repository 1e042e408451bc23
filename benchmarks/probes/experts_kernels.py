"""A probe of mok-bf16's grouped forward and backward: each CUDA kernel's time at one shape.

    python benchmarks/probes/experts_kernels.py [H I El ROWS | H I S1,S2,..] ...   (default: kimi's slice)

H I El ROWS: El equal segments of ROWS / El rows rounded up to 128; H I S1,S2,..: segments of
exactly those sizes (e.g. the ones `mok bench-experts` draws).

Runs grouped_forward and grouped_backward (one macrobatch, bf16 weight gradients from +0, as
`mok bench-experts` does) a few times under torch.profiler and prints, per kernel, its mean
time per call and its share: which of the GEMMs and elementwise kernels to work on next. Not
part of any package; NOTES.md records what it showed.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from mok_torch.backends.native.grouped import grouped_backward, grouped_forward

BF16 = torch.bfloat16
ITERS = 5


def short(name: str) -> str:
    """A kernel's name without its template arguments' noise."""
    for key in ("GateUpEpilogue", "StoreBf16", "StoreF32", "wgrad_gemm_kernel", "swiglu", "fill"):
        if key in name:
            if "grouped_gemm_kernel" in name:
                kind = name.split("grouped_gemm_kernel<")[1].split(",")[0]
                return f"grouped_gemm<{kind}> {key}"
            if key == "wgrad_gemm_kernel" and "wgrad_gemm_kernel<" in name:
                # Its template arguments after the stages: carry-in, fp32, cluster, gather, transposed C.
                args = name.split("wgrad_gemm_kernel<")[1].split(">")[0].split(",")[1:]
                return "wgrad_gemm<" + ",".join(a.strip()[0] if a.strip()[0] in "tf" else a.strip() for a in args) + ">"
            if key == "wgrad_gemm_kernel":
                return "wgrad_gemm " + ("carry" if "Lb1E" in name or "true" in name else "from 0")
            return name.split("(")[0][-60:]
    return name[:60]


def probe(H: int, I: int, sizes: list[int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    El, M = len(sizes), sum(sizes)
    x = torch.randn(M, H, device="cuda", generator=g).to(BF16)
    wg, wu = ((torch.randn(El, I, H, device="cuda", generator=g) / H**0.5).to(BF16) for _ in range(2))
    wd = (torch.randn(El, H, I, device="cuda", generator=g) / I**0.5).to(BF16)
    dy = torch.randn(M, H, device="cuda", generator=g).to(BF16)
    offsets = torch.tensor([0] + sizes, device="cuda").cumsum(0)
    wgrads = (torch.empty_like(wg), torch.empty_like(wu), torch.empty_like(wd))

    host: list[tuple[float, float]] = []  # host seconds per forward and backward call

    def step() -> None:
        t0 = time.perf_counter()
        f = grouped_forward(x, offsets, wg, wu, wd)
        t1 = time.perf_counter()
        grouped_backward(x, offsets, f.a, f.b, dy, None, wg, wu, wd, None, carry_in=False, wgrad_out=wgrads)
        host.append((t1 - t0, time.perf_counter() - t1))

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            step()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[short(ev.name)] += ev.device_time / ITERS / 1000.0

    # The same call timed by CUDA events as `mok bench-experts` does (from an idle GPU, so the host's
    # time to the first launch counts), and back to back (the host's work hidden behind the GPU's).
    def timed(calls: int) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls

    idle = sorted(timed(1) for _ in range(5))[2]
    busy = timed(5)
    total = sum(per.values())
    fl = 2 * M * H * I
    print(f"\nH={H} I={I} El={El} rows={M} sizes={sizes[:8]}: {total:.3f} ms of kernels per forward + backward "
          f"({18 * fl / 2 / total / 1e9:.0f} TFLOP/s)")  # fmt: skip
    print(f"  events: {idle:.3f} ms per call from an idle GPU, {busy:.3f} ms per call back to back")
    fwd_host = sorted(h[0] for h in host)[len(host) // 2] * 1e3
    bwd_host = sorted(h[1] for h in host)[len(host) // 2] * 1e3
    print(f"  host: {fwd_host:.3f} ms per forward call, {bwd_host:.3f} ms per backward call (median)")
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.3f} ms {100 * ms / total:5.1f} %  {name}")


def main(argv: list[str]) -> None:
    args = argv or ["7168", "2048", "6", "16416"]
    while args:
        H, I = int(args[0]), int(args[1])
        if "," in args[2]:
            sizes, args = [int(s) for s in args[2].split(",")], args[3:]
        else:
            El, rows, args = int(args[2]), int(args[3]), args[4:]
            sizes = [-(-rows // El // 128) * 128] * El
        probe(H, I, sizes)


if __name__ == "__main__":
    main(sys.argv[1:])
