"""mok-core's transport (docs/core-runtime.md, "Transport"): row pull/push, the epoch barrier and
POSIX shared memory, on the CPU and on CUDA.

- Single process: pull/push compared byte for byte with a plain-torch reference; several tensors
  stand for the ranks. Bad arguments raise ValueError naming the argument.
- Several processes on the CPU (2 and 3 ranks, gloo to exchange segment names): the real protocol
  over POSIX shared memory, including a rank that never arrives at a barrier.
- CUDA (skipped, with the reason, without a GPU or a CUDA build of mok_core): the same moves on
  device tensors of one GPU, the barrier and its timeout on one GPU, and the whole protocol across
  two GPUs through torch.distributed._symmetric_memory (MOK_TEST_DEVICE=cuda machines).

Shape letters: docs/design.md §1, and B row bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks

import mok_core
from mok_core import _C as core

ROW_BYTES = [2, 4, 6, 16, 1000, 14336]
TOKENS_R = [5, 0, 7]  # one rank brings no token at all
K = 3
SENTINEL = 0xAB  # bytes a move must not touch
ERROR_TIMEOUT = 1
ERROR_OUT_OF_STEP = 2  # a peer at another barrier (kErrorOutOfStep)
TAG_BITS = 24  # a pad slot holds epoch << TAG_BITS | the barrier's tag (transport.h)


# ---------------------------------------------------------------------------------------------
# The reference: the contract's two loops in plain torch, on flat uint8 buffers.


def reference_pull(srcs_R, row_src_rank_C, row_route_C, route_divisor, row_bytes, src_stride, dst_stride, dst):
    """dst with table row i <- srcs_R[s][(route // route_divisor) * src_stride :][:row_bytes] (zeros if s < 0)."""
    out = dst.clone()
    for i, (s, route) in enumerate(zip(row_src_rank_C.tolist(), row_route_C.tolist(), strict=True)):
        row = slice(i * dst_stride, i * dst_stride + row_bytes)
        if s < 0:
            out[row] = 0
        else:
            start = route // route_divisor * src_stride
            out[row] = srcs_R[s][start : start + row_bytes]
    return out


def reference_push(src, row_src_rank_C, row_route_C, row_bytes, src_stride, dst_stride, dsts_R, src_divisor=1):
    """dsts_R with dsts_R[s][route * dst_stride :][:row_bytes] <- src row i // src_divisor, for each real row."""
    outs = [d.clone() for d in dsts_R]
    for i, (s, route) in enumerate(zip(row_src_rank_C.tolist(), row_route_C.tolist(), strict=True)):
        if s >= 0:
            j = i // src_divisor
            outs[s][route * dst_stride : route * dst_stride + row_bytes] = src[
                j * src_stride : j * src_stride + row_bytes
            ]
    return outs


def reference_zero(dst, row_src_rank_C, row_bytes, dst_stride):
    """dst with the first row_bytes of every padding row's stride zeroed."""
    out = dst.clone()
    for i, s in enumerate(row_src_rank_C.tolist()):
        if s < 0:
            out[i * dst_stride : i * dst_stride + row_bytes] = 0
    return out


def make_table(tokens_R, topk, num_padding, seed, num_dropped=0):
    """A table of unique routes (s, t*K + k) in random order with padding rows (-1) among them.

    Unique routes make it valid for push (one destination row per route); a real schedule groups
    routes by expert, which is one of the orders this covers."""
    g = torch.Generator().manual_seed(seed)
    routes = [(s, j) for s, t in enumerate(tokens_R) for j in range(t * topk)]
    keep = torch.randperm(len(routes), generator=g)[: len(routes) - num_dropped].tolist()
    rows = [routes[i] for i in keep] + [(-1, -1)] * num_padding
    order = torch.randperm(len(rows), generator=g).tolist()
    row_src_rank_C = torch.tensor([rows[i][0] for i in order], dtype=torch.int32)
    row_route_C = torch.tensor([rows[i][1] for i in order], dtype=torch.int32)
    return row_src_rank_C, row_route_C


def random_bytes(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def pointer_array(tensors, device="cpu"):
    """The int64 array of per-rank addresses the contract takes."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def offset_buffer(nbytes, offset, device, fill=None, seed=None):
    """A uint8 buffer of nbytes starting `offset` bytes past an aligned allocation."""
    base = torch.empty(nbytes + offset, dtype=torch.uint8, device=device)
    buf = base[offset:]
    if seed is not None:
        buf.copy_(random_bytes(nbytes, seed))
    elif fill is not None:
        buf.fill_(fill)
    return buf


def stream_of(device):
    return torch.cuda.current_stream().cuda_stream if device == "cuda" else 0


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Single process: pull and push against the reference.


@dataclass(frozen=True)
class Move:
    row_bytes: int
    src_stride: int
    dst_stride: int


def move_of(row_bytes, strides):
    # "padded": strides larger than the row and odd, so consecutive rows change alignment
    return (
        Move(row_bytes, row_bytes + 5, row_bytes + 16) if strides == "padded" else Move(row_bytes, row_bytes, row_bytes)
    )


def check_pull(device, move, route_divisor, num_workers, dst_offset=0, src_offset=0, seed=0):
    row_src_rank_C, row_route_C = make_table(TOKENS_R, K, num_padding=9, seed=seed)
    capacity = row_src_rank_C.numel()
    srcs_R = [
        offset_buffer(t * K * move.src_stride, src_offset, device, seed=seed * 10 + r) for r, t in enumerate(TOKENS_R)
    ]
    dst = offset_buffer(capacity * move.dst_stride, dst_offset, device, fill=SENTINEL)
    src_ptrs = pointer_array(srcs_R, device)
    table = (row_src_rank_C.to(device), row_route_C.to(device))
    want = reference_pull(
        [s.cpu() for s in srcs_R],
        row_src_rank_C,
        row_route_C,
        route_divisor,
        move.row_bytes,
        move.src_stride,
        move.dst_stride,
        dst.cpu(),
    )
    core.pull_rows(
        device,
        dst.data_ptr(),
        src_ptrs.data_ptr(),
        table[0].data_ptr(),
        table[1].data_ptr(),
        capacity,
        route_divisor,
        move.row_bytes,
        move.src_stride,
        move.dst_stride,
        num_workers,
        stream_of(device),
    )
    synchronize(device)
    assert torch.equal(dst.cpu(), want)


def check_zero(device, move, num_workers, seed=0):
    row_src_rank_C, _ = make_table(TOKENS_R, K, num_padding=9, seed=seed)
    capacity = row_src_rank_C.numel()
    dst = offset_buffer(capacity * move.dst_stride, 0, device, seed=seed + 7)
    want = reference_zero(dst.cpu(), row_src_rank_C, move.row_bytes, move.dst_stride)
    table = row_src_rank_C.to(device)
    core.zero_rows(
        device, dst.data_ptr(), table.data_ptr(), capacity, move.row_bytes, move.dst_stride, num_workers,
        stream_of(device),
    )  # fmt: skip
    synchronize(device)
    assert torch.equal(dst.cpu(), want)


def check_push(device, move, num_workers, dst_offset=0, src_offset=0, seed=0, src_divisor=1, local=False):
    """push_rows against reference_push; `local`: to rank 0's buffer given as dst_local (no
    pointer array), the rows of the other ranks skipped (their buffers must stay untouched)."""
    row_src_rank_C, row_route_C = make_table(TOKENS_R, K, num_padding=7, seed=seed, num_dropped=4)
    capacity = row_src_rank_C.numel()
    src = offset_buffer(capacity * move.src_stride, src_offset, device, seed=seed + 99)
    dsts_R = [offset_buffer(t * K * move.dst_stride, dst_offset, device, fill=SENTINEL) for t in TOKENS_R]
    dst_ptrs = pointer_array(dsts_R, device)
    table = (row_src_rank_C.to(device), row_route_C.to(device))
    want = reference_push(
        src.cpu(),
        row_src_rank_C,
        row_route_C,
        move.row_bytes,
        move.src_stride,
        move.dst_stride,
        [d.cpu() for d in dsts_R],
        src_divisor,
    )
    if local:  # only rank 0's rows move; the other buffers keep their sentinel bytes
        want = [want[0], *(d.cpu() for d in dsts_R[1:])]
    core.push_rows(
        device,
        src.data_ptr(),
        0 if local else dst_ptrs.data_ptr(),
        table[0].data_ptr(),
        table[1].data_ptr(),
        capacity,
        move.row_bytes,
        move.src_stride,
        move.dst_stride,
        num_workers,
        stream_of(device),
        src_divisor,
        dst_local=dsts_R[0].data_ptr() if local else 0,
    )
    synchronize(device)
    for r, (got, exp) in enumerate(zip(dsts_R, want, strict=True)):
        assert torch.equal(got.cpu(), exp), f"rank {r}'s buffer"
    if local:
        assert bool((want[0] != SENTINEL).any()), "the table moves no row of rank 0: the case tests nothing"


@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("route_divisor", [K, 1])
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_cpu_pull_matches_reference(num_workers, row_bytes, route_divisor, strides):
    check_pull("cpu", move_of(row_bytes, strides), route_divisor, num_workers, seed=row_bytes + num_workers)


@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_cpu_push_matches_reference(num_workers, row_bytes, strides):
    check_push("cpu", move_of(row_bytes, strides), num_workers, seed=row_bytes + num_workers)


@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("row_bytes", [4, 6, 14336])
@pytest.mark.parametrize("num_workers", [1, 3])
def test_cpu_push_of_token_rows_to_every_route(num_workers, row_bytes, strides):
    """src_divisor = K: route i takes token row i // K (the push dispatch)."""
    check_push("cpu", move_of(row_bytes, strides), num_workers, seed=row_bytes, src_divisor=K)


@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("row_bytes", [4, 6, 14336])
@pytest.mark.parametrize("src_divisor", [K, 1])
@pytest.mark.parametrize("num_workers", [1, 3])
def test_cpu_push_to_a_local_destination(num_workers, src_divisor, row_bytes, strides):
    """dst_local: rank 0's rows into this process's buffer (one rank's scatter of its token rows
    into table order), the other ranks' rows skipped."""
    check_push("cpu", move_of(row_bytes, strides), num_workers, seed=row_bytes + 3, src_divisor=src_divisor, local=True)


def test_push_takes_one_destination(valid_move):
    kwargs, keep = valid_move
    push = {k: v for k, v in kwargs.items() if k not in ("dst", "src_ptrs", "route_divisor")}
    push.update(src=kwargs["dst"], dst_ptrs=kwargs["src_ptrs"], capacity=8)
    with pytest.raises(ValueError, match=r"dst_ptrs .* or dst_local .*, not both"):
        core.push_rows(**push, dst_local=keep[2].data_ptr())
    local = {**push, "dst_ptrs": 0, "dst_local": keep[2].data_ptr()}
    core.push_rows(**local)  # valid
    with pytest.raises(ValueError, match="dst_local must be an address"):
        core.push_rows(**{**local, "dst_local": -8})
    with pytest.raises(ValueError, match="dst_ptrs must not be 0"):
        core.push_rows(**{**push, "dst_ptrs": 0})


@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_cpu_zero_rows_touches_only_padding(num_workers, row_bytes, strides):
    check_zero("cpu", move_of(row_bytes, strides), num_workers, seed=row_bytes + num_workers)


def test_zero_rows_rejects_bad_arguments():
    src_rank = torch.tensor([-1, 0], dtype=torch.int32)
    dst = torch.zeros(64, dtype=torch.uint8)
    ok = dict(device="cpu", dst=dst.data_ptr(), row_src_rank=src_rank.data_ptr(), capacity=2, row_bytes=16,
              dst_stride=32, num_workers=1)  # fmt: skip
    core.zero_rows(**ok)
    for override, name in ((dict(capacity=-1), "capacity"), (dict(row_bytes=-1), "row_bytes"),
                           (dict(dst_stride=8), "dst_stride"), (dict(num_workers=0), "num_workers"),
                           (dict(dst=0), "dst must not be 0"), (dict(row_src_rank=2), "row_src_rank"),
                           (dict(device="tpu"), "device")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            core.zero_rows(**{**ok, **override})


def test_push_rejects_a_bad_src_divisor(valid_move):
    kwargs, _ = valid_move
    push = {k: v for k, v in kwargs.items() if k not in ("dst", "src_ptrs", "route_divisor")}
    push.update(src=kwargs["dst"], dst_ptrs=kwargs["src_ptrs"], capacity=8)
    with pytest.raises(ValueError, match="src_divisor"):
        core.push_rows(**push, src_divisor=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_route_without_a_row_moves_nothing(device):
    """A route whose row is -1 (at one rank the table gives a bad id's route no row) is skipped by
    a push and reads as a padding row in a pull: no byte before or past the buffers is touched."""
    if device == "cuda":
        require_cuda()
    rows, row_bytes = 4, 16
    src = torch.arange(rows * row_bytes, dtype=torch.int32).to(torch.uint8).to(device)
    guard = torch.full((3 * rows * row_bytes,), SENTINEL, dtype=torch.uint8, device=device)
    dst = guard[rows * row_bytes : 2 * rows * row_bytes]  # the rows before and after it: guards
    rank = torch.zeros(rows, dtype=torch.int32, device=device)
    route_row = torch.tensor([2, -1, 0, -1], dtype=torch.int32, device=device)
    core.push_rows(device, src.data_ptr(), 0, rank.data_ptr(), route_row.data_ptr(), rows, row_bytes, row_bytes,
                   row_bytes, 2, stream_of(device), 1, dst_local=dst.data_ptr())  # fmt: skip
    synchronize(device)
    want = torch.full((rows, row_bytes), SENTINEL, dtype=torch.uint8)
    want[2], want[0] = src.cpu().view(rows, row_bytes)[0], src.cpu().view(rows, row_bytes)[2]
    assert torch.equal(dst.cpu().view(rows, row_bytes), want)
    outside = torch.cat([guard[: rows * row_bytes], guard[2 * rows * row_bytes :]])
    assert bool((outside == SENTINEL).all()), "no byte before or past dst"
    pulled = torch.full((rows * row_bytes,), SENTINEL, dtype=torch.uint8, device=device)
    srcs = pointer_array([dst], device)
    core.pull_rows(device, pulled.data_ptr(), srcs.data_ptr(), rank.data_ptr(), route_row.data_ptr(), rows, 1,
                   row_bytes, row_bytes, row_bytes, 2, stream_of(device))  # fmt: skip
    synchronize(device)
    got = pulled.cpu().view(rows, row_bytes)
    assert torch.equal(got[0], want[2]) and torch.equal(got[2], want[0])
    assert not bool(got[1].any()) and not bool(got[3].any()), "a route without a row reads zeros"


def test_cpu_more_workers_than_rows():
    check_pull("cpu", Move(16, 16, 16), K, num_workers=64)
    check_push("cpu", Move(16, 16, 16), num_workers=64)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_capacity_zero_touches_nothing(device):
    """An empty table is a no-op, even with null pointers (an empty tensor's data_ptr() is 0),
    and launches nothing (no GPU needed); a build without CUDA still refuses device='cuda'."""
    if device == "cuda" and not mok_core.build_info()["cuda"]:
        with pytest.raises(RuntimeError, match="without CUDA"):
            core.pull_rows(device, 0, 0, 0, 0, 0, K, 64, 64, 64, 4)
        with pytest.raises(RuntimeError, match="without CUDA"):
            core.push_rows(device, 0, 0, 0, 0, 0, 64, 64, 64, 4)
        return
    core.pull_rows(device, 0, 0, 0, 0, 0, K, 64, 64, 64, 4)
    core.push_rows(device, 0, 0, 0, 0, 0, 64, 64, 64, 4)


def test_zero_row_bytes_touches_nothing():
    row_src_rank_C, row_route_C = make_table([2], 1, num_padding=1, seed=0)
    dst = torch.full((16,), SENTINEL, dtype=torch.uint8)
    srcs = pointer_array([torch.zeros(16, dtype=torch.uint8)])
    core.pull_rows(
        "cpu", dst.data_ptr(), srcs.data_ptr(), row_src_rank_C.data_ptr(), row_route_C.data_ptr(), 3, 1, 0, 0, 0, 2
    )
    assert (dst == SENTINEL).all()


# ---------------------------------------------------------------------------------------------
# Bad arguments: ValueError naming the argument, never a crash.


@pytest.fixture
def valid_move():
    """Keyword arguments of a valid pull_rows call over small CPU tensors (kept alive here)."""
    row_src_rank_C, row_route_C = make_table([4], 2, num_padding=2, seed=1)
    src = torch.zeros(8 * 16, dtype=torch.uint8)
    dst = torch.zeros(10 * 16, dtype=torch.uint8)
    ptrs = pointer_array([src])
    keep = (row_src_rank_C, row_route_C, src, dst, ptrs)
    kwargs = dict(
        device="cpu",
        dst=dst.data_ptr(),
        src_ptrs=ptrs.data_ptr(),
        row_src_rank=row_src_rank_C.data_ptr(),
        row_route=row_route_C.data_ptr(),
        capacity=10,
        route_divisor=2,
        row_bytes=16,
        src_stride=16,
        dst_stride=16,
        num_workers=2,
    )
    core.pull_rows(**kwargs)  # the baseline is valid
    return kwargs, keep


ROW_MOVE_ERRORS = [
    (dict(device="tpu"), "device"),
    (dict(device="CUDA"), "device"),
    (dict(capacity=-1), "capacity"),
    (dict(row_bytes=-1), "row_bytes"),
    (dict(src_stride=15), "src_stride"),
    (dict(dst_stride=8), "dst_stride"),
    (dict(num_workers=0), "num_workers"),
    (dict(num_workers=-3), "num_workers"),
    (dict(num_workers=10**6), "num_workers"),
    (dict(num_workers=2**40), "num_workers"),
    (dict(capacity=2**62, dst_stride=2**10, src_stride=2**10), "overflows"),
    (dict(stream=-1), "stream"),
]


@pytest.mark.parametrize(("override", "name"), [*ROW_MOVE_ERRORS, (dict(route_divisor=0), "route_divisor")])
def test_pull_rejects_bad_arguments(valid_move, override, name):
    kwargs, _ = valid_move
    with pytest.raises(ValueError, match=name):
        core.pull_rows(**{**kwargs, **override})


def test_pull_rejects_bad_pointers(valid_move):
    kwargs, _ = valid_move
    for key in ("dst", "src_ptrs", "row_src_rank", "row_route"):
        with pytest.raises(ValueError, match=f"{key} must not be 0"):
            core.pull_rows(**{**kwargs, key: 0})
        with pytest.raises(ValueError, match=f"{key} must be an address"):
            core.pull_rows(**{**kwargs, key: -8})
    for key, align in (("src_ptrs", 8), ("row_src_rank", 4), ("row_route", 4)):
        with pytest.raises(ValueError, match=f"{key} must be {align}-byte aligned"):
            core.pull_rows(**{**kwargs, key: kwargs[key] + 2})


def test_push_rejects_bad_arguments(valid_move):
    kwargs, _ = valid_move
    push = {k: v for k, v in kwargs.items() if k not in ("dst", "src_ptrs", "route_divisor")}
    push.update(src=kwargs["dst"], dst_ptrs=kwargs["src_ptrs"], capacity=8)
    core.push_rows(**push)  # valid
    for override, name in ROW_MOVE_ERRORS:
        with pytest.raises(ValueError, match=name):
            core.push_rows(**{**push, **override})
    for key in ("src", "dst_ptrs", "row_src_rank", "row_route"):
        with pytest.raises(ValueError, match=f"{key} must not be 0"):
            core.push_rows(**{**push, key: 0})


def test_cuda_without_cuda_raises_runtime_error(valid_move):
    """device='cuda' with work to do: RuntimeError on a build without CUDA or a machine without a
    GPU (only run where no GPU is visible: the pointers here are host memory)."""
    if mok_core.cuda_device_count() > 0:
        pytest.skip("a GPU is visible; the CUDA paths are tested below")
    kwargs, _ = valid_move
    match = "without CUDA" if not mok_core.build_info()["cuda"] else "CUDA"
    with pytest.raises(RuntimeError, match=match):
        core.pull_rows(**{**kwargs, "device": "cuda"})
    push = {k: v for k, v in kwargs.items() if k not in ("dst", "src_ptrs", "route_divisor")}
    with pytest.raises(RuntimeError, match=match):
        core.push_rows(**{**push, "device": "cuda", "src": kwargs["dst"], "dst_ptrs": kwargs["src_ptrs"]})
    pads = LocalPads(1)
    with pytest.raises(RuntimeError, match=match):
        core.barrier("cuda", pads.epoch.data_ptr(), pads.ptrs.data_ptr(), 0, 1, pads.error.data_ptr(), 0, 10**6)


# ---------------------------------------------------------------------------------------------
# The barrier in one process: pads in local memory, ranks as threads.


class LocalPads:
    """world pads (world uint64 slots each) in this process, with one epoch and error per rank."""

    def __init__(self, world, device="cpu"):
        self.pads = [torch.zeros(world, dtype=torch.int64, device=device) for _ in range(world)]
        self.ptrs = pointer_array(self.pads, device)
        self.epochs = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        self.errors = [torch.zeros(4, dtype=torch.int32, device=device) for _ in range(world)]
        self.epoch, self.error = self.epochs[0], self.errors[0]

    def barrier(self, rank, stage=0, timeout_s=5.0, device="cpu"):
        return core.barrier(
            device,
            self.epochs[rank].data_ptr(),
            self.ptrs.data_ptr(),
            rank,
            len(self.pads),
            self.errors[rank].data_ptr(),
            stage,
            int(timeout_s * 1e9),
            stream_of(device),
        )


def test_barrier_alone_counts_epochs():
    pads = LocalPads(1)
    for e in range(1, 6):
        assert pads.barrier(0) is True
        assert pads.epoch.item() == e and pads.pads[0][0].item() == e << TAG_BITS  # (epoch, tag 0)
    assert pads.error.tolist() == [0, 0, 0, 0]


def test_barrier_finds_a_peer_at_another_barrier():
    """A peer at the same epoch with another tag (another stage or call), or two epochs ahead (a
    call this rank did not make), is out of step: an error naming it, not a barrier passed."""
    pads = LocalPads(2)
    threads = [threading.Thread(target=pads.barrier, args=(1,), kwargs=dict(stage=5, timeout_s=5))]
    threads[0].start()
    assert pads.barrier(0, stage=3, timeout_s=5) is False  # rank 1 is at stage 5 of epoch 1
    threads[0].join(timeout=10)
    assert pads.error.tolist() == [ERROR_OUT_OF_STEP, 1, 3, 0]
    assert pads.errors[1].tolist()[:2] == [ERROR_OUT_OF_STEP, 0]  # rank 1 saw rank 0's tag too
    ahead = LocalPads(2)
    ahead.pads[0][1] = 3 << TAG_BITS  # rank 1 announced epoch 3 while rank 0 is at its first
    assert ahead.barrier(0, timeout_s=5) is False
    assert ahead.error.tolist() == [ERROR_OUT_OF_STEP, 1, 0, 0]
    in_step = LocalPads(2)
    in_step.pads[0][1] = 2 << TAG_BITS | 9  # one epoch ahead, whatever its tag: it passed epoch 1
    assert in_step.barrier(0, stage=4, timeout_s=5) is True


def test_barrier_releases_the_gil():
    """Two ranks as two Python threads: the second can only arrive if the first, spinning in
    C++, let go of the GIL."""
    world = 2
    pads = LocalPads(world)
    results = [None] * world

    def run(rank):
        results[rank] = [pads.barrier(rank, timeout_s=20) for _ in range(20)]

    thread = threading.Thread(target=run, args=(1,))
    thread.start()
    run(0)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results == [[True] * 20] * world
    assert [e.item() for e in pads.epochs] == [20, 20]
    assert all(p.tolist() == [20 << TAG_BITS] * 2 for p in pads.pads)


def test_barrier_timeout_sets_a_sticky_error():
    world, stage = 3, 7
    pads = LocalPads(world)
    # rank 2 arrives ahead (its own wait would time out: nobody else is there yet)
    assert pads.barrier(2, timeout_s=0.01) is False
    start = time.perf_counter()
    assert pads.barrier(0, stage=stage, timeout_s=0.2) is False  # rank 1 never comes
    assert 0.2 <= time.perf_counter() - start < 5
    assert pads.error.tolist() == [ERROR_TIMEOUT, 1, stage, 0]
    # sticky: the next call returns at once, keeps the first error, and still arrives
    start = time.perf_counter()
    assert pads.barrier(0, stage=8, timeout_s=10) is False
    assert time.perf_counter() - start < 1
    assert pads.error.tolist() == [ERROR_TIMEOUT, 1, stage, 0]
    assert [p[0].item() >> TAG_BITS for p in pads.pads] == [2, 2, 2]
    # a late rank finds the others one epoch ahead (they passed this barrier): no reset, no hang
    assert pads.barrier(1, timeout_s=5) is True
    assert pads.errors[1].tolist() == [0, 0, 0, 0]


BARRIER_ERRORS = [
    (dict(world_size=0), "world_size"),
    (dict(world_size=-1), "world_size"),
    (dict(rank=-1), "rank"),
    (dict(rank=2), "rank"),
    (dict(timeout_ns=0), "timeout_ns"),
    (dict(stage=2**40), "stage"),
    (dict(epoch=0), "epoch"),
    (dict(error=0), "error"),
    (dict(signal_pad_ptrs=0), "signal_pad_ptrs"),
    (dict(device="gpu"), "device"),
]


@pytest.mark.parametrize(("override", "name"), BARRIER_ERRORS)
def test_barrier_rejects_bad_arguments(override, name):
    pads = LocalPads(2)
    kwargs = dict(
        device="cpu",
        epoch=pads.epoch.data_ptr(),
        signal_pad_ptrs=pads.ptrs.data_ptr(),
        rank=0,
        world_size=2,
        error=pads.error.data_ptr(),
        stage=0,
        timeout_ns=10**6,
    )
    with pytest.raises(ValueError, match=name):
        core.barrier(**{**kwargs, **override})
    assert pads.epoch.item() == 0, "a refused call changes nothing"


def test_barrier_rejects_misaligned_words_and_null_pads():
    pads = LocalPads(2)
    call = dict(rank=0, world_size=2, stage=0, timeout_ns=10**6)
    with pytest.raises(ValueError, match="epoch must be 8-byte aligned"):
        core.barrier("cpu", pads.epoch.data_ptr() + 4, pads.ptrs.data_ptr(), error=pads.error.data_ptr(), **call)
    with pytest.raises(ValueError, match="error must be 4-byte aligned"):
        core.barrier("cpu", pads.epoch.data_ptr(), pads.ptrs.data_ptr(), error=pads.error.data_ptr() + 2, **call)
    holed = torch.tensor([pads.pads[0].data_ptr(), 0], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"signal_pad_ptrs\[1\]"):
        core.barrier("cpu", pads.epoch.data_ptr(), holed.data_ptr(), error=pads.error.data_ptr(), **call)


def test_cpu_error_mirror():
    """The four error words as the host reads them: zeros, then the words as they were at the last
    publish (a later change of the words is the next publish's), zeros again after clear(); the
    device address is the host's on the CPU; bad addresses are ValueErrors naming them."""
    mirror = mok_core.ErrorMirror("cpu")  # (the package's name: the transport's)
    assert mirror.read() == [0, 0, 0, 0]
    error = torch.tensor([ERROR_TIMEOUT, 2, 7, 1], dtype=torch.int32)
    mirror.publish(error.data_ptr())
    error[1] = 9
    assert mirror.read() == [ERROR_TIMEOUT, 2, 7, 1]
    mirror.publish(error.data_ptr())
    assert mirror.read() == [ERROR_TIMEOUT, 9, 7, 1]
    mirror.clear()
    assert mirror.read() == [0, 0, 0, 0]
    assert mirror.device_address != 0
    with pytest.raises(ValueError, match="error must be 4-byte aligned"):
        mirror.publish(error.data_ptr() + 2)
    with pytest.raises(ValueError, match="error must not be 0"):
        mirror.publish(0)
    with pytest.raises(ValueError, match="stream must be an address"):
        mirror.publish(error.data_ptr(), -1)
    with pytest.raises(ValueError, match="device"):
        core.ErrorMirror("tpu")


# ---------------------------------------------------------------------------------------------
# ShmSegment.


def shm_name(tag="t"):
    return f"/mok-test-{os.getpid()}-{tag}-{uuid.uuid4().hex[:12]}"


def shm_file(name):
    """Where Linux keeps a segment (what a leak would leave behind)."""
    return Path("/dev/shm") / name.lstrip("/")


def shm_bytes(address, offset, nbytes, dtype=torch.uint8):
    """A tensor over mapped memory (valid only while the mapping is)."""
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buf = (ctypes.c_uint8 * nbytes).from_address(address + offset)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


def test_shm_create_open_share_close_unlink():
    name = shm_name()
    owner = core.ShmSegment(name, 4096, True)
    try:
        assert owner.name == name and owner.nbytes == 4096 and owner.created and not owner.closed
        assert owner.address != 0 and owner.address % 4096 == 0
        assert shm_bytes(owner.address, 0, 4096).count_nonzero() == 0, "a new segment is zero-filled"
        peer = core.ShmSegment(name, 1024, False)  # a smaller view of the same segment
        assert not peer.created and peer.address != owner.address
        shm_bytes(owner.address, 100, 8).copy_(torch.arange(8, dtype=torch.uint8))
        assert shm_bytes(peer.address, 100, 8).tolist() == list(range(8))
        peer.close()
        peer.close()  # idempotent
        assert peer.closed and peer.address == 0
        assert "closed" in repr(peer)
    finally:
        owner.unlink()
    assert not shm_file(name).exists()
    owner.unlink()  # idempotent
    assert shm_bytes(owner.address, 100, 1).item() == 0, "the mapping outlives the name"
    owner.close()
    with pytest.raises(FileNotFoundError):
        core.ShmSegment(name, 4096, False)


def test_shm_context_manager_closes():
    name = shm_name()
    with core.ShmSegment(name, 64, True) as seg:
        seg.unlink()
        assert seg.address != 0
    assert seg.closed


def test_shm_missing_segment_raises_file_not_found():
    name = shm_name("missing")
    with pytest.raises(FileNotFoundError) as info:
        core.ShmSegment(name, 64, False)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == name and "cannot open" in str(info.value)
    assert isinstance(info.value, OSError)


def test_shm_create_twice_raises_file_exists():
    name = shm_name()
    seg = core.ShmSegment(name, 64, True)
    try:
        with pytest.raises(FileExistsError) as info:
            core.ShmSegment(name, 64, True)
        assert info.value.errno == errno.EEXIST
    finally:
        seg.unlink()
        seg.close()


def test_shm_open_larger_than_the_segment():
    name = shm_name()
    seg = core.ShmSegment(name, 64, True)
    try:
        with pytest.raises(ValueError, match="nbytes"):
            core.ShmSegment(name, 65, False)
    finally:
        seg.unlink()


@pytest.mark.parametrize("name", ["", "/", "no-slash", "/a/b", "/x" + "y" * 300, "/nul\0char"])
def test_shm_bad_name(name):
    with pytest.raises(ValueError, match="name"):
        core.ShmSegment(name, 64, True)


@pytest.mark.parametrize("nbytes", [0, -1])
def test_shm_bad_size(nbytes):
    with pytest.raises(ValueError, match="nbytes"):
        core.ShmSegment(shm_name(), nbytes, True)


# ---------------------------------------------------------------------------------------------
# Several processes on the CPU: each rank's segment holds [pad | x rows | out rows].
#
# Every rank derives the same global picture from one seed: each rank's x rows, which routes each
# rank owns (its table) and what it pushes back, so each can check its own results byte for byte.


@dataclass(frozen=True)
class World:
    """The scenario every rank derives from the seed."""

    tokens_R: tuple
    topk: int
    row_bytes: int
    stride: int
    seed: int = 5

    @property
    def world(self):
        return len(self.tokens_R)

    def pad_bytes(self):
        return 64 * ((8 * self.world + 63) // 64)

    def x_offset(self):
        return self.pad_bytes()

    def out_offset(self, rank):
        return self.x_offset() + self.tokens_R[rank] * self.topk * self.stride

    def nbytes(self, rank):
        return max(self.out_offset(rank) + self.tokens_R[rank] * self.topk * self.stride, 64)

    def x_rows(self, rank):
        """Rank r's source rows: [T_r * K rows x stride] (per-route rows; token rows are the first T_r)."""
        return random_bytes(self.tokens_R[rank] * self.topk * self.stride, self.seed * 100 + rank)

    def tables(self):
        """Each rank's table: a random owner for each route, some routes owned by nobody."""
        g = torch.Generator().manual_seed(self.seed)
        routes = [(s, j) for s, t in enumerate(self.tokens_R) for j in range(t * self.topk)]
        owner = torch.randint(-1, self.world, (len(routes),), generator=g).tolist()
        tables = []
        for r in range(self.world):
            mine = [routes[i] for i in torch.randperm(len(routes), generator=g).tolist() if owner[i] == r]
            rows = mine + [(-1, -1)] * (r + 2)
            order = torch.randperm(len(rows), generator=g).tolist()
            tables.append(
                (
                    torch.tensor([rows[i][0] for i in order], dtype=torch.int32),
                    torch.tensor([rows[i][1] for i in order], dtype=torch.int32),
                )
            )
        return tables

    def y_rows(self, rank, capacity):
        """What rank r pushes: [capacity rows x stride]."""
        return random_bytes(capacity * self.stride, self.seed * 100 + 50 + rank)

    def expected_out(self, rank, tables):
        """Rank r's out rows after every owner pushed: pushed rows where routed, SENTINEL elsewhere."""
        out = torch.full((self.tokens_R[rank] * self.topk * self.stride,), SENTINEL, dtype=torch.uint8)
        for o, (src_rank_C, route_C) in enumerate(tables):
            mine = torch.where(src_rank_C == rank, 0, -1).to(torch.int32)  # index into [out]
            out = reference_push(
                self.y_rows(o, src_rank_C.numel()), mine, route_C, self.row_bytes, self.stride, self.stride, [out]
            )[0]
        return out


def open_segments(rank, world, group, nbytes_R):
    """Creates this rank's segment, maps every peer's and unlinks its own once all have mapped it
    (the mappings stay; nothing is left behind even if a rank dies later). Returns (segments, names)."""
    own = core.ShmSegment(f"/mok-test-{os.getpid()}-{uuid.uuid4().hex[:12]}", nbytes_R[rank], True)
    names = [None] * world
    dist.all_gather_object(names, own.name, group=group)
    segments = [own if r == rank else core.ShmSegment(names[r], nbytes_R[r], False) for r in range(world)]
    dist.barrier(group=group)
    own.unlink()
    return segments, names


def cpu_world_scenario(rank, world, group, tokens_R, row_bytes_list):
    """Pull/push over shared memory for each row size, 50 barriers in a row, then the last rank
    skips a barrier. Returns what the parent checks."""
    out = {"names": None, "moves": {}}
    scenarios = [World(tuple(tokens_R), K, rb, rb + 8) for rb in row_bytes_list]
    nbytes_R = [max(s.nbytes(r) for s in scenarios) for r in range(world)]
    segments, out["names"] = open_segments(rank, world, group, nbytes_R)
    addresses = [s.address for s in segments]
    pad_ptrs = torch.tensor(addresses, dtype=torch.int64)  # the pads sit at offset 0
    epoch = torch.zeros(1, dtype=torch.int64)
    error = torch.zeros(4, dtype=torch.int32)

    def barrier(stage, timeout_s=30.0):
        return core.barrier(
            "cpu", epoch.data_ptr(), pad_ptrs.data_ptr(), rank, world, error.data_ptr(), stage, int(timeout_s * 1e9)
        )

    for w in scenarios:
        tables = w.tables()
        src_rank_C, route_C = tables[rank]
        capacity = src_rank_C.numel()
        # inputs in place: our x rows, and the out rows the owners will push into
        x = w.x_rows(rank)
        shm_bytes(addresses[rank], w.x_offset(), x.numel()).copy_(x)
        shm_bytes(addresses[rank], w.out_offset(rank), x.numel()).fill_(SENTINEL)
        ok_in = barrier(stage=1)
        # pull token rows (x: divisor K) and route rows (divisor 1) from every rank's segment
        src_ptrs = torch.tensor([a + w.x_offset() for a in addresses], dtype=torch.int64)
        pulled = {}
        for divisor in (w.topk, 1):
            dst = torch.full((capacity * w.stride,), SENTINEL, dtype=torch.uint8)
            core.pull_rows(
                "cpu",
                dst.data_ptr(),
                src_ptrs.data_ptr(),
                src_rank_C.data_ptr(),
                route_C.data_ptr(),
                capacity,
                divisor,
                w.row_bytes,
                w.stride,
                w.stride,
                2,
            )
            want = reference_pull(
                [w.x_rows(r) for r in range(world)],
                src_rank_C,
                route_C,
                divisor,
                w.row_bytes,
                w.stride,
                w.stride,
                torch.full_like(dst, SENTINEL),
            )
            pulled[divisor] = torch.equal(dst, want)
        # push our results into the sources' out rows, then wait for everyone's pushes
        y = w.y_rows(rank, capacity)
        dst_ptrs = torch.tensor([a + w.out_offset(r) for r, a in enumerate(addresses)], dtype=torch.int64)
        core.push_rows(
            "cpu",
            y.data_ptr(),
            dst_ptrs.data_ptr(),
            src_rank_C.data_ptr(),
            route_C.data_ptr(),
            capacity,
            w.row_bytes,
            w.stride,
            w.stride,
            3,
        )
        ok_out = barrier(stage=2)
        got = shm_bytes(addresses[rank], w.out_offset(rank), x.numel()).clone()
        out["moves"][w.row_bytes] = {
            "barriers": (ok_in, ok_out),
            "pulled": pulled,
            "pushed": torch.equal(got, w.expected_out(rank, tables)),
            "real_rows": int((src_rank_C >= 0).sum()),
        }

    # many barriers in a row: epochs grow, every slot of our pad keeps up
    out["many"] = all(barrier(stage=3) for _ in range(50))
    out["epoch"] = epoch.item()
    out["pad_after_many"] = shm_bytes(addresses[rank], 0, 8 * world, torch.int64).tolist()

    # the last rank never arrives at the next barrier: the others give up within the timeout
    absent = world - 1
    if rank != absent:
        start = time.perf_counter()
        out["timeout_ok"] = barrier(stage=9, timeout_s=0.5)
        out["timeout_elapsed"] = time.perf_counter() - start
        start = time.perf_counter()
        out["sticky_ok"] = barrier(stage=10, timeout_s=30)
        out["sticky_elapsed"] = time.perf_counter() - start
    out["error"] = error.tolist()
    dist.barrier(group=group)  # nobody touches the segments after this
    for s in segments:
        s.close()
    return out


CPU_TOKENS = {2: [6, 3], 3: [5, 0, 7]}
CPU_ROW_BYTES = [6, 1000]


def cpu_worlds_scenario(rank, world, group):
    """The scenario on ranks {0, 1} (a gloo subgroup), then on all three: one launch of processes
    serves both world sizes (spawning them is what takes the time)."""
    pair = dist.new_group([0, 1])
    results = {}
    if rank < 2:
        results[2] = cpu_world_scenario(rank, 2, pair, CPU_TOKENS[2], CPU_ROW_BYTES)
    dist.barrier(group=group)
    results[3] = cpu_world_scenario(rank, world, group, CPU_TOKENS[3], CPU_ROW_BYTES)
    return results


@pytest.fixture(scope="module")
def cpu_worlds():
    per_rank = run_ranks(3, "test_core_transport.cpu_worlds_scenario")
    return {w: [per_rank[r][w] for r in range(w)] for w in (2, 3)}


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def cpu_world(request, cpu_worlds):
    return request.param, CPU_ROW_BYTES, cpu_worlds[request.param]


@pytest.mark.multiprocess
def test_cpu_processes_pull_and_push_byte_exact(cpu_world):
    _, row_bytes_list, results = cpu_world
    for rank, res in enumerate(results):
        for rb in row_bytes_list:
            move = res["moves"][rb]
            assert move["barriers"] == (True, True), (rank, rb)
            assert move["pulled"] == {K: True, 1: True}, (rank, rb)
            assert move["pushed"], (rank, rb)
    assert sum(res["moves"][1000]["real_rows"] for res in results) > 0, "the scenario moves rows"


@pytest.mark.multiprocess
def test_cpu_processes_many_barriers(cpu_world):
    _, row_bytes_list, results = cpu_world
    epochs = 2 * len(row_bytes_list) + 50
    for res in results:
        assert res["many"] is True
        assert res["epoch"] >= epochs
        assert all(slot >> TAG_BITS >= epochs for slot in res["pad_after_many"])


@pytest.mark.multiprocess
def test_cpu_processes_absent_rank_times_out(cpu_world):
    world, _, results = cpu_world
    absent = world - 1
    for rank, res in enumerate(results):
        if rank == absent:
            assert res["error"] == [0, 0, 0, 0]
            continue
        assert res["timeout_ok"] is False
        assert 0.5 <= res["timeout_elapsed"] < 10
        assert res["error"] == [ERROR_TIMEOUT, absent, 9, rank]
        assert res["sticky_ok"] is False and res["sticky_elapsed"] < 1


@pytest.mark.multiprocess
def test_cpu_processes_leave_no_segment(cpu_world):
    _, _, results = cpu_world
    for res in results:
        for name in res["names"]:
            assert not shm_file(name).exists(), name


# ---------------------------------------------------------------------------------------------
# CUDA. Every test asks for what it needs and skips, with the reason, when it is absent.


def cuda_skip_reason(num_gpus=1):
    if not mok_core.build_info()["cuda"]:
        return "mok_core was built without CUDA (MOK_CUDA=OFF or no nvcc at build time)"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if torch.cuda.device_count() < num_gpus:
        return f"needs {num_gpus} GPUs, this machine has {torch.cuda.device_count()}"
    return None


def require_cuda(num_gpus=1):
    reason = cuda_skip_reason(num_gpus)
    if reason:
        pytest.skip(reason)


# The GPU adds rows of 33 and 2.5 vectors per lane and round (528, 40976 bytes): the predicated
# last round of the warp movers.
GPU_ROW_BYTES = [*ROW_BYTES, 528, 40976]


@pytest.mark.gpu
@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("route_divisor", [K, 1])
@pytest.mark.parametrize("row_bytes", GPU_ROW_BYTES)
@pytest.mark.parametrize("num_workers", [1, 3, 16, 132])
def test_cuda_pull_matches_reference(num_workers, row_bytes, route_divisor, strides):
    require_cuda()
    check_pull("cuda", move_of(row_bytes, strides), route_divisor, num_workers, seed=row_bytes + num_workers)


@pytest.mark.gpu
@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("row_bytes", GPU_ROW_BYTES)
@pytest.mark.parametrize("num_workers", [1, 3, 16, 132])
def test_cuda_push_matches_reference(num_workers, row_bytes, strides):
    require_cuda()
    check_push("cuda", move_of(row_bytes, strides), num_workers, seed=row_bytes + num_workers)


@pytest.mark.gpu
@pytest.mark.parametrize("strides", ["dense", "padded"])
@pytest.mark.parametrize("row_bytes", [4, 6, 528, 14336])
@pytest.mark.parametrize("num_workers", [1, 16])
def test_cuda_push_of_token_rows_and_zero_rows(num_workers, row_bytes, strides):
    require_cuda()
    move = move_of(row_bytes, strides)
    check_push("cuda", move, num_workers, seed=row_bytes, src_divisor=K)
    check_zero("cuda", move, num_workers, seed=row_bytes + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes", [6, 528, 14336])
@pytest.mark.parametrize("src_divisor", [K, 1])
@pytest.mark.parametrize("num_workers", [1, 16, 132])
def test_cuda_push_to_a_local_destination(num_workers, src_divisor, row_bytes):
    require_cuda()
    check_push("cuda", move_of(row_bytes, "padded"), num_workers, seed=row_bytes, src_divisor=src_divisor, local=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("dst_offset", "src_offset"), [(0, 0), (8, 0), (4, 4), (2, 0), (1, 0), (0, 3)])
@pytest.mark.parametrize("row_bytes", [16, 1000, 14336])
def test_cuda_every_access_width(row_bytes, dst_offset, src_offset):
    """Base addresses off by 1..8 bytes send the rows through the 8, 4, 2 and 1 byte paths."""
    require_cuda()
    move = Move(row_bytes, row_bytes, row_bytes)
    check_pull("cuda", move, K, 4, dst_offset=dst_offset, src_offset=src_offset)
    check_push("cuda", move, 4, dst_offset=dst_offset, src_offset=src_offset)


@pytest.mark.gpu
def test_cuda_error_mirror_follows_the_stream():
    """publish() queues the words' copy behind the stream's work, never waiting: the mirror shows
    the old words while a sleep runs before it, then the words a kernel wrote just before the
    publish; inside a capture the copy is recorded and lands at each replay."""
    require_cuda()
    stream = torch.cuda.Stream()
    error = torch.zeros(4, dtype=torch.int32, device="cuda")
    words = torch.tensor([ERROR_OUT_OF_STEP, 1, 3, 0], dtype=torch.int32, device="cuda")  # (its copy waits)
    mirror = core.ErrorMirror("cuda")
    handle = stream.cuda_stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s or more: the copy waits for this and the fill behind it
        error.copy_(words)
        mirror.publish(error.data_ptr(), handle)
    assert mirror.read() == [0, 0, 0, 0]  # the sleep is still running
    stream.synchronize()
    assert mirror.read() == [ERROR_OUT_OF_STEP, 1, 3, 0]
    mirror.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        error.add_(1)
        mirror.publish(error.data_ptr(), handle)
    assert mirror.read() == [0, 0, 0, 0]  # captured, not run
    graph.replay()
    stream.synchronize()
    assert mirror.read() == [ERROR_OUT_OF_STEP + 1, 2, 4, 1]
    graph.replay()
    stream.synchronize()
    assert mirror.read() == [ERROR_OUT_OF_STEP + 2, 3, 5, 2]


@pytest.mark.gpu
def test_cuda_barrier_alone_and_in_a_graph():
    """World 1: epochs count on the device; a captured graph of barrier + pull replays them."""
    require_cuda()
    pads = LocalPads(1, "cuda")
    for _ in range(10):
        assert pads.barrier(0, device="cuda") is True
    torch.cuda.synchronize()
    assert pads.epoch.item() == 10 and pads.pads[0].tolist() == [10 << TAG_BITS]
    row_src_rank_C, row_route_C = (t.cuda() for t in make_table([4], 1, num_padding=2, seed=3))
    src = random_bytes(4 * 64, 1).cuda()
    dst = torch.full((6 * 64,), SENTINEL, dtype=torch.uint8, device="cuda")
    src_ptrs = pointer_array([src], "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pads.barrier(0, device="cuda")
        core.pull_rows(
            "cuda",
            dst.data_ptr(),
            src_ptrs.data_ptr(),
            row_src_rank_C.data_ptr(),
            row_route_C.data_ptr(),
            6,
            1,
            64,
            64,
            64,
            2,
            torch.cuda.current_stream().cuda_stream,
        )
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert pads.epoch.item() == 13 and pads.error.tolist() == [0, 0, 0, 0]
    want = reference_pull(
        [src.cpu()],
        row_src_rank_C.cpu(),
        row_route_C.cpu(),
        1,
        64,
        64,
        64,
        torch.full((6 * 64,), SENTINEL, dtype=torch.uint8),
    )
    assert torch.equal(dst.cpu(), want)


@pytest.mark.gpu
def test_cuda_barrier_timeout_on_one_gpu():
    """Rank 0 of 2 waits for a rank that never comes: the kernel gives up, the error names it."""
    require_cuda()
    pads = LocalPads(2, "cuda")
    start = time.perf_counter()
    assert pads.barrier(0, stage=4, timeout_s=0.2, device="cuda") is True  # enqueued
    torch.cuda.synchronize()
    assert 0.2 <= time.perf_counter() - start < 10
    assert pads.error.tolist() == [ERROR_TIMEOUT, 1, 4, 0]
    start = time.perf_counter()
    pads.barrier(0, stage=5, timeout_s=10, device="cuda")  # sticky: no wait
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 1
    assert pads.error.tolist() == [ERROR_TIMEOUT, 1, 4, 0]
    assert pads.pads[1].tolist() == [2 << TAG_BITS | 5, 0], "rank 0 still arrived twice (epoch 2, stage 5)"
    pads.barrier(1, device="cuda")  # the late rank passes at once: epochs only grow
    torch.cuda.synchronize()
    assert pads.errors[1].tolist() == [0, 0, 0, 0]


def _symmetric_handle(buf, group):
    import torch.distributed._symmetric_memory as symm_mem

    try:
        return symm_mem.rendezvous(buf, group)
    except (TypeError, RuntimeError):
        return symm_mem.rendezvous(buf, group.group_name)


def cuda_world_scenario(rank, world, group, tokens_R, row_bytes):
    """Two GPUs over symmetric memory: [our pad | x rows | out rows] in one symmetric buffer, peer
    pointers from the rendezvous handle. Pull, push, barriers, then rank 1 skips a barrier."""
    import torch.distributed._symmetric_memory as symm_mem

    dev = torch.device("cuda", rank)
    stream = torch.cuda.current_stream(dev).cuda_stream
    w = World(tuple(tokens_R), K, row_bytes, row_bytes + 16)
    nbytes = max(w.nbytes(r) for r in range(world))
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
    handle = _symmetric_handle(buf, group)
    # buffer_ptrs are the peers' mappings of the allocation; our tensor may sit at an offset in it
    offset = buf.data_ptr() - handle.buffer_ptrs[rank]
    bases = [p + offset for p in handle.buffer_ptrs]
    pad_ptrs = torch.tensor(bases, dtype=torch.int64, device=dev)
    epoch = torch.zeros(1, dtype=torch.int64, device=dev)
    error = torch.zeros(4, dtype=torch.int32, device=dev)
    tables = w.tables()
    src_rank_C, route_C = tables[rank]
    capacity = src_rank_C.numel()
    table = (src_rank_C.to(dev), route_C.to(dev))
    x = w.x_rows(rank)
    buf.zero_()
    buf[w.x_offset() : w.x_offset() + x.numel()].copy_(x)
    buf[w.out_offset(rank) : w.out_offset(rank) + x.numel()].fill_(SENTINEL)
    torch.cuda.synchronize(dev)
    dist.barrier(group=group)  # every pad is zero before anyone signals

    def barrier(stage, timeout_s=30.0):
        core.barrier(
            "cuda",
            epoch.data_ptr(),
            pad_ptrs.data_ptr(),
            rank,
            world,
            error.data_ptr(),
            stage,
            int(timeout_s * 1e9),
            stream,
        )

    out = {}
    barrier(1)
    src_ptrs = torch.tensor([b + w.x_offset() for b in bases], dtype=torch.int64, device=dev)
    dst = torch.full((capacity * w.stride,), SENTINEL, dtype=torch.uint8, device=dev)
    core.pull_rows(
        "cuda",
        dst.data_ptr(),
        src_ptrs.data_ptr(),
        table[0].data_ptr(),
        table[1].data_ptr(),
        capacity,
        K,
        w.row_bytes,
        w.stride,
        w.stride,
        16,
        stream,
    )
    y = w.y_rows(rank, capacity).to(dev)
    dst_ptrs = torch.tensor([b + w.out_offset(r) for r, b in enumerate(bases)], dtype=torch.int64, device=dev)
    core.push_rows(
        "cuda",
        y.data_ptr(),
        dst_ptrs.data_ptr(),
        table[0].data_ptr(),
        table[1].data_ptr(),
        capacity,
        w.row_bytes,
        w.stride,
        w.stride,
        8,
        stream,
    )
    barrier(2)
    for _ in range(50):
        barrier(3)
    torch.cuda.synchronize(dev)
    want = reference_pull(
        [w.x_rows(r) for r in range(world)],
        src_rank_C,
        route_C,
        K,
        w.row_bytes,
        w.stride,
        w.stride,
        torch.full((capacity * w.stride,), SENTINEL, dtype=torch.uint8),
    )
    out["pulled"] = torch.equal(dst.cpu(), want)
    got = buf[w.out_offset(rank) : w.out_offset(rank) + x.numel()].cpu()
    out["pushed"] = torch.equal(got, w.expected_out(rank, tables))
    out["epoch"] = epoch.item()
    out["error_before"] = error.tolist()
    dist.barrier(group=group)

    # rank 1 skips a barrier: rank 0's kernel gives up after 0.5 s, the GPU does not hang
    if rank == 0:
        start = time.perf_counter()
        barrier(9, timeout_s=0.5)
        torch.cuda.synchronize(dev)
        out["timeout_elapsed"] = time.perf_counter() - start
    out["error_after"] = error.tolist()
    dist.barrier(group=group)
    if rank == 1:
        barrier(10, timeout_s=5)  # arrives late: rank 0's epoch is already there
        torch.cuda.synchronize(dev)
        out["late_error"] = error.tolist()
    torch.cuda.synchronize(dev)
    dist.barrier(group=group)  # nobody reads a peer's buffer after this
    del handle
    return out


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_cuda_two_gpus_symmetric_memory():
    require_cuda(2)
    results = run_ranks(2, "test_core_transport.cuda_world_scenario", [6, 5], 14336, device="cuda")
    for rank, res in enumerate(results):
        assert res["pulled"] and res["pushed"], rank
        assert res["epoch"] == 52 and res["error_before"] == [0, 0, 0, 0], rank
    assert results[0]["error_after"] == [ERROR_TIMEOUT, 1, 9, 0]
    assert 0.5 <= results[0]["timeout_elapsed"] < 10
    assert results[1]["error_after"] == [0, 0, 0, 0]
    assert results[1]["late_error"] == [0, 0, 0, 0]
