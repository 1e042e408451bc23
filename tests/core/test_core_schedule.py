"""mok-core's schedule table, send side, combine epilogue and ring planner against the reference.

Shape letters: docs/design.md §1. Each builder runs on the CPU and, where mok_core has CUDA
and torch sees a GPU, on CUDA with device tensors; everything the determinism contract covers
is compared bitwise (torch.equal) with mok_torch's reference backend.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import mok_core
import mok_torch as mok
from mok_torch.spec.experts import combine_epilogue
from mok_torch.spec.schedule import send_side, table_from_routes


def _cuda_skip_reason() -> str | None:
    if not mok_core.build_info()["cuda"]:
        return "mok_core was built without CUDA (MOK_CUDA=OFF or no nvcc at build time)"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    return None


CUDA_SKIP = _cuda_skip_reason()
_GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(CUDA_SKIP is not None, reason=str(CUDA_SKIP))]
# "cuda-multi": the CUDA build on many CTAs (a scratch buffer given), else the one-CTA build.
DEVICES = ["cpu", pytest.param("cuda", marks=_GPU_MARKS)]
SORT_DEVICES = [*DEVICES, pytest.param("cuda-multi", marks=_GPU_MARKS)]


def _torch_device(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def _stream(device: str) -> int:
    return torch.cuda.current_stream().cuda_stream if device.startswith("cuda") else 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _scratch(device: str, nbytes: int) -> tuple[torch.Tensor | None, int]:
    """(buffer, address) of the multi-CTA build's scratch, poisoned; (None, 0) for the others."""
    if device != "cuda-multi":
        return None, 0
    buf = torch.full((max(nbytes, 4),), 0x5A, dtype=torch.uint8, device="cuda")
    return buf, buf.data_ptr()


def _ptr_array(tensors: list[torch.Tensor], device: str) -> torch.Tensor:
    """An int64 array of data pointers, on the device the call reads it from."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------
# The schedule table


def core_table(
    routes_RTK: torch.Tensor,
    tokens_R: torch.Tensor,
    *,
    rank: int,
    num_local_experts: int,
    alignment: int,
    capacity: int,
    device: str,
    error: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """mok_core.build_table on per-rank tensors (as the all-gather leaves them); CPU results.
    `error` given: the error words the build starts from, returned as "error"."""
    R, Tmax, K = routes_RTK.shape
    El = num_local_experts
    dev = _torch_device(device)
    routes = [routes_RTK[s].to(device=dev, dtype=torch.int32).contiguous() for s in range(R)]
    tokens = [torch.tensor([int(tokens_R[s])], dtype=torch.int64, device=dev) for s in range(R)]
    routes_ptrs, tokens_ptrs = _ptr_array(routes, dev), _ptr_array(tokens, dev)
    # Each source's route rows: written for its routes to this rank, the rest keep the poison.
    route_rows = [torch.full((Tmax * K,), -7, dtype=torch.int32, device=dev) for _ in range(R)]
    route_row_ptrs = _ptr_array(route_rows, dev)
    _, scratch = _scratch(device, mok_core.schedule_scratch_bytes(R, Tmax, K, El))

    words = None if error is None else torch.tensor(error, dtype=torch.int32, device=dev)

    # Poisoned outputs: every element must be written.
    def poisoned(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((n,), 12345, dtype=dtype, device=dev)

    out = {
        "row_src_rank": poisoned(capacity, torch.int32),
        "row_route": poisoned(capacity, torch.int32),
        "expert_offsets": poisoned(El + 1, torch.int32),
        "expert_counts": poisoned(El, torch.int32),
        "recv_counts": poisoned(R, torch.int64),
        "tokens_per_rank": poisoned(R, torch.int64),
    }
    mok_core.build_table(
        dev,
        routes_ptrs.data_ptr(),
        tokens_ptrs.data_ptr(),
        R,
        Tmax,
        K,
        rank,
        El,
        alignment,
        capacity,
        *(t.data_ptr() for t in out.values()),
        stream=_stream(device),
        route_row_ptrs=route_row_ptrs.data_ptr(),
        scratch=scratch,
        error=0 if words is None else words.data_ptr(),
    )
    _sync(device)
    got = {k: v.cpu() for k, v in out.items()}
    got["route_rows"] = torch.stack([r.cpu() for r in route_rows]) if R else torch.empty(0)
    if words is not None:
        got["error"] = words.cpu()
    return got


def assert_table_matches_reference(
    routes_RTK: torch.Tensor, tokens_R: torch.Tensor, El: int, alignment: int, device: str, extra_rows: int = 0
) -> None:
    R, Tmax, K = routes_RTK.shape
    capacity = mok_core.schedule_capacity(R, Tmax, K, El, alignment) + extra_rows
    for rank in range(R):
        want = table_from_routes(
            routes_RTK, tokens_R, rank=rank, num_local_experts=El, alignment=alignment, capacity=capacity
        )
        got = core_table(
            routes_RTK, tokens_R, rank=rank, num_local_experts=El, alignment=alignment, capacity=capacity, device=device
        )
        case = f"R={R} Tmax={Tmax} K={K} El={El} align={alignment} rank={rank} tokens={tokens_R.tolist()}"
        for name, want_t in zip(
            ("row_src_rank", "row_route", "expert_offsets", "expert_counts", "recv_counts"), want, strict=True
        ):
            assert got[name].dtype == want_t.dtype, f"{case}: {name} dtype"
            assert torch.equal(got[name], want_t), f"{case}: {name}\n got {got[name]}\nwant {want_t}"
        assert torch.equal(got["tokens_per_rank"], tokens_R.to(torch.int64)), case
        # Each table row's route got the row's index in its source's route rows; nothing else did.
        want_rows = torch.full((R, Tmax * K), -7, dtype=torch.int32)
        src, route = want[0], want[1]
        used = src >= 0
        want_rows[src[used].long(), route[used].long()] = torch.nonzero(used).flatten().to(torch.int32)
        assert torch.equal(got["route_rows"], want_rows), f"{case}: route rows"


def random_routes(
    g: torch.Generator, R: int, Tmax: int, K: int, E: int, pattern: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, Tmax, K] routes and per-rank token counts for one routing pattern.

    Rows t >= tokens hold garbage (valid ids too): the builders must ignore them.
    """
    tokens = torch.randint(0, Tmax + 1, (R,), generator=g)
    if R > 1 and Tmax > 0:
        tokens[int(torch.randint(0, R, (1,), generator=g))] = 0  # an empty rank
        tokens[int(torch.randint(0, R, (1,), generator=g))] = Tmax  # a full one
    if pattern == "distinct":  # top-k without repeats, as a router gives
        routes = torch.stack([torch.rand(Tmax, E, generator=g).argsort(dim=1)[:, :K] for _ in range(R)])
    elif pattern == "duplicates":  # the same expert twice within a token
        routes = torch.randint(0, E, (R, Tmax, K), generator=g)
        routes[..., -1] = routes[..., 0]
    elif pattern == "one_expert":  # worst case: every route to one expert
        routes = torch.full((R, Tmax, K), int(torch.randint(0, E, (1,), generator=g)))
    elif pattern == "one_rank":  # every route to rank 0's experts
        routes = torch.randint(0, max(E // R, 1), (R, Tmax, K), generator=g)
    else:
        raise AssertionError(pattern)
    garbage = torch.randint(-1, E, (R, Tmax, K), generator=g)
    t_idx = torch.arange(Tmax).reshape(1, Tmax, 1)
    routes = torch.where(t_idx < tokens.reshape(R, 1, 1), routes, garbage)
    return routes.to(torch.int32), tokens


@pytest.mark.parametrize("device", SORT_DEVICES)
@pytest.mark.parametrize("pattern", ["distinct", "duplicates", "one_expert", "one_rank"])
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_table_matches_reference_random(device: str, pattern: str, R: int) -> None:
    g = torch.Generator().manual_seed(1000 * R + ["distinct", "duplicates", "one_expert", "one_rank"].index(pattern))
    cases = [
        (El, K, Tmax, align) for El in (1, 3, 8) for K in (1, 2, 4) for Tmax in (0, 1, 13) for align in (1, 8, 128)
    ]
    rng = random.Random(R)
    for El, K, Tmax, align in rng.sample(cases, 24):
        E = El * R
        if pattern == "distinct" and K > E:
            continue
        routes, tokens = random_routes(g, R, Tmax, K, E, pattern)
        assert_table_matches_reference(routes, tokens, El, align, device, extra_rows=rng.choice([0, 5]))


@pytest.mark.parametrize("device", SORT_DEVICES)
@pytest.mark.parametrize(("R", "Tmax", "K", "El"), [(1, 3000, 4, 16), (2, 2500, 8, 5), (4, 700, 6, 3)])
def test_table_matches_reference_large(device: str, R: int, Tmax: int, K: int, El: int) -> None:
    """Several ranking chunks per rank (the CUDA build ranks 8 routes per thread per chunk)."""
    g = torch.Generator().manual_seed(R * Tmax)
    for pattern, align in (("duplicates", 128), ("one_expert", 8), ("distinct", 1)):
        routes, tokens = random_routes(g, R, Tmax, K, El * R, pattern)
        tokens[0] = Tmax
        assert_table_matches_reference(routes, tokens, El, align, device)


@pytest.mark.parametrize("device", SORT_DEVICES)
def test_table_many_local_experts(device: str) -> None:
    """More local experts than lanes in a warp, and most experts empty."""
    g = torch.Generator().manual_seed(7)
    for El in (33, 257):
        routes, tokens = random_routes(g, 2, 40, 3, 2 * El, "duplicates")
        assert_table_matches_reference(routes, tokens, El, 8, device)
        routes[:, :, :] = torch.randint(0, 4, routes.shape, generator=g, dtype=torch.int32) * (El - 1)
        assert_table_matches_reference(routes, tokens, El, 1, device)


@pytest.mark.parametrize("device", SORT_DEVICES)
def test_table_out_of_range_tokens_and_ids(device: str) -> None:
    """Token counts outside [0, Tmax] read as clamped; ids outside [0, E) route nowhere."""
    routes = torch.tensor([[[0, 5], [1, -7]], [[2, 3], [99, 1]]], dtype=torch.int32)  # R=2, Tmax=2, K=2, El=2
    for tokens in ([2, 2], [5, 1], [-3, 2], [0, 0]):
        assert_table_matches_reference(routes, torch.tensor(tokens), 2, 4, device)


def first_bad_route(routes_RTK: torch.Tensor, tokens_R: torch.Tensor, E: int) -> tuple[int, int] | None:
    """(s * Tmax * K + i, id) of the first route (source rank, then route index i) whose id lies
    outside [0, E), among each source's first tokens (clamped to [0, Tmax]); None if none."""
    R, Tmax, K = routes_RTK.shape
    for s in range(R):
        n = min(max(int(tokens_R[s]), 0), Tmax) * K
        flat = routes_RTK[s].reshape(-1)[:n]
        bad = ((flat < 0) | (flat >= E)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            return s * Tmax * K + i, int(flat[i])
    return None


def decode_bad_expert(words: torch.Tensor) -> tuple[int, int]:
    """(flat route, id) from error words of code 3 (mok-core's schedule.h, bad_expert_word)."""
    low, high = (int(w) & 0xFFFFFFFF for w in words[2:4].tolist())
    return 0x7FFFFFFF - high, low - (1 << 32) if low & 0x80000000 else low


@pytest.mark.parametrize("device", SORT_DEVICES)
def test_table_records_the_first_bad_id(device: str) -> None:
    """Given the error words, the table build records the first route with an id outside [0, E)
    (the smallest source rank, then route index, whichever CTA meets it), leaves the words zero when
    every id is good, and keeps another error that came first; the table itself is as without."""
    g = torch.Generator().manual_seed(11)
    R, Tmax, K, El = 2, 3000, 4, 3  # > 2048 routes per source: several CTAs per source
    E = R * El
    for case in range(6):
        routes = torch.randint(0, E, (R, Tmax, K), generator=g, dtype=torch.int32)
        tokens = torch.tensor([Tmax, Tmax - 17 * case])
        if case > 0:  # bad ids strewn over both sources, some past a source's token count
            n = 1 + 40 * case
            where = torch.randint(0, R * Tmax * K, (n,), generator=g)
            values = torch.tensor([-1, E, E + 5, -(2**31), 2**31 - 1], dtype=torch.int32)
            routes.view(-1)[where] = values[torch.arange(n) % 5]
        want = first_bad_route(routes, tokens, E)
        capacity = mok_core.schedule_capacity(R, Tmax, K, El, 8)
        base = core_table(routes, tokens, rank=1, num_local_experts=El, alignment=8, capacity=capacity, device=device)
        got = core_table(
            routes, tokens, rank=1, num_local_experts=El, alignment=8, capacity=capacity, device=device, error=[0] * 4
        )
        for name, t in base.items():
            assert torch.equal(got[name], t), (case, name)
        if want is None:
            assert got["error"].tolist() == [0, 0, 0, 0], case
        else:
            assert int(got["error"][0]) == 3, (case, got["error"])
            assert decode_bad_expert(got["error"]) == want, case
        # An error already recorded (a timed-out barrier) stays as it was.
        kept = core_table(
            routes, tokens, rank=0, num_local_experts=El, alignment=8, capacity=capacity, device=device,
            error=[1, 1, 5, 0],
        )  # fmt: skip
        assert kept["error"].tolist() == [1, 1, 5, 0], case


def local_table(
    routes_TK: torch.Tensor, num_tokens: int, *, max_tokens: int, num_local_experts: int, alignment: int,
    capacity: int, device: str, error: list[int] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """build_table at one rank with local_routes: `routes_TK` (int32 or int64, [>= num_tokens, K])
    read where it is, each route's row and its id as read (routes_copy) into arrays of their own;
    the outputs as core_table names them, and "routes_copy"."""
    K, El, dev = routes_TK.shape[1], num_local_experts, _torch_device(device)
    routes = routes_TK.to(dev).contiguous()
    _, scratch = _scratch(device, mok_core.schedule_scratch_bytes(1, max_tokens, K, El))
    words = None if error is None else torch.tensor(error, dtype=torch.int32, device=dev)
    poison = lambda n, dt: torch.full((n,), 12345, dtype=dt, device=dev)  # noqa: E731
    out = {
        "row_src_rank": poison(capacity, torch.int32),
        "row_route": poison(capacity, torch.int32),
        "expert_offsets": poison(El + 1, torch.int32),
        "expert_counts": poison(El, torch.int32),
        "recv_counts": poison(1, torch.int64),
        "tokens_per_rank": poison(1, torch.int64),
    }
    route_row = torch.full((max_tokens * K,), -7, dtype=torch.int32, device=dev)
    copy = torch.full((max_tokens * K,), -9, dtype=torch.int32, device=dev)
    mok_core.build_table(
        dev, 0, 0, 1, max_tokens, K, 0, El, alignment, capacity, *(t.data_ptr() for t in out.values()),
        stream=_stream(device), scratch=scratch, error=0 if words is None else words.data_ptr(),
        local_routes=True, routes=routes.data_ptr(), routes_int64=routes.dtype == torch.int64,
        num_tokens=num_tokens, route_row=route_row.data_ptr(), routes_copy=copy.data_ptr(),
    )  # fmt: skip
    _sync(device)
    got = {k: v.cpu() for k, v in out.items()}
    got["route_rows"] = route_row.cpu()[None]
    got["routes_copy"] = copy.cpu()
    if words is not None:
        got["error"] = words.cpu()
    return got


@pytest.mark.parametrize("device", SORT_DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("T", "Tmax", "K", "El"), [(0, 5, 2, 3), (1, 1, 1, 1), (7, 9, 2, 4), (2500, 3001, 4, 16)])
def test_one_rank_table_reads_the_routes_in_place(device: str, dtype: torch.dtype, T: int, Tmax: int, K: int, El: int):
    """At one rank the table may read the rank's own routes (int32 or int64) and T instead of the
    transport's fields: the same bits, route rows included, and the same first bad id recorded."""
    g = torch.Generator().manual_seed(T + 3 * K)
    for bad in (False, True):
        routes = torch.randint(0, El, (Tmax, K), generator=g).to(dtype)
        if bad and T:
            routes.view(-1)[torch.randint(0, T * K, (3,), generator=g)] = El + 2
        capacity = mok_core.schedule_capacity(1, Tmax, K, El, 8)
        kw = dict(num_local_experts=El, alignment=8, capacity=capacity, device=device, error=[0] * 4)
        want = core_table(routes[None].to(torch.int32), torch.tensor([T]), rank=0, **kw)  # type: ignore[arg-type]
        got = local_table(routes, T, max_tokens=Tmax, **kw)  # type: ignore[arg-type]
        # A route no segment lists keeps its old row across ranks (no table writes it), -1 here.
        unlisted = torch.zeros(Tmax * K, dtype=torch.bool)
        unlisted[: T * K] = routes.reshape(-1)[: T * K] >= El
        assert bool((want["route_rows"][0][unlisted] == -7).all())
        want["route_rows"][0][unlisted] = -1
        for name, t in want.items():
            assert torch.equal(got[name], t), (bad, name)
        # The routes as read, in the first T * K words only (the rest untouched).
        copied = got.pop("routes_copy")
        assert torch.equal(copied[: T * K], routes.reshape(-1)[: T * K].to(torch.int32)), bad
        assert bool((copied[T * K :] == -9).all()), bad


@pytest.mark.parametrize("device", SORT_DEVICES)
def test_one_rank_table_never_wraps_an_int64_id(device: str) -> None:
    """An int64 id outside int32 (2^32 + 1 would wrap onto expert 1) is a bad id: recorded, its
    route in no segment and its row -1. (A copy into an int32 field would wrap it.)"""
    routes = torch.tensor([[0, 2**32 + 1], [1, -(2**40)]], dtype=torch.int64)
    capacity = mok_core.schedule_capacity(1, 2, 2, 2, 4)
    got = local_table(routes, 2, max_tokens=2, num_local_experts=2, alignment=4, capacity=capacity, device=device,
                      error=[0] * 4)  # fmt: skip
    assert got["expert_counts"].tolist() == [1, 1]
    assert int(got["error"][0]) == 3
    assert decode_bad_expert(got["error"]) == (1, 2**31 - 1)  # the first bad route, its id read as INT32_MAX
    assert got["route_rows"][0, [1, 3]].tolist() == [-1, -1], "the bad routes have no row"
    assert got["routes_copy"].tolist() == [0, 2**31 - 1, 1, -(2**31)], "copied as read: clamped, never wrapped"


def test_capacity_matches_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    for R, Tmax, K, E, align in itertools.product((1, 2, 3, 8), (1, 17, 4096), (1, 2, 8), (8, 24, 256), (1, 8, 128)):
        if E % R or K > E:
            continue
        monkeypatch.setattr(mok.workspace, "group_rank_and_size", lambda group, R=R: (0, R))
        ws = mok.create_workspace(
            mok.MoKConfig(expert_alignment=align),
            None,
            device="cpu",
            max_tokens=Tmax,
            hidden_size=8,
            topk=K,
            num_experts=E,
        )
        assert ws.world_size == R
        assert mok_core.schedule_capacity(R, Tmax, K, E // R, align) == ws.capacity, (R, Tmax, K, E, align)


# ---------------------------------------------------------------------------------------------
# The send side


def core_send_side(top_TK: torch.Tensor, El: int, R: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = top_TK.shape
    dev = _torch_device(device)
    top = top_TK.to(device=dev, dtype=torch.int32).contiguous()
    order = torch.full((T * K,), -5, dtype=torch.int64, device=dev)
    counts = torch.full((R,), -5, dtype=torch.int64, device=dev)
    _, scratch = _scratch(device, mok_core.schedule_scratch_bytes(R, max(T, 1), K, El))
    mok_core.build_send_side(
        dev, top.data_ptr(), T, K, El, R, order.data_ptr(), counts.data_ptr(), stream=_stream(device), scratch=scratch
    )
    _sync(device)
    return order.cpu(), counts.cpu()


@pytest.mark.parametrize("device", SORT_DEVICES)
def test_send_side_matches_reference(device: str) -> None:
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    cases = [(0, 1, 1, 1), (1, 1, 1, 1), (1, 4, 2, 2), (5000, 8, 8, 4), (3000, 3, 1, 3), (700, 2, 40, 8)]
    cases += [(rng.randint(0, 300), rng.randint(1, 6), rng.randint(1, 9), rng.randint(1, 4)) for _ in range(20)]
    for T, K, El, R in cases:
        E = El * R
        for pattern in ("duplicates", "one_expert", "distinct"):
            if pattern == "distinct" and K > E:
                continue
            routes, _ = random_routes(g, 1, T, K, E, pattern)
            top = routes[0]
            want_order, want_counts = send_side(top, El, R)
            got_order, got_counts = core_send_side(top, El, R, device)
            case = f"T={T} K={K} El={El} R={R} {pattern}"
            assert torch.equal(got_order, want_order), case
            assert torch.equal(got_counts, want_counts), case


@pytest.mark.parametrize("device", SORT_DEVICES)
def test_send_side_invalid_ids(device: str) -> None:
    """Ids < 0 sort first and ids >= E last, each group in route order, counted for no rank."""
    top = torch.tensor([[3, -1], [7, 0], [-4, 3], [9, 1]], dtype=torch.int32)  # E = 4 (El=2, R=2)
    order, counts = core_send_side(top, 2, 2, device)
    assert order.tolist() == [1, 4, 3, 7, 0, 5, 2, 6]
    assert counts.tolist() == [2, 2]


# ---------------------------------------------------------------------------------------------
# The combine epilogue


def core_combine(
    base_TH: torch.Tensor | None,
    rows_TKH: torch.Tensor,
    weights_TK: torch.Tensor | None,
    device: str,
    offset: int = 0,
) -> torch.Tensor:
    """mok_core.combine; `offset` elements shift every buffer off its 16-byte alignment."""
    T, K, H = rows_TKH.shape

    def place(t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)
        view = buf[offset:].view(t.shape)
        view.copy_(t)
        return view

    rows = place(rows_TKH.reshape(T * K, H))
    base = None if base_TH is None else place(base_TH)
    weights = None if weights_TK is None else place(weights_TK.reshape(T * K))
    out = place(torch.full((T, H), float("nan"), dtype=torch.bfloat16))
    mok_core.combine(
        device,
        out.data_ptr(),
        0 if base is None else base.data_ptr(),
        rows.data_ptr(),
        0 if weights is None else weights.data_ptr(),
        T,
        K,
        H,
        stream=_stream(device),
    )
    _sync(device)
    return out.cpu()


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise, except that any NaN matches any NaN (torch's NaN bits differ by device and code path;
    mok's are always 0x7FFF)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), f"{what}: NaN positions differ"
    same = got.view(torch.int16) == want.view(torch.int16)
    bad = ~(same | nan_got)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}"


def random_bf16(g: torch.Generator, shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("with_weights", [False, True])
def test_combine_matches_reference(device: str, with_base: bool, with_weights: bool) -> None:
    g = torch.Generator().manual_seed(11 + 2 * with_base + with_weights)
    for T, K, H in [(0, 2, 8), (1, 1, 1), (1, 1, 8), (3, 1, 7), (5, 2, 33), (17, 4, 64), (64, 8, 256), (9, 3, 4097)]:
        rows = random_bf16(g, (T, K, H), scale=3.0)
        base = random_bf16(g, (T, H)) if with_base else None
        weights = torch.rand(T, K, generator=g) if with_weights else None
        want = combine_epilogue(base, rows, weights)
        for offset in (0, 1):
            got = core_combine(base, rows, weights, device, offset=offset)
            assert_bits_equal(got, want, f"T={T} K={K} H={H} base={with_base} w={with_weights} off={offset}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [2, 8])
def test_combine_more_work_than_the_grid(device: str, K: int) -> None:
    """More 16-byte groups than the launch has threads (on a GPU the grid is what the device holds
    at once, so each thread takes several tokens' groups in turn): the
    reference's bits for every token, T prime, K = 8 as in the fine-grained shapes and 2 as in the
    coarse ones."""
    g = torch.Generator().manual_seed(17)
    T, H = 2053, 1536
    rows = random_bf16(g, (T, K, H), scale=3.0)
    base = random_bf16(g, (T, H))
    weights = torch.rand(T, K, generator=g)
    got = core_combine(base, rows, weights, device)
    assert_bits_equal(got, combine_epilogue(base, rows, weights), f"T={T} K={K} H={H}")


@pytest.mark.parametrize("device", DEVICES)
def test_combine_special_values(device: str) -> None:
    """Every bf16 bit pattern (subnormals, signed zeros, infinities, NaNs) and wild weights."""
    g = torch.Generator().manual_seed(5)
    T, K, H = 64, 3, 48
    rows = torch.randint(-(2**15), 2**15, (T, K, H), generator=g, dtype=torch.int16).view(torch.bfloat16)
    base = torch.randint(-(2**15), 2**15, (T, H), generator=g, dtype=torch.int16).view(torch.bfloat16)
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, 3e38, -2.5, float("inf"), 0.333])
    weights = pool[torch.randint(0, len(pool), (T, K), generator=g)]
    # Sums that cancel to signed zeros and overflow to infinity.
    rows[0, :, :] = torch.tensor(-0.0, dtype=torch.bfloat16)
    rows[1, 0, :], rows[1, 1, :] = 3e38, 3e38
    for b, w in ((None, None), (base, None), (None, weights), (base, weights)):
        got = core_combine(b, rows, w, device)
        assert_bits_equal(got, combine_epilogue(b, rows, w), "special values")
        # Every NaN is the one quiet NaN of bf16.h, whatever NaN the arithmetic made.
        nan_bits = got.view(torch.int16)[torch.isnan(got)]
        assert nan_bits.numel() > 0 and bool((nan_bits == 0x7FFF).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_weights", [False, True])
def test_combine_through_a_row_index(device: str, with_weights: bool) -> None:
    """With a row index the combine reads each route's row of a table-ordered buffer (no copy into
    route order): the bits of the plain combine over the rows gathered in route order. A route
    whose row lies outside [0, num_rows) adds no term (as if its slot were dropped)."""
    g = torch.Generator().manual_seed(13 + with_weights)
    for T, K, H, extra, offset in [(1, 1, 8, 0, 0), (5, 2, 33, 3, 1), (17, 4, 64, 11, 0), (64, 8, 256, 40, 0)]:
        num_rows = T * K + extra
        table = random_bf16(g, (num_rows, H), scale=3.0)
        index = torch.randperm(num_rows, generator=g)[: T * K].to(torch.int32)
        base = random_bf16(g, (T, H))
        weights = torch.rand(T, K, generator=g) if with_weights else None
        for drop in (False, True):
            idx = index.clone()
            if drop:  # some routes left out: rows -1 and num_rows
                idx[::3] = -1
                idx[1::5] = num_rows
            kept = ((idx >= 0) & (idx < num_rows)).reshape(T, K)
            gathered = table[idx.clamp(0, num_rows - 1).long()].reshape(T, K, H)
            want = base.float()
            for k in range(K):  # the reference's order, dropped slots skipped
                term = gathered[:, k].float() * (weights[:, k : k + 1] if weights is not None else 1.0)
                want = torch.where(kept[:, k : k + 1], want + term, want)
            want = want.to(torch.bfloat16)

            def place(t: torch.Tensor, offset: int = offset) -> torch.Tensor:
                buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)
                view = buf[offset:].view(t.shape)
                view.copy_(t)
                return view

            rows_d, idx_d, base_d = place(table), place(idx), place(base)
            w_d = None if weights is None else place(weights.reshape(-1))
            out = place(torch.full((T, H), float("nan"), dtype=torch.bfloat16))
            mok_core.combine(
                device, out.data_ptr(), base_d.data_ptr(), rows_d.data_ptr(), 0 if w_d is None else w_d.data_ptr(),
                T, K, H, stream=_stream(device), row_index=idx_d.data_ptr(), num_rows=num_rows,
            )  # fmt: skip
            _sync(device)
            assert_bits_equal(out.cpu(), want, f"T={T} K={K} H={H} drop={drop} w={with_weights}")
            if not drop:  # the plain combine over the gathered rows: the same bits
                plain = core_combine(base, gathered, weights, device)
                assert_bits_equal(out.cpu(), plain, f"T={T} K={K} H={H} vs the plain combine")


@pytest.mark.parametrize("device", DEVICES)
def test_combine_in_place(device: str) -> None:
    g = torch.Generator().manual_seed(9)
    T, K, H = 6, 2, 16
    rows = random_bf16(g, (T * K, H)).to(device)
    base = random_bf16(g, (T, H)).to(device)
    want = combine_epilogue(base.cpu(), rows.cpu().reshape(T, K, H), None)
    mok_core.combine(device, base.data_ptr(), base.data_ptr(), rows.data_ptr(), 0, T, K, H, stream=_stream(device))
    _sync(device)
    assert torch.equal(base.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [6, 0], ids=["rows", "no-rows"])
def test_combine_publishes_the_error_words(device: str, T: int) -> None:
    """Given the error words and an ErrorMirror's device address, the combine copies the words to
    the mirror behind the stream's work, with rows or without (no kernel to run then), and the
    same bits of out; one of the two alone is a ValueError naming the other."""
    g = torch.Generator().manual_seed(4)
    K, H = 2, 16
    rows = random_bf16(g, (max(T, 1) * K, H)).to(device)
    error = torch.tensor([2, 1, 0x305, 1], dtype=torch.int32, device=device)
    mirror = mok_core.ErrorMirror(device)
    assert mirror.read() == [0, 0, 0, 0]
    out = torch.full((max(T, 1), H), float("nan"), dtype=torch.bfloat16, device=device)
    mok_core.combine(device, out.data_ptr(), 0, rows.data_ptr(), 0, T, K, H, stream=_stream(device),
                     error=error.data_ptr(), error_mirror=mirror.device_address)  # fmt: skip
    _sync(device)
    assert mirror.read() == [2, 1, 0x305, 1]
    if T:
        want = combine_epilogue(None, rows.cpu().reshape(T, K, H), None)
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
    mirror.clear()
    assert mirror.read() == [0, 0, 0, 0]
    for kw, name in (
        (dict(error=error.data_ptr()), "error_mirror"),
        (dict(error_mirror=mirror.device_address), "error"),
    ):
        with pytest.raises(ValueError, match=f"{name} must not be 0"):
            mok_core.combine(device, out.data_ptr(), 0, rows.data_ptr(), 0, T, K, H, stream=_stream(device), **kw)


def test_float_to_bf16_rounding_matches_torch() -> None:
    """The rounding of bf16.h against torch's, on values that sit on and near the ties."""
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-(2**31), 2**31, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    low = torch.tensor([0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF], dtype=torch.int32)
    bits[: 5 * 2000] = (bits[: 5 * 2000] & ~0xFFFF) | low.repeat_interleave(2000)
    values = bits.view(torch.float32)
    values = values[~torch.isnan(values) & (bits != -(2**31))]  # NaN bits are by design; -0 + ... is +0
    # acc = +0 + fl(w * 1.0) = w exactly, so out = bf16(w): the conversion under test.
    ones = torch.ones(values.numel(), 1, 1, dtype=torch.bfloat16)
    got = core_combine(None, ones, values.reshape(-1, 1), "cpu")
    assert torch.equal(got.view(torch.int16).view(-1), values.to(torch.bfloat16).view(torch.int16))


# ---------------------------------------------------------------------------------------------
# The ring planner

PULL, COMPUTE, PUSH = 0, 1, 2


def expected_minibatches(pass_: int, num_rows: int, macro: int, mini: int) -> list[tuple[int, int, int, int]]:
    """(macrobatch, slot, row_begin, row_end) in issue order, from the reference's RingPlan."""
    from mok_torch.spec.ring import RingPlan

    plan = RingPlan(num_rows=num_rows, macrobatch=macro, minibatch=mini, offsets=(0, num_rows))
    macros = list(enumerate(plan.macrobatches()))
    if pass_ == 0:
        macros.reverse()
    return [(m, j, lo, hi) for m, (a, b) in macros for j, (lo, hi) in enumerate(plan.minibatches(a, b))]


RING_CASES = [
    (0, 4, 2),
    (1, 1, 1),
    (10, 4, 2),  # a partial last macrobatch
    (10, 4, 3),  # partial minibatches
    (12, 4, 4),  # macrobatch == minibatch
    (7, 100, 3),  # one macrobatch, no replay
    (9, 3, 5),  # minibatch larger than the macrobatch
    (100, 32, 7),
    (129, 64, 16),
]


@pytest.mark.parametrize("pass_", [0, 1])
@pytest.mark.parametrize(("num_rows", "macro", "mini"), RING_CASES)
def test_ring_plan(pass_: int, num_rows: int, macro: int, mini: int) -> None:
    tasks = mok_core.plan_ring(pass_, num_rows, macro, mini)
    minibatches = expected_minibatches(pass_, num_rows, macro, mini)
    assert len(tasks) == 3 * len(minibatches)
    if num_rows == 0:
        return

    # Issue order: pull, compute, push per minibatch, minibatches as the reference walks them.
    for q, (m, _, lo, hi) in enumerate(minibatches):
        for kind in (PULL, COMPUTE, PUSH):
            got = tasks[3 * q + kind]
            assert got[:4] == (kind, m, lo, hi), (q, kind, got)
    # Every row once per kind.
    for kind in (PULL, COMPUTE, PUSH):
        covered = sorted(r for t in tasks if t[0] == kind for r in range(t[2], t[3]))
        assert covered == list(range(num_rows)), kind
    # Forward ends holding macrobatch 0; backward starts with it.
    assert tasks[-1][1] == (0 if pass_ == 0 else (num_rows - 1) // macro)
    assert tasks[0][1] == ((num_rows - 1) // macro if pass_ == 0 else 0)

    # The dependency graph: dependents are later tasks (so it is acyclic and issue order is a
    # topological order), and num_deps counts exactly the tasks that release each one.
    released_by: dict[int, list[int]] = {i: [] for i in range(len(tasks))}
    for i, t in enumerate(tasks):
        assert isinstance(t[5], list) and len(t[5]) <= 2
        for d in t[5]:
            assert i < d < len(tasks), (i, d)
            released_by[d].append(i)
    for i, t in enumerate(tasks):
        assert t[4] == len(released_by[i]), (i, t, released_by[i])

    # The exact edges: pull -> compute -> push of a minibatch, and the compute of the slot's
    # previous holder -> the pull that reuses the slot.
    holder: dict[int, int] = {}  # slot -> issue index of the minibatch that last used it
    for q, (_, slot, _, _) in enumerate(minibatches):
        want_pull_deps = [] if slot not in holder else [3 * holder[slot] + COMPUTE]
        assert sorted(released_by[3 * q + PULL]) == want_pull_deps, (q, slot)
        assert released_by[3 * q + COMPUTE] == [3 * q + PULL]
        assert released_by[3 * q + PUSH] == [3 * q + COMPUTE]
        holder[slot] = q

    # Executing in issue order with dependency counters never runs a task early.
    pending = [t[4] for t in tasks]
    for i, t in enumerate(tasks):
        assert pending[i] == 0, i
        for d in t[5]:
            pending[d] -= 1


def test_ring_plan_bad_arguments() -> None:
    with pytest.raises(ValueError, match="pass"):
        mok_core.plan_ring(2, 10, 4, 2)
    with pytest.raises(ValueError, match="num_rows"):
        mok_core.plan_ring(0, -1, 4, 2)
    with pytest.raises(ValueError, match="macrobatch"):
        mok_core.plan_ring(0, 10, 0, 2)
    with pytest.raises(ValueError, match="minibatch"):
        mok_core.plan_ring(1, 10, 4, 0)


# ---------------------------------------------------------------------------------------------
# Bad arguments and missing CUDA


class TableCall:
    """A valid small build_table call whose arguments a test can spoil one at a time."""

    def __init__(self, device: str = "cpu") -> None:
        R, Tmax, K, El, align = 2, 3, 2, 2, 4
        self.routes = [torch.zeros(Tmax, K, dtype=torch.int32, device=device) for _ in range(R)]
        self.tokens = [torch.tensor([Tmax], dtype=torch.int64, device=device) for _ in range(R)]
        self.routes_ptrs = _ptr_array(self.routes, device)
        self.tokens_ptrs = _ptr_array(self.tokens, device)
        capacity = mok_core.schedule_capacity(R, Tmax, K, El, align)
        self.outs = [
            torch.empty(capacity, dtype=torch.int32, device=device),
            torch.empty(capacity, dtype=torch.int32, device=device),
            torch.empty(El + 1, dtype=torch.int32, device=device),
            torch.empty(El, dtype=torch.int32, device=device),
            torch.empty(R, dtype=torch.int64, device=device),
            torch.empty(R, dtype=torch.int64, device=device),
        ]
        self.kw = dict(
            device=device,
            routes_ptrs=self.routes_ptrs.data_ptr(),
            tokens_ptrs=self.tokens_ptrs.data_ptr(),
            world_size=R,
            max_tokens=Tmax,
            topk=K,
            rank=0,
            num_local_experts=El,
            alignment=align,
            capacity=capacity,
            row_src_rank=self.outs[0].data_ptr(),
            row_route=self.outs[1].data_ptr(),
            expert_offsets=self.outs[2].data_ptr(),
            expert_counts=self.outs[3].data_ptr(),
            recv_counts=self.outs[4].data_ptr(),
            tokens_per_rank=self.outs[5].data_ptr(),
            stream=_stream(device),
        )

    def __call__(self, **changes: object) -> None:
        mok_core.build_table(**{**self.kw, **changes})
        _sync(self.kw["device"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"world_size": 0}, "world_size"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"topk": 0}, "topk"),
        ({"rank": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"num_local_experts": 0}, "num_local_experts"),
        ({"alignment": 3}, "alignment"),
        ({"alignment": 0}, "alignment"),
        ({"capacity": 1}, "capacity"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"routes_ptrs": 0}, "routes_ptrs"),
        ({"row_route": 0}, "row_route"),
        ({"expert_counts": 2}, "expert_counts"),  # misaligned
        ({"device": "tpu"}, "device"),
    ],
)
def test_build_table_bad_arguments(device: str, changes: dict, name: str) -> None:
    call = TableCall(device)
    call()  # the unspoiled call works
    with pytest.raises(ValueError, match=name):
        call(**changes)


@pytest.mark.parametrize("device", DEVICES)
def test_build_table_local_routes_bad_arguments(device: str) -> None:
    call = TableCall(device)
    local = dict(local_routes=True, routes=call.routes[0].data_ptr(), num_tokens=3, world_size=1, capacity=12)
    call(**local)  # one rank, its routes in place: works
    with pytest.raises(ValueError, match="world_size 1"):
        call(**{**local, "world_size": 2, "capacity": call.kw["capacity"]})
    with pytest.raises(ValueError, match="route_row_ptrs must be 0"):
        call(**local, route_row_ptrs=call.routes_ptrs.data_ptr())
    with pytest.raises(ValueError, match=r"routes_copy .* needs local_routes"):
        call(routes_copy=call.routes[0].data_ptr())
    with pytest.raises(ValueError, match="routes_copy"):
        call(**local, routes_copy=call.routes[0].data_ptr() + 2)  # int32 misaligned
    with pytest.raises(ValueError, match="num_tokens"):
        call(**{**local, "num_tokens": 4})
    with pytest.raises(ValueError, match="routes"):
        call(**{**local, "routes": 0})
    with pytest.raises(ValueError, match="routes"):
        call(**{**local, "routes": call.routes[0].data_ptr() + 4}, routes_int64=True)  # int64 misaligned


def test_build_table_null_rank_pointer_on_cpu() -> None:
    call = TableCall("cpu")
    call.routes_ptrs[1] = 0
    with pytest.raises(ValueError, match=r"routes_ptrs\[1\]"):
        call()


def test_schedule_capacity_bad_arguments() -> None:
    assert mok_core.schedule_capacity(2, 0, 1, 3, 1) == 0
    assert mok_core.schedule_capacity(2, 5, 2, 3, 8) == 48  # align_up(20 + 21, 8)
    for args, name in [
        ((0, 1, 1, 1, 1), "world_size"),
        ((1, -1, 1, 1, 1), "max_tokens"),
        ((1, 1, 0, 1, 1), "topk"),
        ((1, 1, 1, 0, 1), "num_local_experts"),
        ((1, 1, 1, 1, 6), "alignment"),
        ((64, 2**26, 8, 1, 1), "2\\^31"),
    ]:
        with pytest.raises(ValueError, match=name):
            mok_core.schedule_capacity(*args)


@pytest.mark.parametrize("device", DEVICES)
def test_send_side_and_combine_bad_arguments(device: str) -> None:
    top = torch.zeros(4, 2, dtype=torch.int32, device=device)
    order = torch.empty(8, dtype=torch.int64, device=device)
    counts = torch.empty(2, dtype=torch.int64, device=device)
    ok = dict(
        device=device,
        top_experts=top.data_ptr(),
        num_tokens=4,
        topk=2,
        num_local_experts=2,
        world_size=2,
        send_order=order.data_ptr(),
        send_counts=counts.data_ptr(),
        stream=_stream(device),
    )
    mok_core.build_send_side(**ok)
    for change, name in [
        ({"num_tokens": -1}, "num_tokens"),
        ({"topk": 0}, "topk"),
        ({"num_local_experts": 0}, "num_local_experts"),
        ({"world_size": 0}, "world_size"),
        ({"send_order": 0}, "send_order"),
        ({"device": "gpu"}, "device"),
    ]:
        with pytest.raises(ValueError, match=name):
            mok_core.build_send_side(**{**ok, **change})

    rows = torch.zeros(8, 16, dtype=torch.bfloat16, device=device)
    out = torch.empty(4, 16, dtype=torch.bfloat16, device=device)
    ok = dict(
        device=device,
        out=out.data_ptr(),
        base=0,
        rows=rows.data_ptr(),
        weights=0,
        num_tokens=4,
        topk=2,
        hidden=16,
        stream=_stream(device),
    )
    mok_core.combine(**ok)
    for change, name in [
        ({"num_tokens": -1}, "num_tokens"),
        ({"topk": 0}, "topk"),
        ({"hidden": -1}, "hidden"),
        ({"out": 0}, "out"),
        ({"rows": 0}, "rows"),
        ({"weights": out.data_ptr() + 2}, "weights"),  # misaligned fp32
        ({"row_index": out.data_ptr() + 2, "num_rows": 8}, "row_index"),  # misaligned int32
        ({"row_index": out.data_ptr(), "num_rows": -1}, "num_rows"),
        ({"device": "mps"}, "device"),
    ]:
        with pytest.raises(ValueError, match=name):
            mok_core.combine(**{**ok, **change})


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_SKIP is not None, reason=str(CUDA_SKIP))
def test_cuda_table_rejects_too_many_local_experts() -> None:
    """The one-CTA CUDA build keeps per-expert counters in shared memory: a clear error past it."""
    El = 200_000
    call = TableCall("cuda")
    call.outs[2] = torch.empty(El + 1, dtype=torch.int32, device="cuda")
    call.outs[3] = torch.empty(El, dtype=torch.int32, device="cuda")
    capacity = mok_core.schedule_capacity(2, 3, 2, El, 4)
    rows = [torch.empty(capacity, dtype=torch.int32, device="cuda") for _ in range(2)]
    with pytest.raises(ValueError, match="num_local_experts"):
        call(
            num_local_experts=El,
            capacity=capacity,
            row_src_rank=rows[0].data_ptr(),
            row_route=rows[1].data_ptr(),
            expert_offsets=call.outs[2].data_ptr(),
            expert_counts=call.outs[3].data_ptr(),
        )


@pytest.mark.skipif(mok_core.build_info()["cuda"], reason="mok_core was built with CUDA")
def test_cuda_device_without_cuda_build_raises() -> None:
    call = TableCall("cpu")
    with pytest.raises(RuntimeError, match="without CUDA"):
        call(device="cuda")
    with pytest.raises(RuntimeError, match="without CUDA"):
        mok_core.build_send_side("cuda", 0, 0, 1, 1, 1, 0, 0)
    with pytest.raises(RuntimeError, match="without CUDA"):
        mok_core.combine("cuda", 0, 0, 0, 0, 0, 1, 1)
