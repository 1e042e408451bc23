"""A probe of the MXFP8 layer on one GPU: where a forward and a backward spend their time.

    python benchmarks/probes/mxfp8_layer.py [NAME ...]     (default: deepseek-v4-pro qwen3-30b-a3b)

Runs `mok.moe` with precision="mxfp8" on the cuda backend at EP 1 (the shapes and balanced
routing of `mok bench`), times forward and backward with CUDA events, then profiles two steps
with torch.profiler and prints the kernels and operators that take the most GPU time: which
passes to move into kernels next. Not part of any package; NOTES.md records what it showed.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from mok_torch import MoKConfig, moe

BF16 = torch.bfloat16
# name: (experts, H, I, K, T, shared inner), as `mok bench` runs them at EP 1
SHAPES = {
    "deepseek-v4-pro": (6, 7168, 3072, 6, 2048, 3072),
    "qwen3-30b-a3b": (128, 2048, 768, 8, 8192, 0),
    "kimi-k2.7-code": (48, 7168, 2048, 8, 2048, 0),
}


def probe(name: str) -> None:
    E, H, I, K, T, Is = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)

    def param(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(BF16).requires_grad_()

    routed = (param(E, I, H), param(E, I, H), param(E, H, I))
    shared = (param(Is, H), param(Is, H), param(H, Is)) if Is else None
    x = torch.randn(T, H, device="cuda", generator=g).to(BF16).requires_grad_()
    top = ((torch.arange(T, device="cuda")[:, None] * K + torch.arange(K, device="cuda")) % E).to(torch.int64)
    w = torch.rand(T, K, device="cuda", generator=g).requires_grad_()
    dy = torch.randn(T, H, device="cuda", generator=g).to(BF16)
    cfg = MoKConfig(precision="mxfp8", backend="cuda")

    def step() -> tuple[float, float]:
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        y = moe(x, top, w, routed, shared, config=cfg, max_tokens=T)
        e[1].record()
        y.backward(dy)
        e[2].record()
        torch.cuda.synchronize()
        return e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2])

    for _ in range(2):
        step()
    times = [step() for _ in range(3)]
    fwd, bwd = (sorted(t[i] for t in times)[1] for i in range(2))
    print(f"\n## {name}: E={E} H={H} I={I} K={K} T={T} Is={Is}: forward {fwd:.2f} ms, backward {bwd:.2f} ms")
    for what, run in (("forward", lambda: moe(x, top, w, routed, shared, config=cfg, max_tokens=T)), ("both", step)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                run()
            torch.cuda.synchronize()
        print(f"### {what}, 2 steps: kernels by GPU time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=90))


if __name__ == "__main__":
    for n in sys.argv[1:] or ["deepseek-v4-pro", "qwen3-30b-a3b"]:
        probe(n)
