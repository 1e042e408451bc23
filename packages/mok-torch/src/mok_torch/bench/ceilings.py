"""Ceilings: the machine's own rates, measured in the benchmark's process before any layer.

- dense BF16 matmul: torch.mm of two random 8192 x 8192 matrices, 2 * 8192^3 flops;
- FP8 matmul: torch._scaled_mm of e4m3 operands with tensor-wise fp32 scales;
- HBM: a 1 GiB device-to-device copy_, counting the bytes read and the bytes written;
- NVLink (R >= 2), per direction: every rank pulls a 256 MiB buffer from its neighbour's
  symmetric memory with copy_ (each link direction carries one pull); if symmetric memory
  is unavailable, all_to_all_single of 256 MiB per peer, counting the bytes that leave
  (equivalently enter) a rank.

Each is the median over its iterations of the per-iteration maximum over ranks. GPU only:
on the CPU every ceiling is reported as null, and so are the floors built on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .timing import Ranks, line_up, median, synchronize, time_ms

MATMUL_N = 8192
HBM_COPY_BYTES = 1 << 30
NVLINK_COPY_BYTES = 256 << 20
ITERS = 20
WARMUP = 3


@dataclass(frozen=True)
class Ceiling:
    """One measured rate: `value` in `unit` (None when not measured, `skipped` says why)."""

    value: float | None
    unit: str
    method: str
    skipped: str | None = None

    def asdict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Ceilings:
    bf16_matmul: Ceiling  # TFLOP/s
    fp8_matmul: Ceiling  # TFLOP/s
    hbm: Ceiling  # GB/s, read + write
    nvlink: Ceiling  # GB/s per direction

    def matmul(self, precision: str) -> float | None:
        """TFLOP/s of the GEMMs a call in `precision` runs (FP8 when measured, else BF16)."""
        if precision == "mxfp8" and self.fp8_matmul.value is not None:
            return self.fp8_matmul.value
        return self.bf16_matmul.value

    def asdict(self) -> dict[str, Any]:
        return {name: getattr(self, name).asdict() for name in ("bf16_matmul", "fp8_matmul", "hbm", "nvlink")}


def describe_error(exc: BaseException) -> str:
    """The exception's type and first line: enough to say why in a table cell."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def _median_ms(ranks: Ranks, fn: Callable[[], Any]) -> float:
    return median(time_ms(ranks, fn, iters=ITERS, warmup=WARMUP))


def bf16_matmul(ranks: Ranks) -> Ceiling:
    method = f"torch.mm bf16 {MATMUL_N}^3, random data, median of {ITERS}"
    a = torch.randn(MATMUL_N, MATMUL_N, device=ranks.device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device=ranks.device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    ms = _median_ms(ranks, lambda: torch.mm(a, b, out=out))
    return Ceiling(2 * MATMUL_N**3 / (ms * 1e-3) / 1e12, "TFLOP/s", method)


def fp8_matmul(ranks: Ranks) -> Ceiling:
    method = f"torch._scaled_mm e4m3 x e4m3 -> bf16 {MATMUL_N}^3, tensor-wise fp32 scales, median of {ITERS}"

    def run() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)

    # Every rank tries, then all agree: a rank that skips must not leave the others in a barrier.
    error = None
    try:
        a = torch.randn(MATMUL_N, MATMUL_N, device=ranks.device).to(torch.float8_e4m3fn)
        # _scaled_mm wants its second operand column-major.
        b = torch.randn(MATMUL_N, MATMUL_N, device=ranks.device).to(torch.float8_e4m3fn).t()
        scale = torch.ones((), device=ranks.device, dtype=torch.float32)
        run()
        synchronize(ranks)
    except Exception as exc:  # unsupported arch or build: report it, do not fail the run
        error = f"torch._scaled_mm unsupported here: {describe_error(exc)}"
    if not _agree_ok(ranks, error is None):
        return Ceiling(None, "TFLOP/s", method, error or "torch._scaled_mm failed on another rank")
    ms = _median_ms(ranks, run)
    return Ceiling(2 * MATMUL_N**3 / (ms * 1e-3) / 1e12, "TFLOP/s", method)


def hbm_copy(ranks: Ranks) -> Ceiling:
    method = f"copy_ of {HBM_COPY_BYTES >> 20} MiB device to device, bytes read + written, median of {ITERS}"
    src = torch.empty(HBM_COPY_BYTES, dtype=torch.uint8, device=ranks.device).random_()
    dst = torch.empty_like(src)
    ms = _median_ms(ranks, lambda: dst.copy_(src))
    return Ceiling(2 * HBM_COPY_BYTES / (ms * 1e-3) / 1e9, "GB/s", method)


def _agree_ok(ranks: Ranks, ok: bool) -> bool:
    if ranks.world == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=ranks.device)
    dist.all_reduce(flag, group=ranks.group)
    return int(flag.item()) == 0


def _group_for_symm_mem(ranks: Ranks) -> Any:
    return ranks.group if ranks.group is not None else dist.group.WORLD


def nvlink_symm_mem(ranks: Ranks) -> Ceiling:
    """Every rank pulls its right neighbour's symmetric buffer (never multicast)."""
    import torch.distributed._symmetric_memory as symm_mem

    n = NVLINK_COPY_BYTES // 2
    method = (
        f"symmetric memory: every rank pulls {NVLINK_COPY_BYTES >> 20} MiB from its neighbour with copy_, "
        f"median of {ITERS}"
    )
    buf = symm_mem.empty(n, dtype=torch.bfloat16, device=ranks.device)
    buf.fill_(float(ranks.rank))
    group = _group_for_symm_mem(ranks)
    try:
        handle = symm_mem.rendezvous(buf, group)
    except TypeError:  # builds that take the group's name only
        handle = symm_mem.rendezvous(buf, group.group_name)
    peer = (ranks.rank + 1) % ranks.world
    remote = handle.get_buffer(peer, (n,), torch.bfloat16)
    local = torch.empty(n, dtype=torch.bfloat16, device=ranks.device)
    line_up(ranks)
    local.copy_(remote)
    synchronize(ranks)
    if not bool((local[:1] == float(peer)).item()):
        raise RuntimeError("the pulled buffer does not hold the neighbour's data")
    ms = _median_ms(ranks, lambda: local.copy_(remote))
    return Ceiling(NVLINK_COPY_BYTES / (ms * 1e-3) / 1e9, "GB/s per direction", method)


def nvlink_all_to_all(ranks: Ranks) -> Ceiling:
    chunk = NVLINK_COPY_BYTES
    method = (
        f"all_to_all_single, {chunk >> 20} MiB to every peer, bytes leaving a rank per direction, median of {ITERS}"
    )
    send = torch.empty(ranks.world * chunk, dtype=torch.uint8, device=ranks.device).random_()
    recv = torch.empty_like(send)
    ms = _median_ms(ranks, lambda: dist.all_to_all_single(recv, send, group=ranks.group))
    return Ceiling((ranks.world - 1) * chunk / (ms * 1e-3) / 1e9, "GB/s per direction", method)


def nvlink(ranks: Ranks) -> Ceiling:
    unit = "GB/s per direction"
    if ranks.world == 1:
        return Ceiling(None, unit, "none", "one rank: no NVLink traffic")
    error = None
    try:
        result: Ceiling | None = nvlink_symm_mem(ranks)
    except Exception as exc:  # no symmetric memory here: fall back to the collective
        result = None
        error = describe_error(exc)
    # A rank whose pull failed must not time the fallback alone.
    if _agree_ok(ranks, result is not None):
        assert result is not None
        return result
    fallback = nvlink_all_to_all(ranks)
    return Ceiling(fallback.value, unit, f"{fallback.method} (symmetric memory failed: {error or 'on another rank'})")


def cpu_ceilings() -> Ceilings:
    why = "no GPU: ceilings are measured on CUDA devices only"
    return Ceilings(
        Ceiling(None, "TFLOP/s", "none", why),
        Ceiling(None, "TFLOP/s", "none", why),
        Ceiling(None, "GB/s", "none", why),
        Ceiling(None, "GB/s per direction", "none", why),
    )


def measure(ranks: Ranks) -> Ceilings:
    """Every ceiling, in order; collective when R > 1 (all ranks call it)."""
    if not ranks.cuda:
        return cpu_ceilings()
    result = Ceilings(bf16_matmul(ranks), fp8_matmul(ranks), hbm_copy(ranks), nvlink(ranks))
    torch.cuda.empty_cache()
    return result
