"""The fixed-order combine kernel alone (mok_core.combine) on the GPU: its time and the HBM bandwidth
it reaches, at the bench's shapes.

    python3 benchmarks/probes/combine_time.py [shape ...] [--iters N]

Per shape (by bench name; default the SonicMoE comparison's four) and per layout of the rows: the
forward's (each route's row in route order, router weights applied: the megakernel's path) and the
backward's (rows in table order read through each route's row, no weights: dx's sum). Random bf16
rows, CUDA events around each call, the median of --iters calls after 5 warm-up calls; the bytes
are the rows read once and y written once (the weights and the route rows besides). Each layout's
result is checked bit for bit against the first call's (the kernel's bits never depend on the
launch).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import mok_core
from mok_torch.bench.shapes import resolve_shapes

DEFAULT_SHAPES = "sonic-7b,qwen3-30b-a3b,deepseek-v3-e32,mixtral-8x7b"


def time_combine(T: int, K: int, H: int, table_order: bool, iters: int) -> tuple[float, bool]:
    """(median us, every call bitwise the first) of the combine of T tokens' K rows of H."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = torch.randn(T * K, H, device=dev, generator=gen).bfloat16()
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    weights = None if table_order else torch.rand(T * K, device=dev, generator=gen)
    row_index = torch.randperm(T * K, device=dev, generator=gen).int() if table_order else None
    stream = torch.cuda.current_stream(dev).cuda_stream

    def call() -> None:
        mok_core.combine(
            "cuda", out.data_ptr(), 0, rows.data_ptr(), 0 if weights is None else weights.data_ptr(), T, K, H,
            stream, row_index=0 if row_index is None else row_index.data_ptr(), num_rows=T * K,
        )  # fmt: skip

    call()
    first = out.clone()
    for _ in range(5):
        call()
    times, same = [], True
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
        same = same and torch.equal(out, first)
    return statistics.median(times), same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", help=f"bench shape names (default {DEFAULT_SHAPES})")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("combine_time: needs a CUDA GPU")
    print(f"combine on {torch.cuda.get_device_name()}: median of {args.iters} calls")
    print(f"{'shape':18s} {'rows':6s} {'T':>6s} {'K':>3s} {'H':>5s} {'us':>8s} {'GB/s':>7s}  bitwise")
    for shape in resolve_shapes(",".join(args.shapes) or DEFAULT_SHAPES, 1):
        T, K, H = shape.tokens, shape.topk, shape.hidden
        for table_order in (False, True):
            us, same = time_combine(T, K, H, table_order, args.iters)
            gbs = (T * K * H * 2 + T * H * 2) / us / 1e3
            name = "table" if table_order else "route"
            print(f"{shape.name:18s} {name:6s} {T:6d} {K:3d} {H:5d} {us:8.1f} {gbs:7.0f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
