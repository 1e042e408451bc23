"""Where the forward megakernel's time goes, per kind of task: one timed launch (its own
instantiation of the kernel, accounts of clock64 cycles per CTA and role) after untimed ones.

    python3 benchmarks/probes/megakernel_timers.py [shape ...]

Prints, per shape, the untimed and timed launches' times (CUDA events) and, per role (the
producer's thread 0, each consumer warpgroup's leader), each account's mean over the CTAs as a
share of the role's total: waiting for a ticket, in gate/up and down tasks, on h (the SwiGLU) at
the gate/up tiles' ends, waiting on a ring stage, on a row tile's counter, storing a pending tile
at once; and the tasks taken.

Then the launch across ranks against one rank's, in turns (`across_ranks`): the same table with
the tokens split into R ranks' rows on this device (rank s the s-th T / R of them; each row read
from its rank's x and stored into its rank's output rows by address, as at EP > 1 with the peers'
segments), so that only the kernel's per-row bases differ; the outputs must be bitwise equal.

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
    across_ranks(ws, sched, x, routed, rows, error)


def across_ranks(ws, sched, x, routed, rows, error, R: int = 2, rounds: int = 3) -> None:
    """One rank's launch and the launch across R ranks' rows (all on this device), in turns."""
    import mok_bf16

    T, H = x.shape
    K, C, El = ws.topk, ws.capacity, routed[0].shape[0]
    inner = routed[0].shape[1]
    if T % R:
        print(f"   across {R} ranks: T = {T} is not a multiple of {R}; skipped")
        return
    Tr = T // R
    route = sched.row_route_C
    src = torch.where(route >= 0, route // (Tr * K), 0).to(torch.int32)
    route_r = torch.where(route >= 0, route % (Tr * K), -1).to(torch.int32)
    x_R = torch.tensor([x.data_ptr() + s * Tr * H * 2 for s in range(R)], dtype=torch.int64, device="cuda")
    rows_r = torch.empty_like(rows)
    out_R = torch.tensor([rows_r.data_ptr() + s * Tr * K * H * 2 for s in range(R)], dtype=torch.int64, device="cuda")
    a, b, xr = (torch.empty(C, n, dtype=torch.bfloat16, device="cuda") for n in (inner, inner, H))
    h = torch.empty(C, inner, dtype=torch.bfloat16, device="cuda")
    state = megakernel.task_state(ws)
    stream = torch.cuda.current_stream().cuda_stream

    def run(across: bool) -> None:
        kw = dict(world_size=R, row_src=src.data_ptr(), x_ranks=x_R.data_ptr(), out_rows_ranks=out_R.data_ptr())
        mok_bf16.moe_forward(
            "cuda", 0 if across else x.data_ptr(), (route_r if across else route).data_ptr(),
            sched.expert_offsets_El1.data_ptr(), *(w.data_ptr() for w in routed), a.data_ptr(), b.data_ptr(),
            h.data_ptr(), 0 if across else rows.data_ptr(), state.data_ptr(), error.data_ptr(), C,
            Tr if across else T, H, inner, El, K, timeout_ns=int(30e9), stage=megakernel.STAGE, stream=stream,
            out_x=xr.data_ptr(), **(kw if across else {}),
        )  # fmt: skip

    try:  # (a build from before the kernel's per-rank bases refuses world_size > 1)
        run(True)
    except RuntimeError as exc:
        print(f"   across {R} ranks: not run ({exc})")
        return
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for across in (False, True):
            times[across].append(launch_ms(lambda: run(across), iters=10))  # noqa: B023
    run(False)
    run(True)
    torch.cuda.synchronize()
    assert int(error[0]) == 0, f"error words {error.tolist()}"
    same = torch.equal(rows.view(torch.int16), rows_r.view(torch.int16))
    one, many = min(times[False]), min(times[True])
    print(
        f"   across {R} ranks' rows: {many:.3f} ms against one rank's {one:.3f} ms ({100 * (many / one - 1):+.1f} %;"
        f" best of {rounds} rounds of 10 in turns), bitwise {'yes' if same else 'NO'}"
    )


if __name__ == "__main__":
    main()
