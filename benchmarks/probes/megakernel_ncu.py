"""One layer forward on the megakernel path and one on the chain, for ncu (the kernels of both):

    ncu --clock-control none --kernel-name regex:"moe_forward|grouped_gemm|swiglu_h" \
        --section SpeedOfLight --section WarpStateStats ... python3 benchmarks/probes/megakernel_ncu.py [shape]
"""

from __future__ import annotations

import sys

import torch

import mok_torch as mok
from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks

shape = resolve_shapes(sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b", 1)[0]
ranks = Ranks(torch.device("cuda", 0), None, 0, 1)
call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
with torch.no_grad():
    for fused in (True, False):
        cfg = mok.MoKConfig(megakernel=fused)
        for _ in range(2):
            mok.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, config=cfg,
                    max_tokens=shape.tokens)  # fmt: skip
        torch.cuda.synchronize()
print("done")
