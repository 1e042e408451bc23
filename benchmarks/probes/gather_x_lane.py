"""The gather-x lane against main's path, in one process on one build: a layer call at one rank
with `GATHER_X_MAX_INNER` 0 (the forward's megakernel stores the routed x rows, dW1 reads them in
table order) and 256 (the megakernel stores none, dW1 gathers x's rows by route from the layer's
input: `dw1_mode` 2), in turns.

    python3 benchmarks/probes/gather_x_lane.py [shape ...] [--rounds=N]

Per shape, round and setting: a forward and a forward + backward back to back (20 calls, CUDA
events, no synchronization between them: the device's time a call), the peak memory of one
forward + backward, and whether y and every gradient are bitwise those of the first setting.
Balanced routing (mok.bench's inputs). Not part of any package; NOTES.md records what it showed.
"""

from __future__ import annotations

import sys

import torch

import mok_torch as mok
import mok_torch.backends.native as native
from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks, back_to_back_ms

CALLS = 20


def main(argv: list[str]) -> None:
    names = [a for a in argv if not a.startswith("--")] or ["sonic-7b"]
    rounds = next((int(a.split("=")[1]) for a in argv if a.startswith("--rounds=")), 2)
    ranks = Ranks(torch.device("cuda", 0), None, 0, 1)
    for shape in resolve_shapes(",".join(names), 1):
        call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
        cfg = mok.MoKConfig()

        def forward(call=call, T: int = shape.tokens, cfg: mok.MoKConfig = cfg) -> torch.Tensor:
            return mok.moe(call.x_TH, call.top_experts_TK, call.router_weights_TK, call.routed, call.shared,
                           config=cfg, max_tokens=T)  # fmt: skip

        def forward_backward(forward=forward, call=call) -> torch.Tensor:
            call.drop_grads()
            y = forward()
            y.backward(call.dy_TH)
            return y

        def outputs(call=call) -> list[torch.Tensor]:
            y = forward_backward()
            grads = [g for g in call.grads() if g is not None]
            return [y.detach().clone(), *(g.clone() for g in grads)]

        first = None
        for r in range(rounds):
            for lane in (0, 256):
                native.GATHER_X_MAX_INNER = lane
                got = outputs()
                if first is None:
                    first = got
                same = len(got) == len(first) and all(
                    torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                                b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))
                    for a, b in zip(got, first, strict=True)
                )  # fmt: skip
                fwd = back_to_back_ms(ranks, forward, calls=CALLS, rounds=1)
                fb = back_to_back_ms(ranks, forward_backward, calls=CALLS, rounds=1)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                forward_backward()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 2**20
                print(f"{shape.name} round {r} GATHER_X_MAX_INNER={lane:3d}: forward {fwd:.3f} ms, "
                      f"forward+backward {fb:.3f} ms back to back; peak {peak:.0f} MiB; "
                      f"bitwise {'yes' if same else 'NO'} ({len(got)} tensors)", flush=True)  # fmt: skip
        native.GATHER_X_MAX_INNER = 0


if __name__ == "__main__":
    main(sys.argv[1:])
