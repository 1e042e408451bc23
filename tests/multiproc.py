"""Run a function on R ranks in separate processes (gloo on CPU, NCCL on GPUs).

The function runs as fn(rank, world, group, *args) and returns a picklable result; the
parent gets the list of results in rank order.
"""

from __future__ import annotations

import importlib
import os
import socket
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Multicast/NVLS stays off on every GPU machine we use (see GPU.md).
_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# CPU ranks start from a fork server that has imported torch and mok once (a fresh interpreter
# per rank spends seconds importing them; on a 2-core machine that was most of a multi-rank
# test). GPU ranks start fresh (spawn): no process they come from has touched CUDA.
mp.set_forkserver_preload(["torch", "torch.distributed", "mok_torch", "mok_torch.testing", "helpers"])


def _start_method(device: str) -> str:
    return "forkserver" if device == "cpu" else "spawn"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, device: str, target: str, args: tuple, outdir: str) -> None:
    os.environ.update(_SAFE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    kw = {"device_id": torch.device("cuda", rank)} if device == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=180), **kw)
    try:
        module, name = target.rsplit(".", 1)
        fn = getattr(importlib.import_module(module), name)
        result = fn(rank, world, dist.group.WORLD, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, target: str, *args: Any, device: str = "cpu") -> list[Any]:
    """Results of `target` ("module.function") on ranks 0..world-1."""
    if device == "cuda" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks need {world} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _worker, args=(world, _free_port(), device, target, args, outdir), nprocs=world, join=True,
            start_method=_start_method(device),
        )  # fmt: skip
        return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]


def run_ranks_with_faults(
    world: int, target: str, *args: Any, survivors: list[int], device: str = "cpu", deadline_s: float = 120.0
) -> tuple[list[Any], list[int | None]]:
    """`target` on ranks 0..world-1 where the ranks not in `survivors` may die, exit early or hang:
    (results, exit codes) once every survivor has exited (at most `deadline_s`), a result None for
    a rank that saved none. A rank still running then is killed (its exit code is negative)."""
    import time

    ctx = mp.get_context(_start_method(device))
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, device, target, args, outdir)) for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and any(procs[r].is_alive() for r in survivors):
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        paths = [os.path.join(outdir, f"rank{r}.pt") for r in range(world)]
        results = [torch.load(path) if os.path.exists(path) else None for path in paths]
        return results, [p.exitcode for p in procs]
