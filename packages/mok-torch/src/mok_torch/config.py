"""MoKConfig: the knobs of a mok layer call.

None of these knobs changes a single bit of the results (docs/determinism.md): they trade memory
for speed or pick an implementation. The determinism tests run every knob at several values
and compare bitwise.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields

PRECISIONS = ("bf16", "mxfp8")
BACKENDS = ("auto", "reference", "cpu", "cuda")
DIRECTIONS = ("pull", "push")

# Hopper SM count, used by the minibatch heuristic when no device reports its own.
DEFAULT_NUM_SMS = 132
# GEMM tile the heuristic plans waves with (the wgmma kernels' CTA tile).
HEURISTIC_TILE_M = 128
HEURISTIC_TILE_N = 128

# The limits of mok-core (packages/mok-core) and of torch's waits, checked where a config is made,
# so that every backend accepts the same configs (the reference one never reaches mok-core) and an
# error names the setting. tests/layer/test_config_limits.py holds them against mok-core and torch.
# The most workers one row move may use: transport::kMaxWorkers (include/mok/core/transport.h).
MAX_COMM_SMS = 1024
# Rows of the schedule table, int32 indices: kMaxTableRows (include/mok/core/schedule.h).
MAX_TABLE_ROWS = 2**31 - 1
# timeout_s: the native barriers wait an int64 count of nanoseconds > 0 (src/transport.cpp:
# barrier), so at least 1 ns; torch's Work.wait on gloo (the settings check across ranks) adds its
# timeout to the steady clock's int64 nanoseconds and fires at once from about 2^63 ns less the
# uptime (measured), so at most 1e9 s (31.7 years), far from it.
MIN_TIMEOUT_S = 1e-9
MAX_TIMEOUT_S = 1e9
# The SwiGLU clamp is an fp32 value (include/mok/core/expert_math.h: SwigluLimit), and torch
# refuses to clamp fp32 data with a Python float past fp32's range.
MAX_SWIGLU_LIMIT = 3.4028234663852886e38  # FLT_MAX


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _check_int(
    name: str, value: object, *, minimum: int, maximum: int | None = None, why: str = "", allow_none: bool = False
) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"MoKConfig.{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"MoKConfig.{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"MoKConfig.{name} must be <= {maximum}{why}, got {value}")


def _timeout_ns(seconds: float) -> int:
    """timeout_s as the nanoseconds the native barriers wait (truncated, as they always were)."""
    return int(seconds * 1e9)


@dataclass(frozen=True)
class MoKConfig:
    """Configuration of a mok MoE layer call.

    Args:
        precision: "bf16" or "mxfp8" (expert GEMM operands; activations stay bf16).
        backend: "auto" (fastest available for the device), "reference" (pure PyTorch,
            always available), "cpu" or "cuda" (compiled packages).
        fwd_num_comm_sms / bwd_num_comm_sms: CTAs the fused GPU kernels give to
            communication in the forward / backward pass, threads of a row move on the CPU
            (even, in [2, 1024]).
        minibatch_size: routed rows per minibatch, the overlap granularity (a multiple of
            `expert_alignment`, <= 2^31 - 1 like the table); None picks "two full waves of
            GEMM tiles".
        macrobatch_size: rows of the ring buffer that holds routed activations (a multiple of
            `minibatch_size`, <= 2^31 - 1); None keeps all rows (no replay in backward).
        expert_alignment: each expert's row segment starts at a multiple of this (a power
            of two). The `cuda` backend's BF16 backward kernels need a multiple of 64 (their
            weight gradients take 64-row blocks from each segment start); with less it runs
            the routed experts' backward in the reference arithmetic (slow).
        swiglu_limit: optional clamp `a <= limit`, `-limit <= b <= limit` (gpt-oss style), in
            (0, FLT_MAX]: it is applied in fp32.
        timeout_s: how long a wait on another rank may take before it raises, in seconds, in
            [1e-9, 1e9] (1 ns to 31.7 years).
        dispatch: who moves the experts' input rows (x, and dy and w in backward) in the
            native backends: "pull" (default: the expert's rank reads them from the source
            ranks) or "push" (each source rank writes its routes' rows into the expert ranks'
            tables; one more buffer of the table's size per input on every rank).
        combine: who moves the experts' output rows (y, and dx and d_w in backward): "push"
            (default: the expert's rank writes each row to its route on the source rank) or
            "pull" (each source rank reads its routes' rows from the expert ranks; one more
            buffer of the table's size). The reference backend moves rows with collectives and
            ignores both. Defaults measured: docs/core-runtime.md "Directions".
        megakernel: let the cuda backend run the routed experts' forward as one persistent
            kernel where it applies and was measured faster (one rank, hidden sizes below
            4096: docs/megakernel.md), and the cpu backend run it as the same one call on the
            host (BF16; across ranks with a pull dispatch and a push combine); False keeps the
            chain of grouped kernels (of row moves and per-row loops on the CPU). The same bits
            either way.
    """

    precision: str = "bf16"
    backend: str = "auto"
    fwd_num_comm_sms: int = 16
    bwd_num_comm_sms: int = 16
    minibatch_size: int | None = None
    macrobatch_size: int | None = None
    expert_alignment: int = 128
    swiglu_limit: float | None = None
    timeout_s: float = 300.0
    dispatch: str = "pull"
    combine: str = "push"
    megakernel: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"MoKConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"MoKConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("dispatch", "combine"):
            if getattr(self, name) not in DIRECTIONS:
                raise ValueError(f"MoKConfig.{name} must be one of {DIRECTIONS}, got {getattr(self, name)!r}")
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            value = getattr(self, name)
            _check_int(name, value, minimum=2, maximum=MAX_COMM_SMS, why=" (mok-core's transport::kMaxWorkers)")
            if value % 2:
                raise ValueError(f"MoKConfig.{name} must be even, got {value}")
        _check_int("expert_alignment", self.expert_alignment, minimum=1)
        if not _is_power_of_two(self.expert_alignment) or self.expert_alignment > 1024:
            raise ValueError(f"MoKConfig.expert_alignment must be a power of two <= 1024, got {self.expert_alignment}")
        if self.precision == "mxfp8" and self.expert_alignment % 32:
            raise ValueError(
                f"MoKConfig.expert_alignment must be a multiple of 32 for precision 'mxfp8' (weight-gradient "
                f"operands are quantized in 32-row blocks that must not straddle experts), got {self.expert_alignment}"
            )
        for name in ("minibatch_size", "macrobatch_size"):
            value = getattr(self, name)
            _check_int(
                name,
                value,
                minimum=1,
                maximum=MAX_TABLE_ROWS,
                why=" (rows of the schedule table, int32 in mok-core)",
                allow_none=True,
            )
            if value is not None and value % self.expert_alignment:
                raise ValueError(
                    f"MoKConfig.{name} ({value}) must be a multiple of expert_alignment ({self.expert_alignment})"
                )
        if (
            self.minibatch_size is not None
            and self.macrobatch_size is not None
            and self.macrobatch_size % self.minibatch_size
        ):
            raise ValueError(
                f"MoKConfig.macrobatch_size ({self.macrobatch_size}) must be a multiple of "
                f"minibatch_size ({self.minibatch_size})"
            )
        if self.swiglu_limit is not None:
            if isinstance(self.swiglu_limit, bool) or not isinstance(self.swiglu_limit, (int, float)):
                raise TypeError(
                    f"MoKConfig.swiglu_limit must be a float or None, got {type(self.swiglu_limit).__name__}"
                )
            # A chained comparison: false for NaN and inf, and no OverflowError for a huge int.
            if not 0 < self.swiglu_limit <= MAX_SWIGLU_LIMIT:
                raise ValueError(
                    f"MoKConfig.swiglu_limit must be finite, > 0 and <= {MAX_SWIGLU_LIMIT!r} (the largest fp32 "
                    f"value: the clamp is applied in fp32), got {self.swiglu_limit!r}"
                )
        if not isinstance(self.megakernel, bool):
            raise TypeError(f"MoKConfig.megakernel must be a bool, got {type(self.megakernel).__name__}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise TypeError(f"MoKConfig.timeout_s must be a number, got {type(self.timeout_s).__name__}")
        # A chained comparison, as for swiglu_limit; 1e-9 * 1e9 is exactly 1 (ns).
        if not MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"MoKConfig.timeout_s must be in [1e-9, 1e9] seconds (the native barriers wait a whole number of "
                f"nanoseconds >= 1; torch's waits overflow int64 nanoseconds near 9.2e9 s), got {self.timeout_s!r}"
            )
        # A string that names this config exactly: custom ops take it instead of the object.
        object.__setattr__(self, "_key", json.dumps(asdict(self), sort_keys=True))

    @property
    def key(self) -> str:
        """A JSON string equal for equal configs; `MoKConfig.from_key` inverts it."""
        return self._key  # type: ignore[attr-defined,no-any-return]

    @property
    def timeout_ns(self) -> int:
        """timeout_s in nanoseconds, the int64 count the native barriers take (1 to 1e18)."""
        return _timeout_ns(self.timeout_s)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def from_key(key: str) -> MoKConfig:
        return MoKConfig(**json.loads(key))

    def replace(self, **changes: object) -> MoKConfig:
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(f"MoKConfig has no field(s) {sorted(unknown)}")
        values.update(changes)
        return MoKConfig(**values)  # type: ignore[arg-type]


@functools.cache
def default_config() -> MoKConfig:
    """MoKConfig(), made once: what a call given no config runs with (a frozen config, so one
    object serves every call; making it validates every field and writes its key, 20-40 us of
    host a call)."""
    return MoKConfig()


def default_minibatch_size(
    hidden_size: int,
    intermediate_size: int,
    expert_alignment: int,
    num_sms: int = DEFAULT_NUM_SMS,
) -> int:
    """Rows per minibatch so that each expert GEMM of a minibatch fills two waves of tiles.

    The GEMM with the fewest output tiles per row block (gate+up has 2I columns, down has H)
    sets the count; the result is rounded up to the expert alignment.
    """
    tiles_per_row_block = min(
        math.ceil(2 * intermediate_size / HEURISTIC_TILE_N), math.ceil(hidden_size / HEURISTIC_TILE_N)
    )
    row_blocks = math.ceil(2 * num_sms / max(tiles_per_row_block, 1))
    rows = row_blocks * HEURISTIC_TILE_M
    return math.ceil(rows / expert_alignment) * expert_alignment


def resolve_batching(cfg: MoKConfig, hidden_size: int, intermediate_size: int, num_sms: int) -> tuple[int, int | None]:
    """(minibatch rows, macrobatch rows or None) that a layer call uses for `cfg`."""
    align = cfg.expert_alignment
    minibatch = cfg.minibatch_size or default_minibatch_size(hidden_size, intermediate_size, align, num_sms)
    macrobatch = cfg.macrobatch_size
    if macrobatch is not None and cfg.minibatch_size is None:
        # The heuristic's minibatch must tile the ring exactly: take its largest aligned divisor.
        minibatch = min(minibatch, macrobatch)
        while macrobatch % minibatch:
            minibatch -= align
    return minibatch, macrobatch
