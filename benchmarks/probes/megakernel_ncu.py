"""One layer forward on the megakernel path and one on the chain, for ncu (the kernels of both):

    ncu --clock-control none --kernel-name regex:"moe_forward|grouped_gemm|swiglu_h" \
        --section SpeedOfLight --section WarpStateStats ... python3 benchmarks/probes/megakernel_ncu.py [shape]

With --backward: one forward + backward at one rank with dy and the router weights gathered by the
kernels (the default config), then one with them pulled into table order (combine="pull": the
copy engine's g GEMM), for ncu on the backward's kernels (tools/gpu-check's ncu-backward stage).
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
    for combine in ("push", "pull"):
        cfg = mok.MoKConfig(combine=combine)
        for _ in range(2):
            call.drop_grads()
            y = mok.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, config=cfg,
                        max_tokens=shape.tokens)  # fmt: skip
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
