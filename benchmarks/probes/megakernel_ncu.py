"""One layer forward on the megakernel path and one on the chain, for ncu (the kernels of both):

    ncu --clock-control none --kernel-name regex:"moe_forward|grouped_gemm" \
        --section SpeedOfLight --section WarpStateStats ... python3 benchmarks/probes/megakernel_ncu.py [shape]

With --backward: forwards + backwards at one rank with the default config (tools/gpu-check's
ncu-backward stage: the backward's kernels).
"""

from __future__ import annotations

import sys

import torch

import mok_torch as mok
from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks

args = [a for a in sys.argv[1:] if not a.startswith("--")]
shape = resolve_shapes(args[0] if args else "qwen3-30b-a3b", 1)[0]
ranks = Ranks(torch.device("cuda", 0), None, 0, 1)
call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
if "--backward" in sys.argv:
    for _ in range(2):
        call.drop_grads()
        y = mok.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, max_tokens=shape.tokens)
        y.backward(call.dy_TH)
    torch.cuda.synchronize()
    print("done")
    sys.exit(0)
with torch.no_grad():
    for fused in (True, False):
        cfg = mok.MoKConfig(megakernel=fused)
        for _ in range(2):
            mok.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, config=cfg,
                    max_tokens=shape.tokens)  # fmt: skip
        torch.cuda.synchronize()
print("done")
