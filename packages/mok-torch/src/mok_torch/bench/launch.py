"""`mok bench` / `python -m mok_torch.bench`: options, processes, and the run's output.

One process is EP 1 (group=None). For several GPUs launch one process per GPU:

    torchrun --standalone --nproc-per-node=2 -m mok_torch.bench --shapes seed

(or `mok bench --nproc 2 ...`, which starts the processes itself). Ranks talk over NCCL on
CUDA and gloo on the CPU. NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import BACKENDS, PRECISIONS
from ..progress import progress_bar
from ..testing import ROUTINGS
from . import ceilings as ceilings_mod
from . import report
from .providers import DEFAULT_PROVIDERS, KNOWN_PROVIDERS, make_providers
from .runner import PASSES, Options, run_cases
from .shapes import resolve_shapes
from .timing import Ranks

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
QUICK_PROVIDERS = ("mok", "torch-a2a", "torch-loop")
PASS_CHOICES = {"forward": ("forward",), "backward": ("forward+backward",), "both": PASSES}


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok bench",
        description="The layer benchmark (docs/benchmarks.md): mok against baselines, with ceilings, floors, a plot.",
        epilog="Several GPUs: torchrun --standalone --nproc-per-node=N -m mok_torch.bench ... (or --nproc N).",
    )
    p.add_argument(
        "--shapes",
        help="comma list: seed slices and public models by name, 'seed', 'public', 'all', 'quick', or a custom "
        "H=..,I=..,E=..,K=..,T=..[,Is=..] (E in all; ';' separates it from other items). "
        "Default: all (quick: quick)",
    )
    p.add_argument("--precision", choices=PRECISIONS, default="bf16", help="mok's precision (baselines stay bf16)")
    p.add_argument(
        "--providers",
        help=f"comma list of {', '.join(KNOWN_PROVIDERS)}. Default: {','.join(DEFAULT_PROVIDERS)} "
        f"(quick: {','.join(QUICK_PROVIDERS)})",
    )
    p.add_argument("--backend", default="auto", help=f"mok backend(s), comma list of {', '.join(BACKENDS)}")
    p.add_argument("--routing", default="balanced", help=f"comma list of {', '.join(ROUTINGS)}")
    p.add_argument(
        "--pass",
        dest="pass_",
        choices=tuple(PASS_CHOICES),
        default="both",
        help="forward, backward (= forward+backward timed together) or both",
    )
    p.add_argument("--iters", type=int, help="timed iterations (default 50; quick: 5)")
    p.add_argument("--warmup", type=int, help="untimed iterations first (default 10; quick: 2)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations: a smoke run (CPU or GPU)")
    p.add_argument("--out", default="benchmarks/results", help="directory of the JSON and PNG (default %(default)s)")
    p.add_argument("--allow-slow", action="store_true", help="run the reference backend on shapes too big for it")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when there is a GPU")
    p.add_argument("--nproc", type=int, default=1, help="start this many local ranks (when not under torchrun)")
    return p


def options_from(argv: list[str]) -> tuple[Options, argparse.Namespace]:
    p = parser()
    ns = p.parse_args(argv)
    routings = _csv(ns.routing)
    for r in routings:
        if r not in ROUTINGS:
            p.error(f"unknown routing {r!r} (known: {', '.join(ROUTINGS)})")
    backends = _csv(ns.backend)
    for b in backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r} (known: {', '.join(BACKENDS)})")
    iters = ns.iters if ns.iters is not None else (5 if ns.quick else 50)
    warmup = ns.warmup if ns.warmup is not None else (2 if ns.quick else 10)
    if iters < 1 or warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if ns.nproc < 1:
        p.error("--nproc must be >= 1")
    opts = Options(
        shapes=ns.shapes or ("quick" if ns.quick else "all"),
        precision=ns.precision,
        providers=_csv(ns.providers) if ns.providers else list(QUICK_PROVIDERS if ns.quick else DEFAULT_PROVIDERS),
        backends=backends or ["auto"],
        routings=routings or ["balanced"],
        passes=PASS_CHOICES[ns.pass_],
        iters=iters,
        warmup=warmup,
        quick=ns.quick,
        allow_slow=ns.allow_slow,
        out=ns.out,
        plot=not ns.no_plot,
        argv=list(argv),
    )
    return opts, ns


def bench(opts: Options, ranks: Ranks) -> dict[str, Any]:
    """The whole run on every rank; the report (rank 0 also writes and prints it)."""
    shapes = resolve_shapes(opts.shapes, ranks.world)
    providers = make_providers(opts.providers, opts.backends, opts.precision)
    progress = None
    total = len(shapes) * len(opts.routings) * len(providers)
    if ranks.lead:
        progress = progress_bar(total + 1, "mok bench", unit="case", file=sys.stderr, lines=total + 1, announce=True)
        progress.set_postfix_str("ceilings")
    ceilings = ceilings_mod.measure(ranks)
    if progress is not None:
        progress.update()
    try:
        rows = run_cases(shapes, providers, ranks, opts, ceilings, progress)
    finally:
        if progress is not None:
            progress.close()
    result = report.make_report(
        device=ranks.device,
        world=ranks.world,
        options=opts.asdict(),
        argv=opts.argv,
        ceilings=ceilings.asdict(),
        rows=rows,
    )
    if ranks.lead:
        _print_and_write(result, opts)
    return result


def _print_and_write(result: dict[str, Any], opts: Options) -> None:
    c = result["ceilings"]
    dev = result["device"]
    print(
        f"\nmok bench: {dev['name']}, EP {result['world_size']}, precision {opts.precision}, "
        f"median of {opts.iters} iterations after {opts.warmup} warm-up"
    )
    for name, ceiling in c.items():
        value = "-" if ceiling["value"] is None else f"{ceiling['value']:.0f} {ceiling['unit']}"
        note = ceiling["skipped"] or ceiling["method"]
        print(f"  ceiling {name}: {value} ({note})")
    print()
    print(report.text_table(result["results"]))
    for warning in result.get("warnings", []):
        print(f"warning: {warning}")
    path = report.write_json(result, Path(opts.out))
    print(f"\nwrote {path}")
    if opts.plot:
        png = path.with_suffix(".png")
        if report.plot(result, png):
            print(f"wrote {png}")
        else:
            print("no plot: matplotlib is not installed (pip install mok-torch[bench])")


def _device(choice: str, local_rank: int) -> torch.device:
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise SystemExit("mok bench: --device cuda but torch sees no GPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init_group(device: torch.device, rank: int, world: int) -> Any:
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device, timeout=timedelta(minutes=30))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=30))
    return dist.group.WORLD


def run_process(opts: Options, ns: argparse.Namespace) -> dict[str, Any]:
    """This process's rank of the run: torchrun's environment, or one rank alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(ns.device, local)
    if world == 1:
        return bench(opts, Ranks(device, None, 0, 1))
    group = _init_group(device, rank, world)
    try:
        return bench(opts, Ranks(device, group, rank, world))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(local: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    opts, ns = options_from(argv)
    if not (ns.device == "cuda" or (ns.device == "auto" and torch.cuda.is_available())):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    run_process(opts, ns)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.update(NO_MULTICAST)
    opts, ns = options_from(argv)
    try:
        resolve_shapes(opts.shapes, max(ns.nproc, int(os.environ.get("WORLD_SIZE", "1"))))
        make_providers(opts.providers, opts.backends, opts.precision)
    except ValueError as exc:
        print(f"mok bench: {exc}", file=sys.stderr)
        return 2
    if ns.nproc > 1 and "WORLD_SIZE" not in os.environ:
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(ns.nproc, _free_port(), argv), nprocs=ns.nproc, join=True)
        return 0
    run_process(opts, ns)
    return 0


def component_parser(prog: str, description: str, *, iters: int, warmup: int) -> argparse.ArgumentParser:
    """The options every component benchmark (`mok bench-transport`, `mok bench-quantize`) takes."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--shapes", default="seed", help="as for mok bench (default: seed)")
    p.add_argument("--iters", type=int, default=iters, help="timed iterations (default %(default)s)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed iterations first (default %(default)s)")
    p.add_argument("--out", default="benchmarks/results", help="directory of the JSON (default %(default)s)")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to run (default %(default)s)"
    )
    return p


def one_device_main(
    parser: argparse.ArgumentParser, bench: Callable[[argparse.Namespace, Ranks], Any], argv: list[str] | None
) -> int:
    """`main` of a component benchmark that runs in this process on one device."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = parser.parse_args(argv)
    ns.argv = argv
    bench(ns, Ranks(_device(ns.device, 0), None, 0, 1))
    return 0
