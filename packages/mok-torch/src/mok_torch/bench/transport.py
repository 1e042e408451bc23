"""`mok bench-transport`: the core runtime's component benchmark (docs/benchmarks.md).

For every shape (seed slices by default, balanced routing) it builds the native backend's
workspace and schedule and measures, in one process per GPU:

- pull dispatch and push combine of the layer's x rows (the rows of this rank's table),
  at several CTA counts ("communication SMs"), as GB/s per direction: the bytes that cross
  the link (rows whose source is another rank) over the time, busiest rank;
- `all_to_all_single` of the same rows (what the torch-a2a baseline does) in the same run;
- the device barrier: back to back, and in a CUDA graph (no launch cost);
- the schedule build (two barriers, the table, the send side) and the table kernel alone,
  and the schedule's share of the torch-a2a forward of the same shape;
- the combine epilogue;
and reports them against the NVLink ceiling measured at the start.

    torchrun --standalone --nproc-per-node=2 -m mok_torch.bench.transport --out DIR
    mok bench-transport --nproc 2 --out DIR

Writes `<out>/<date>_<device>_transport-ep<R>.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from .. import create_workspace
from ..backends.native.transport import Transport
from ..config import MoKConfig
from ..functional import build_schedule
from ..testing import make_routing
from . import ceilings as ceilings_mod
from . import report
from .inputs import case_seed, make_call, make_weights
from .launch import NO_MULTICAST, _device, _free_port, _init_group, component_parser
from .providers import Settings, TorchA2AProvider
from .shapes import resolve_shapes
from .timing import Ranks, median, reduce_max, synchronize, time_ms

CTA_COUNTS = (2, 4, 8, 16, 24, 32)


def _gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0


def _barrier_us(ranks: Ranks, tr: Transport, count: int, graph: bool) -> float:
    """Microseconds per barrier, `count` back to back (in one CUDA graph when `graph`)."""
    stage = 9
    if graph and ranks.cuda:
        side = torch.cuda.Stream(ranks.device)
        side.wait_stream(torch.cuda.current_stream(ranks.device))
        with torch.cuda.stream(side):
            tr.barrier(stage)
        torch.cuda.current_stream(ranks.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(count):
                tr.barrier(stage)
        run = g.replay
    else:

        def run() -> None:
            for _ in range(count):
                tr.barrier(stage)

    ms = median(time_ms(ranks, run, iters=10, warmup=2))
    return ms * 1e3 / count


def measure_shape(shape: Any, ranks: Ranks, iters: int, warmup: int) -> dict[str, Any]:
    dev = ranks.device
    backend = "cuda" if ranks.cuda else "cpu"
    cfg = MoKConfig(backend=backend, expert_alignment=128)
    T, K, H, E = shape.tokens, shape.topk, shape.hidden, shape.experts
    ws = create_workspace(cfg, ranks.group, device=dev, max_tokens=T, hidden_size=H, topk=K, num_experts=E)
    g = torch.Generator().manual_seed(case_seed(shape, ranks.rank))
    top, _ = make_routing(T, E, K, "balanced", generator=g)
    top = top.to(dev)
    sched = build_schedule(ws, cfg, top)
    tr: Transport = ws.state["native"]
    tr.view["x_src"][:T].copy_(torch.randn(T, H, device=dev).to(torch.bfloat16))
    tr.barrier(3)
    n = int(sched.expert_offsets_El1[-1])
    src, route = sched.row_src_rank_C[:n], sched.row_route_C[:n]
    remote = int(((src >= 0) & (src != ranks.rank)).sum())
    local = int((src == ranks.rank).sum())
    row_bytes = H * 2
    # the busiest rank's link bytes (per direction) and its rows
    link_bytes = max(reduce_max(ranks, [float(remote * row_bytes)]))
    rows = torch.empty(n, H, dtype=torch.bfloat16, device=dev)
    out: dict[str, Any] = {
        "shape": shape.describe(),
        "rows": n,
        "remote_rows": remote,
        "local_rows": local,
        "link_bytes_per_direction": link_bytes,
        "pull": {},
        "push": {},
    }
    for ctas in CTA_COUNTS:

        def pull_rows(c: int = ctas) -> None:
            tr.pull(rows, "x_src", (src, route), K, c)

        def push_rows(c: int = ctas) -> None:
            tr.push(rows, "rows", (src, route), c)

        pull = median(time_ms(ranks, pull_rows, iters=iters, warmup=warmup))
        push = median(time_ms(ranks, push_rows, iters=iters, warmup=warmup))
        out["pull"][str(ctas)] = {"ms": pull, "GBps_per_direction": _gbps(link_bytes, pull)}
        out["push"][str(ctas)] = {"ms": push, "GBps_per_direction": _gbps(link_bytes, push)}
    if ranks.world > 1:
        send = torch.randn(T * K, H, device=dev).to(torch.bfloat16)
        send_counts, recv_counts = sched.send_counts_R.tolist(), sched.recv_counts_R.tolist()
        recv = torch.empty(sum(recv_counts), H, dtype=torch.bfloat16, device=dev)
        a2a = median(
            time_ms(
                ranks,
                lambda: dist.all_to_all_single(recv, send, recv_counts, send_counts, group=ranks.group),
                iters=iters,
                warmup=warmup,
            )
        )
        out["all_to_all_single"] = {"ms": a2a, "GBps_per_direction": _gbps(link_bytes, a2a)}
    out["barrier_us"] = {
        "back_to_back": _barrier_us(ranks, tr, 200, graph=False),
        "in_cuda_graph": _barrier_us(ranks, tr, 200, graph=True) if ranks.cuda else None,
    }
    out["schedule_ms"] = median(time_ms(ranks, lambda: build_schedule(ws, cfg, top), iters=iters, warmup=warmup))
    core, C, El = tr.core, ws.capacity, ws.num_local_experts
    t = {k: torch.empty(s, dtype=d, device=dev) for k, s, d in (
        ("src", C, torch.int32), ("route", C, torch.int32), ("off", El + 1, torch.int32), ("cnt", El, torch.int32),
        ("recv", ranks.world, torch.int64), ("tok", ranks.world, torch.int64),
    )}  # fmt: skip

    def table() -> None:
        core.build_table(
            backend, tr.ptrs["routes"].data_ptr(), tr.ptrs["tokens"].data_ptr(), ranks.world, T, K, ranks.rank, El,
            128, C, t["src"].data_ptr(), t["route"].data_ptr(), t["off"].data_ptr(), t["cnt"].data_ptr(),
            t["recv"].data_ptr(), t["tok"].data_ptr(), tr._stream(),
        )  # fmt: skip

    out["table_kernel_ms"] = median(time_ms(ranks, table, iters=iters, warmup=warmup))
    assert torch.equal(t["src"], sched.row_src_rank_C) and torch.equal(t["route"], sched.row_route_C)
    y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    w = torch.rand(T * K, device=dev)
    combine_rows = tr.view["rows"][: T * K]

    def combine() -> None:
        core.combine(backend, y.data_ptr(), 0, combine_rows.data_ptr(), w.data_ptr(), T, K, H, tr._stream())

    comb = median(time_ms(ranks, combine, iters=iters, warmup=warmup))
    out["combine"] = {"ms": comb, "GBps_hbm": _gbps((T * K + T) * H * 2 + T * K * 4, comb)}
    # the layer the schedule is part of: today's baseline forward on the same shape
    call = make_call(shape, "balanced", make_weights(shape, ranks), ranks)
    fwd = TorchA2AProvider(False).prepare(call, ranks, Settings(allow_slow=False))
    with torch.no_grad():
        a2a_fwd = median(time_ms(ranks, fwd, iters=iters, warmup=warmup))
    out["torch_a2a_forward_ms"] = a2a_fwd
    out["schedule_share_of_torch_a2a_forward"] = out["schedule_ms"] / a2a_fwd
    synchronize(ranks)
    return out


def bench(ns: argparse.Namespace, ranks: Ranks) -> dict[str, Any]:
    shapes = [s for s in resolve_shapes(ns.shapes, ranks.world) if s.skip is None]
    ceiling = ceilings_mod.nvlink(ranks) if ranks.cuda else None
    hbm = ceilings_mod.hbm_copy(ranks) if ranks.cuda else None
    results = []
    for shape in shapes:
        results.append(measure_shape(shape, ranks, ns.iters, ns.warmup))
        if ranks.cuda:
            torch.cuda.empty_cache()
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    device = report.device_info(ranks.device)
    doc: dict[str, Any] = {
        "schema": "mok-bench-transport/1",
        "created": created,
        "device": device,
        "world_size": ranks.world,
        "versions": report.versions(),
        "git": report.git_state(),
        "command": " ".join(["mok", "bench-transport", *sys.argv[1:]]),
        "ceilings": {
            "nvlink": None if ceiling is None else ceiling.asdict(),
            "hbm_copy": None if hbm is None else hbm.asdict(),
        },
        "results": results,
    }
    if ranks.lead:
        _print(doc)
        report.write_component(doc, ns.out, f"transport-ep{ranks.world}")
    return doc


def _rates(per_cta: dict[str, Any]) -> str:
    return " ".join(f"{ctas}:{v['GBps_per_direction']:.0f}" for ctas, v in per_cta.items())


def fewest_ctas(per_cta: dict[str, Any], rate: float) -> int | None:
    """The fewest CTAs measured to reach `rate` GB/s per direction (None: no count did)."""
    hits = [int(c) for c, v in per_cta.items() if v["GBps_per_direction"] >= rate]
    return min(hits) if hits else None


def _print(doc: dict[str, Any]) -> None:
    link = doc["ceilings"]["nvlink"]
    rate = "-" if not link or link["value"] is None else f"{link['value']:.0f} GB/s per direction"
    print(f"\nmok bench-transport: {doc['device']['name']}, EP {doc['world_size']}, NVLink ceiling {rate}")
    print("GB/s per direction by CTA count; barrier back to back / in a CUDA graph")
    for r in doc["results"]:
        a2a = r.get("all_to_all_single")
        a2a_rate = "-" if a2a is None else f"{a2a['GBps_per_direction']:.0f}"
        bar = r["barrier_us"]
        graph = "-" if bar["in_cuda_graph"] is None else f"{bar['in_cuda_graph']:.1f}"
        share = 100 * r["schedule_share_of_torch_a2a_forward"]
        print(
            f"{r['shape']['name']:<20} rows {r['rows']:>6} (remote {r['remote_rows']:>6})  "
            f"pull {_rates(r['pull'])}  push {_rates(r['push'])}  a2a {a2a_rate}  "
            f"barrier {bar['back_to_back']:.1f}/{graph} us  "
            f"schedule {r['schedule_ms'] * 1e3:.0f} us (table {r['table_kernel_ms'] * 1e3:.0f} us, "
            f"{share:.1f}% of torch-a2a fwd)  combine {r['combine']['ms'] * 1e3:.0f} us"
        )
    if link and link["value"]:
        goal = 0.9 * link["value"]
        print(f"fewest CTAs reaching 90% of NVLink ({goal:.0f} GB/s; None: no count measured did):")
        for r in doc["results"]:
            print(
                f"  {r['shape']['name']:<20} pull {fewest_ctas(r['pull'], goal)}  push {fewest_ctas(r['push'], goal)}"
            )


def _run(ns: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = _device(ns.device, int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1:
        bench(ns, Ranks(device, None, 0, 1))
        return
    group = _init_group(device, rank, world)
    try:
        bench(ns, Ranks(device, group, rank, world))
    finally:
        dist.destroy_process_group()


def _spawned(local: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run(parser().parse_args(argv))


def parser() -> argparse.ArgumentParser:
    p = component_parser("mok bench-transport", __doc__.split("\n\n")[0], iters=50, warmup=5)
    p.add_argument("--nproc", type=int, default=1, help="ranks, one process each (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.update(NO_MULTICAST)
    ns = parser().parse_args(argv)
    if ns.nproc > 1 and "WORLD_SIZE" not in os.environ:
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(ns.nproc, _free_port(), argv), nprocs=ns.nproc, join=True)
        return 0
    _run(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
