"""MoKConfig's value ranges and the workspace's size bounds: what mok-core accepts, named up front.

Every backend must accept the same configs, so the limits of mok-core (which the reference
backend never reaches) are checked where a config is made or replaced, and where a workspace
is made, each with an error that names the setting and its range.

- A bad value raises on construction and on replace; the boundary values are accepted.
- The limits are held against mok-core itself (skipped without mok_core): the value at the
  bound passes its argument checks, the one past it does not.
- The boundary configs run forward and backward on the backend under test (EP 1, and EP 2 for
  the barriers' and torch's waits) with bitwise the results of the default config: the knobs do
  not change a bit (docs/determinism.md).

Shape letters: docs/design.md §1.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import BACKEND, DEVICE, assert_bitwise, config, run_functional
from multiproc import run_ranks

import mok_torch as mok
from mok_torch.config import MAX_COMM_SMS, MAX_SWIGLU_LIMIT, MAX_TABLE_ROWS, MAX_TIMEOUT_S
from mok_torch.testing import make_inputs
from mok_torch.workspace import MAX_EXPERTS

T, H, I, E, K, Is = 12, 32, 16, 4, 2, 8
ALIGN = 8

# The largest timeout_s whose int(timeout_s * 1e9) fits int64 (about 292 years): mok-core takes
# it, torch's waits do not (they time out at once).
INT64_NS_TIMEOUT_S = 9223372036.854774
# The largest multiple of ALIGN that a table's int32 rows can count.
LARGEST_BATCH = MAX_TABLE_ROWS // ALIGN * ALIGN

TIMEOUT_RANGE = r"MoKConfig\.timeout_s must be in \[1e-9, 1e9\] seconds"
SWIGLU_RANGE = r"MoKConfig\.swiglu_limit must be finite, > 0 and <= 3\.4028234663852886e\+38"

BAD_CONFIGS = [
    pytest.param(
        dict(fwd_num_comm_sms=2048), ValueError, r"MoKConfig\.fwd_num_comm_sms must be <= 1024", id="fwd-sms-2048"
    ),
    pytest.param(
        dict(bwd_num_comm_sms=2048), ValueError, r"MoKConfig\.bwd_num_comm_sms must be <= 1024", id="bwd-sms-2048"
    ),
    pytest.param(
        dict(fwd_num_comm_sms=1026), ValueError, r"MoKConfig\.fwd_num_comm_sms must be <= 1024", id="fwd-sms-1026"
    ),
    pytest.param(
        dict(bwd_num_comm_sms=1025), ValueError, r"MoKConfig\.bwd_num_comm_sms must be <= 1024", id="bwd-sms-1025"
    ),
    pytest.param(
        dict(fwd_num_comm_sms=True), TypeError, r"MoKConfig\.fwd_num_comm_sms must be an int", id="fwd-sms-bool"
    ),
    pytest.param(
        dict(bwd_num_comm_sms=16.0), TypeError, r"MoKConfig\.bwd_num_comm_sms must be an int", id="bwd-sms-float"
    ),
    pytest.param(dict(timeout_s=math.inf), ValueError, TIMEOUT_RANGE, id="timeout-inf"),
    pytest.param(dict(timeout_s=-math.inf), ValueError, TIMEOUT_RANGE, id="timeout-minus-inf"),
    pytest.param(dict(timeout_s=math.nan), ValueError, TIMEOUT_RANGE, id="timeout-nan"),
    pytest.param(dict(timeout_s=1e20), ValueError, TIMEOUT_RANGE, id="timeout-1e20"),
    pytest.param(dict(timeout_s=9223372036.854776), ValueError, TIMEOUT_RANGE, id="timeout-past-int64-ns"),
    pytest.param(dict(timeout_s=INT64_NS_TIMEOUT_S), ValueError, TIMEOUT_RANGE, id="timeout-int64-ns"),
    pytest.param(dict(timeout_s=math.nextafter(1e9, math.inf)), ValueError, TIMEOUT_RANGE, id="timeout-past-1e9"),
    pytest.param(dict(timeout_s=10**9 + 1), ValueError, TIMEOUT_RANGE, id="timeout-int-past-1e9"),
    pytest.param(dict(timeout_s=10**400), ValueError, TIMEOUT_RANGE, id="timeout-int-past-float"),
    pytest.param(dict(timeout_s=1e-12), ValueError, TIMEOUT_RANGE, id="timeout-1e-12"),
    pytest.param(dict(timeout_s=9.9e-10), ValueError, TIMEOUT_RANGE, id="timeout-under-1ns"),
    pytest.param(dict(timeout_s=0.0), ValueError, TIMEOUT_RANGE, id="timeout-zero"),
    pytest.param(dict(timeout_s=-1), ValueError, TIMEOUT_RANGE, id="timeout-negative"),
    pytest.param(
        dict(timeout_s=True), TypeError, r"MoKConfig\.timeout_s must be a number, got bool", id="timeout-bool"
    ),
    pytest.param(dict(timeout_s="300"), TypeError, r"MoKConfig\.timeout_s must be a number, got str", id="timeout-str"),
    pytest.param(dict(timeout_s=None), TypeError, r"MoKConfig\.timeout_s must be a number", id="timeout-none"),
    pytest.param(dict(swiglu_limit=1e300), ValueError, SWIGLU_RANGE, id="swiglu-past-fp32"),
    pytest.param(dict(swiglu_limit=10**400), ValueError, SWIGLU_RANGE, id="swiglu-int-past-float"),
    pytest.param(dict(swiglu_limit=math.inf), ValueError, SWIGLU_RANGE, id="swiglu-inf"),
    pytest.param(dict(swiglu_limit=math.nan), ValueError, SWIGLU_RANGE, id="swiglu-nan"),
    pytest.param(dict(swiglu_limit=0.0), ValueError, SWIGLU_RANGE, id="swiglu-zero"),
    pytest.param(
        dict(swiglu_limit=True), TypeError, r"MoKConfig\.swiglu_limit must be a float or None", id="swiglu-bool"
    ),
    pytest.param(
        dict(minibatch_size=2**40), ValueError, r"MoKConfig\.minibatch_size must be <= 2147483647", id="minibatch-2**40"
    ),
    pytest.param(
        dict(macrobatch_size=2**31),
        ValueError,
        r"MoKConfig\.macrobatch_size must be <= 2147483647",
        id="macrobatch-2**31",
    ),
    pytest.param(
        dict(minibatch_size=2**64), ValueError, r"MoKConfig\.minibatch_size must be <= 2147483647", id="minibatch-2**64"
    ),
    pytest.param(
        dict(macrobatch_size=True), TypeError, r"MoKConfig\.macrobatch_size must be an int", id="macrobatch-bool"
    ),
    pytest.param(
        dict(expert_alignment=2048),
        ValueError,
        r"MoKConfig\.expert_alignment must be a power of two <= 1024",
        id="align-2048",
    ),
    pytest.param(dict(expert_alignment=0), ValueError, r"MoKConfig\.expert_alignment must be >= 1", id="align-0"),
    pytest.param(dict(megakernel=1), TypeError, r"MoKConfig\.megakernel must be a bool", id="megakernel-int"),
]

# Each at a bound of its range (the other fields at their defaults, or as given).
BOUNDARY_CONFIGS = [
    pytest.param(dict(fwd_num_comm_sms=2, bwd_num_comm_sms=2), id="sms-2"),
    pytest.param(dict(fwd_num_comm_sms=MAX_COMM_SMS, bwd_num_comm_sms=MAX_COMM_SMS), id="sms-1024"),
    pytest.param(dict(timeout_s=1e-9), id="timeout-1ns"),
    pytest.param(dict(timeout_s=1), id="timeout-int"),
    pytest.param(dict(timeout_s=MAX_TIMEOUT_S), id="timeout-longest"),
    pytest.param(dict(timeout_s=10**9), id="timeout-longest-int"),
    pytest.param(dict(swiglu_limit=MAX_SWIGLU_LIMIT), id="swiglu-fp32-max"),
    pytest.param(dict(swiglu_limit=5e-324), id="swiglu-tiniest"),
    pytest.param(dict(swiglu_limit=7), id="swiglu-int"),
    pytest.param(dict(expert_alignment=ALIGN, minibatch_size=LARGEST_BATCH), id="minibatch-largest"),
    pytest.param(
        dict(expert_alignment=ALIGN, minibatch_size=LARGEST_BATCH, macrobatch_size=LARGEST_BATCH),
        id="macrobatch-largest",
    ),
    pytest.param(dict(expert_alignment=1, minibatch_size=MAX_TABLE_ROWS), id="minibatch-2**31-1"),
    pytest.param(dict(expert_alignment=1024), id="align-1024"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD_CONFIGS)
def test_config_rejects(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        mok.MoKConfig(**kw)


@pytest.mark.parametrize("kw,exc,msg", BAD_CONFIGS)
def test_config_replace_rejects(kw, exc, msg):
    cfg = mok.MoKConfig()
    with pytest.raises(exc, match=msg):
        cfg.replace(**kw)
    with pytest.raises(exc, match=msg):
        dataclasses.replace(cfg, **kw)


@pytest.mark.parametrize("kw", BOUNDARY_CONFIGS)
def test_config_accepts_boundaries(kw):
    cfg = mok.MoKConfig(**kw)
    assert all(getattr(cfg, k) == v for k, v in kw.items())
    assert mok.MoKConfig.from_key(cfg.key) == cfg
    assert mok.MoKConfig().replace(**kw) == cfg
    assert 1 <= cfg.timeout_ns <= 10**18


def test_config_timeout_ns():
    """The nanoseconds the native barriers wait: int(timeout_s * 1e9), as they always were."""
    assert mok.MoKConfig().timeout_ns == 300 * 10**9
    assert mok.MoKConfig(timeout_s=1e-9).timeout_ns == 1
    assert mok.MoKConfig(timeout_s=1.5e-9).timeout_ns == 1
    assert mok.MoKConfig(timeout_s=MAX_TIMEOUT_S).timeout_ns == 10**18


# ---------------------------------------------------------------------------------------------
# The limits against mok-core's own argument checks.


def test_config_comm_sms_limit_is_mok_cores():
    core = pytest.importorskip("mok_core")._C
    # An empty table: only the argument checks run.
    core.zero_rows("cpu", 0, 0, 0, 0, 0, MAX_COMM_SMS, 0)
    with pytest.raises(ValueError, match=r"num_workers must be in \[1, 1024\]"):
        core.zero_rows("cpu", 0, 0, 0, 0, 0, MAX_COMM_SMS + 1, 0)


def test_config_timeout_limit_is_mok_cores():
    core = pytest.importorskip("mok_core")._C
    epoch = torch.zeros(1, dtype=torch.int64)
    pad = torch.zeros(1, dtype=torch.int64)
    pad_ptrs = torch.tensor([pad.data_ptr()], dtype=torch.int64)
    error = torch.zeros(4, dtype=torch.int32)

    def barrier(timeout_ns: int) -> bool:
        # One rank: the barrier arrives and never waits, whatever the timeout.
        return core.barrier("cpu", epoch.data_ptr(), pad_ptrs.data_ptr(), 0, 1, error.data_ptr(), 0, timeout_ns, 0)

    for seconds in (1e-9, 300.0, MAX_TIMEOUT_S):
        assert barrier(mok.MoKConfig(timeout_s=seconds).timeout_ns) is True
    # What the config refuses, mok-core would have refused later, without naming timeout_s.
    with pytest.raises(ValueError, match="timeout_ns must be > 0"):
        barrier(int(1e-12 * 1e9))
    with pytest.raises(TypeError):
        barrier(int(1e20 * 1e9))  # past int64: pybind11 finds no overload
    assert error.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("world,topk,num_local_experts,align", [(1, 2, 4, 128), (3, 4, 5, 16), (8, 1, 1, 1)])
def test_workspace_table_limit_is_mok_cores(world, topk, num_local_experts, align):
    mok_core = pytest.importorskip("mok_core")
    fits = _largest_max_tokens(world, topk, num_local_experts, align)
    assert mok_core.schedule_capacity(world, fits, topk, num_local_experts, align) <= MAX_TABLE_ROWS
    with pytest.raises(ValueError, match=r"more than 2\^31 - 1 rows"):
        mok_core.schedule_capacity(world, fits + 1, topk, num_local_experts, align)
    if world == 1:
        cfg = mok.MoKConfig(expert_alignment=align)
        args = dict(device="cpu", hidden_size=H, topk=topk, num_experts=num_local_experts)
        ws = mok.create_workspace(cfg, None, max_tokens=fits, **args)
        assert ws.capacity == mok_core.schedule_capacity(1, fits, topk, num_local_experts, align)
        with pytest.raises(ValueError, match="max_tokens"):
            mok.create_workspace(cfg, None, max_tokens=fits + 1, **args)


# ---------------------------------------------------------------------------------------------
# The workspace: sizes whose schedule table its int32 rows cannot hold.


def _largest_max_tokens(R: int, K_: int, El: int, A: int) -> int:
    """The largest max_tokens whose table align_up(R*T*K + El*(A-1), A) fits 2^31 - 1 rows."""
    return (MAX_TABLE_ROWS // A * A - El * (A - 1)) // (R * K_)


@pytest.mark.parametrize(
    "kw,msg",
    [
        pytest.param(dict(max_tokens=2**40), r"max_tokens \(1099511627776\) is too large", id="max_tokens-2**40"),
        pytest.param(
            dict(max_tokens=_largest_max_tokens(1, K, E, 128) + 1),
            r"max_tokens \(\d+\) is too large.*max_tokens must be <= " + str(_largest_max_tokens(1, K, E, 128)),
            id="max_tokens-one-past",
        ),
        pytest.param(dict(max_tokens=2**31, topk=1), r"max_tokens \(2147483648\) is too large", id="max_tokens-2**31"),
        pytest.param(
            dict(max_tokens=1, topk=1, num_experts=2**25),
            r"schedule table needs \d+ rows.*no max_tokens fits: lower num_experts or expert_alignment",
            id="padding-alone-too-large",
        ),
        pytest.param(
            dict(max_tokens=1, topk=1, num_experts=MAX_EXPERTS + 1),
            r"num_experts must be <= 2147483645 \(expert ids are int32",
            id="num_experts-past-int32",
        ),
    ],
)
def test_workspace_rejects_oversized_table(kw, msg):
    args = dict(device="cpu", max_tokens=16, hidden_size=H, topk=K, num_experts=E)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        mok.create_workspace(mok.MoKConfig(), None, **args)
    with pytest.raises(ValueError, match=msg):
        mok.get_workspace(mok.MoKConfig(), None, **args)


@pytest.mark.parametrize(
    "align,topk,num_experts",
    [
        pytest.param(128, K, E, id="default-alignment"),
        pytest.param(1, 1, 1, id="no-padding"),
        pytest.param(1024, 8, 64, id="widest-alignment"),
    ],
)
def test_workspace_accepts_largest_table(align, topk, num_experts):
    fits = _largest_max_tokens(1, topk, num_experts, align)
    cfg = mok.MoKConfig(expert_alignment=align)
    ws = mok.get_workspace(cfg, None, device="cpu", max_tokens=fits, hidden_size=H, topk=topk, num_experts=num_experts)
    assert ws.max_tokens == fits and ws.capacity <= MAX_TABLE_ROWS
    with pytest.raises(ValueError, match="max_tokens"):
        mok.get_workspace(
            cfg, None, device="cpu", max_tokens=fits + 1, hidden_size=H, topk=topk, num_experts=num_experts
        )


def test_workspace_accepts_most_experts():
    cfg = mok.MoKConfig(expert_alignment=1)
    ws = mok.create_workspace(cfg, None, device="cpu", max_tokens=1, hidden_size=H, topk=1, num_experts=MAX_EXPERTS)
    assert ws.capacity == 1 and ws.num_local_experts == MAX_EXPERTS


# ---------------------------------------------------------------------------------------------
# The boundary configs run, with the default config's bits.

RUN_BOUNDARIES = {
    "sms-1024": dict(fwd_num_comm_sms=MAX_COMM_SMS, bwd_num_comm_sms=MAX_COMM_SMS),
    "sms-2": dict(fwd_num_comm_sms=2, bwd_num_comm_sms=2),
    "timeout-longest": dict(timeout_s=MAX_TIMEOUT_S),
    # An fp32 clamp at FLT_MAX leaves every finite value as it is: the bits of no clamp.
    "swiglu-fp32-max": dict(swiglu_limit=MAX_SWIGLU_LIMIT),
    "batches-largest": dict(minibatch_size=LARGEST_BATCH, macrobatch_size=LARGEST_BATCH),
}


def _inputs():
    return make_inputs(T, H, I, E, K, Is, seed=3)


@pytest.mark.parametrize("name", list(RUN_BOUNDARIES))
def test_config_boundaries_run(name):
    inp = _inputs()
    want = run_functional(inp, config(expert_alignment=ALIGN))
    got = run_functional(inp, config(expert_alignment=ALIGN, **RUN_BOUNDARIES[name]))
    assert_bitwise(got, want, what=f"{name}: ")


SPLIT = [5, 7]  # tokens of ranks 0 and 1


def boundary_ranks(rank: int, world: int, group, device: str) -> dict:
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    # torch's own wait takes the longest timeout (near 2^63 ns it would time out at once).
    mine = torch.tensor([rank], device=dev)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group, async_op=True).wait(timeout=timedelta(seconds=MAX_TIMEOUT_S))
    assert [g.item() for g in gathered] == list(range(world))
    start = sum(SPLIT[:rank])
    kw = dict(fwd_num_comm_sms=MAX_COMM_SMS, bwd_num_comm_sms=MAX_COMM_SMS, timeout_s=MAX_TIMEOUT_S)
    return run_functional(
        _inputs(),
        config(expert_alignment=ALIGN, **kw),
        group=group,
        rank=rank,
        world=world,
        tokens=slice(start, start + SPLIT[rank]),
        max_tokens=max(SPLIT),
        device=dev,
    )


@pytest.mark.multiprocess
def test_config_boundaries_run_across_ranks():
    """The longest timeout and the most comm SMs through a real barrier and row moves (EP 2)."""
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"EP 2 on cuda needs 2 GPUs, found {torch.cuda.device_count()}")
    results = run_ranks(2, "test_config_limits.boundary_ranks", DEVICE, device=DEVICE)
    want = run_functional(_inputs(), config(expert_alignment=ALIGN))
    token_keys = ("y", "dx", "d_router_weights")
    got = {k: torch.cat([r[k] for r in results]) for k in token_keys}
    got.update({k: torch.cat([r[k] for r in results]) for k in ("dWg", "dWu", "dWd")})
    assert_bitwise(got, want, what=f"{BACKEND} EP 2: ")
