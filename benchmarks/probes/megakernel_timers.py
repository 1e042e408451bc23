"""Where the forward megakernel's time goes, per kind of task: one timed launch (its own
instantiation of the kernel, accounts of clock64 cycles per CTA and role) after untimed ones.

    python3 benchmarks/probes/megakernel_timers.py [shape ...]

Prints, per shape, the untimed and timed launches' times (CUDA events) and, per role (the
producer's thread 0, each consumer warpgroup's leader), each account's mean over the CTAs as a
share of the role's total: waiting for a ticket, in gate/up and down tasks, on h (the SwiGLU) at
the gate/up tiles' ends, waiting on a ring stage, on a row tile's counter, storing a pending tile
at once; and the tasks taken.

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import inspect
import sys

import torch

import mok_torch as mok
from mok_torch.backends.native import megakernel
from mok_torch.bench.inputs import make_call, make_weights
from mok_torch.bench.shapes import resolve_shapes
from mok_torch.bench.timing import Ranks


def launch_ms(fn, iters: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    names = sys.argv[1:] or ["qwen3-30b-a3b", "sonic-7b"]
    ranks = Ranks(torch.device("cuda", 0), None, 0, 1)
    for shape in resolve_shapes(",".join(names), 1):
        probe(shape, ranks)


def probe(shape, ranks: Ranks) -> None:
    """One shape's untimed and timed launches and the timed one's accounts."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
    cfg = mok.MoKConfig()
    T, H = call.x_TH.shape
    K, E = call.top_experts_TK.shape[1], call.routed[0].shape[0]
    ws = mok.get_workspace(cfg, None, device="cuda", max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    sched = mok.build_schedule(ws, cfg, call.top_experts_TK)
    x = call.x_TH.detach().to(torch.bfloat16).contiguous()
    routed = tuple(w.detach().to(torch.bfloat16).contiguous() for w in call.routed)
    rows = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    slots = len(megakernel.TIMER_SLOTS)
    timers = torch.zeros(sms * len(megakernel.TIMER_ROLES) * slots, dtype=torch.int64, device="cuda")

    # The table's addresses (since session 25; an older build, timed against this one by tools/gpu-check's
    # ab stage, takes the tensors).
    table = (sched.row_route_C.data_ptr(), sched.expert_offsets_El1.data_ptr())
    if "Tensor" in str(inspect.signature(megakernel.moe_forward).parameters["row_route_C"].annotation):
        table = (sched.row_route_C, sched.expert_offsets_El1)

    def run(timed: bool) -> None:
        megakernel.moe_forward(
            ws, *table, x, routed, rows, error, limit=None, timeout_ns=int(30e9), timers=timers if timed else None
        )  # fmt: skip

    untimed, timed = launch_ms(lambda: run(False)), launch_ms(lambda: run(True), iters=1)
    assert int(error[0]) == 0, f"error words {error.tolist()}"
    acc = timers.view(sms, len(megakernel.TIMER_ROLES), slots).double().mean(0)
    print(f"== {shape.name}: the megakernel {untimed:.3f} ms untimed, {timed:.3f} ms timed")
    print(f"{'role':12s}" + "".join(f"{s:>12s}" for s in megakernel.TIMER_SLOTS))
    for r, role in enumerate(megakernel.TIMER_ROLES):
        total = float(acc[r, megakernel.TIMER_SLOTS.index("total")])
        cells = []
        for s, slot in enumerate(megakernel.TIMER_SLOTS):
            v = float(acc[r, s])
            cells.append(f"{v:12.1f}" if slot == "tasks" else f"{100 * v / max(total, 1):11.1f}%")
        print(f"{role:12s}" + "".join(cells))


if __name__ == "__main__":
    main()
