"""The benchmark's providers: mok and the baselines, each a named way to run one layer call.

Shape letters: docs/design.md §1, and N rows this rank's experts receive, P those rows padded
per expert.

A provider says why it cannot run a shape (`unavailable`, reported as "skipped: ...") or
returns the forward as a closure over a case's inputs (`prepare`); the runner times it, runs its
backward through autograd (`y.backward(dy)`), and checks it twice for bitwise repeats.

- `mok` / `mok-<backend>`: `mok_torch.moe`; `mok-dispatch-push`, `mok-combine-pull`, `mok-push-pull`:
  the same with the other transfer directions (MoKConfig.dispatch / .combine).
- `torch-a2a`: what a PyTorch user writes today (torchtitan style): routes sorted by
  expert, counts exchanged with all_to_all_single and read on the host for split sizes,
  token rows through the differentiable all_to_all_single, regrouped per local expert and
  padded, `torch._grouped_mm` experts (a per-expert torch.mm loop on the CPU, where
  _grouped_mm has no backward), rows sent back, `index_add` combine. `torch-a2a-compile`
  runs the expert computation under torch.compile (max-autotune, no CUDA graphs).
- `torch-loop`: the eager Hugging Face per-expert loop, one rank, small shapes.
- `sonicmoe`: SonicMoE's `moe_general_routing_inputs` on the same routing (one GPU, no shared
  expert), its weights in its own layout (gate and up rows interleaved), made once per case from
  the same values; they are its own leaves, so its weight gradients are not among the ones the
  determinism check compares (y, dx and the router-weight gradient are). Skipped, with the
  reason, where it is not importable.
- `deepep`: reported as skipped unless importable.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import moe
from ..backends import resolve_backend
from ..config import BACKENDS, MoKConfig
from ..functional import build_schedule
from ..functional import forward as mok_forward
from ..workspace import get_workspace
from .inputs import LayerCall, Weights3
from .shapes import Shape
from .timing import Ranks

DEFAULT_PROVIDERS = ("mok", "torch-a2a", "torch-loop", "deepep", "sonicmoe")
# mok with the non-default transfer directions (MoKConfig.dispatch / .combine), on --backend
DIRECTION_PROVIDERS = {
    "mok-dispatch-push": dict(dispatch="push"),
    "mok-combine-pull": dict(combine="pull"),
    "mok-push-pull": dict(dispatch="push", combine="pull"),
}
KNOWN_PROVIDERS = (
    "mok", "mok-<backend>", *DIRECTION_PROVIDERS, "torch-a2a", "torch-a2a-compile", "torch-loop", "deepep", "sonicmoe",
)  # fmt: skip
# Backends whose experts run the reference arithmetic (one elementwise op per reduction step)
# take minutes per layer call past this many T*K*H*I.
REFERENCE_MAX_WORK = 2**24
# Rows per expert group a bf16 torch._grouped_mm wants (16-byte aligned TMA tiles).
GROUP_ALIGN = 16
LOOP_MAX_EXPERTS = 64
LOOP_MAX_TOKENS = 4096

Forward = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Settings:
    """What every provider may need to know about the run."""

    allow_slow: bool
    passes: tuple[str, ...] = ("forward", "forward+backward")  # what the run times


class Provider:
    """A named way to run the layer: `unavailable` (a reason, or None) and `prepare`."""

    name: str = ""
    precision: str = "bf16"  # precision of its GEMM operands (picks the matmul ceiling)

    def unavailable(self, shape: Shape, ranks: Ranks, settings: Settings) -> str | None:
        return None

    def prepare(self, call: LayerCall, ranks: Ranks, settings: Settings) -> Forward:
        raise NotImplementedError

    def backend(self, ranks: Ranks) -> str | None:
        """The implementation that runs (mok's resolved backend), for the record."""
        return None

    def saved_bytes(self, call: LayerCall, forward: Forward, ranks: Ranks) -> tuple[int | None, str]:
        """(bytes of activations kept for backward, how they were counted)."""
        return saved_bytes_by_hooks(call, forward), "tensors saved for backward (saved_tensors_hooks)"


def saved_bytes_by_hooks(call: LayerCall, forward: Forward) -> int:
    """Bytes of the storages autograd saves during `forward()`, the call's inputs excluded.

    Counted by storage, once each: a saved view keeps its whole storage alive. The inputs
    (x, router weights, weights) exist with or without the layer, so they do not count.
    """
    inputs = {t.untyped_storage().data_ptr() for t in call.leaves()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (wrappers)
            return t
        ptr = storage.data_ptr()
        if ptr and ptr not in inputs:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    del y
    return sum(seen.values())


# ---------------------------------------------------------------------------------------
# mok


def _detached(w: Weights3) -> Weights3:
    return w[0].detach(), w[1].detach(), w[2].detach()


class MokProvider(Provider):
    def __init__(self, name: str, backend: str, precision: str, **config: Any) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"provider {name!r}: unknown mok backend {backend!r} (known: {', '.join(BACKENDS)})")
        self.name, self.precision = name, precision
        self.config = MoKConfig(precision=precision, backend=backend, **config)

    def backend(self, ranks: Ranks) -> str | None:
        try:
            return resolve_backend(self.config, ranks.device).name
        except ValueError:
            return None

    def unavailable(self, shape: Shape, ranks: Ranks, settings: Settings) -> str | None:
        try:
            backend = resolve_backend(self.config, ranks.device)
        except ValueError as exc:
            return str(exc)
        work = shape.tokens * shape.topk * shape.hidden * shape.inner
        # The cuda backend's forward runs mok-bf16's GEMMs (BF16) or mok-mxfp8's FP8 GEMMs (MXFP8)
        # where the shape allows; its BF16 backward too when the expert alignment is a multiple
        # of 64 (else the reference arithmetic), its MXFP8 backward always (FP8 input- and
        # weight-gradient GEMMs; the alignment is a multiple of 32 in MXFP8).
        from ..backends.native import gpu_backward_kernels

        slow = getattr(backend, "reference_experts", False) or self.precision == "mxfp8"
        gpu_forward = self._gpu_forward(backend, shape, ranks)
        gpu_backward = self.precision == "mxfp8" or gpu_backward_kernels(self.config)
        if gpu_forward and (settings.passes == ("forward",) or gpu_backward):
            slow = False
        if slow and work > REFERENCE_MAX_WORK and not settings.allow_slow:
            what = "backward" if gpu_forward else f"{'MXFP8 ' if self.precision == 'mxfp8' else ''}experts"
            hint = "; --pass forward times its forward on the GPU GEMMs" if gpu_forward else ""
            return (
                f"{backend.name} backend: its {what} run the reference arithmetic (no expert kernels "
                f"yet), too slow for this shape (use --allow-slow{hint})"
            )
        return None

    def _gpu_forward(self, backend: Any, shape: Shape, ranks: Ranks) -> bool:
        """Whether this shape's forward runs mok-bf16's GPU GEMMs (routed and shared experts), or
        in MXFP8 mok-mxfp8's (routed experts)."""
        from ..backends.native import gpu_forward_kernels, gpu_mxfp8_forward_kernels

        if getattr(backend, "device_type", None) != "cuda" or shape.experts % shape.world:
            return False
        local = shape.experts // shape.world
        dims = (ranks.device, shape.hidden, shape.inner, local)
        if self.precision == "mxfp8":  # the shared expert: the reference's bf16 arithmetic in PyTorch
            return gpu_mxfp8_forward_kernels(self.config, *dims)
        ok = gpu_forward_kernels(self.config, *dims)
        return ok and (shape.shared_inner == 0 or shape.shared_inner % 64 == 0)

    def prepare(self, call: LayerCall, ranks: Ranks, settings: Settings) -> Forward:
        T = call.shape.tokens

        def forward() -> torch.Tensor:
            return moe(
                call.x_TH,
                call.top_experts_TK,
                call.router_weights_TK,
                call.routed,
                call.shared,
                config=self.config,
                group=ranks.group,
                max_tokens=T,
            )

        return forward

    def saved_bytes(self, call: LayerCall, forward: Forward, ranks: Ranks) -> tuple[int | None, str]:
        """ForwardContext.saved_bytes() of the functional API (collective, like the call)."""
        s = call.shape
        ws = get_workspace(
            self.config,
            ranks.group,
            device=ranks.device,
            max_tokens=s.tokens,
            hidden_size=s.hidden,
            topk=s.topk,
            num_experts=s.experts,
        )
        with torch.no_grad():
            sched = build_schedule(ws, self.config, call.top_experts_TK)
            _, ctx = mok_forward(
                self.config,
                ws,
                sched,
                call.x_TH.detach(),
                call.router_weights_TK.detach(),
                _detached(call.routed),
                None if call.shared is None else _detached(call.shared),
            )
        return ctx.saved_bytes(), "mok ForwardContext.saved_bytes() (functional API)"


# ---------------------------------------------------------------------------------------
# torch-a2a: token all-to-all + grouped GEMMs, the way PyTorch users write it today


def _all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable all_to_all_single of rows (its backward sends the gradients back)."""
    import torch.distributed.nn.functional as dist_nn

    out = rows.new_empty(sum(out_splits), *rows.shape[1:])
    with warnings.catch_warnings():
        # Deprecated in favour of the functional collectives; still what most code calls.
        warnings.simplefilter("ignore", FutureWarning)
        return dist_nn.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)


def experts_grouped_mm(
    x_PH: torch.Tensor, offs: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over row groups ending at `offs` (int32 cumsum), with torch._grouped_mm."""
    gate = torch._grouped_mm(x_PH, wg.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x_PH, wu.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, wd.transpose(-2, -1), offs=offs)


def experts_mm_loop(
    x_PH: torch.Tensor, sizes: list[int], wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> torch.Tensor:
    """The same with one torch.mm per expert and GEMM (the CPU has no _grouped_mm backward)."""
    outs = []
    start = 0
    for e, n in enumerate(sizes):
        xe = x_PH[start : start + n]
        outs.append(torch.mm(F.silu(torch.mm(xe, wg[e].t())) * torch.mm(xe, wu[e].t()), wd[e].t()))
        start += n
    return torch.cat(outs)


def shared_expert(x_TH: torch.Tensor, shared: Weights3) -> torch.Tensor:
    wg, wu, wd = shared
    return torch.mm(F.silu(torch.mm(x_TH, wg.t())) * torch.mm(x_TH, wu.t()), wd.t())


Experts = Callable[[torch.Tensor, torch.Tensor, list[int], Weights3], torch.Tensor]


def torch_a2a_forward(call: LayerCall, ranks: Ranks, experts: Experts) -> torch.Tensor:
    """y [T, H] bf16 of one layer call, differentiable in x, router weights and weights."""
    x, top, w = call.x_TH, call.top_experts_TK, call.router_weights_TK
    T, K = top.shape
    H = x.shape[1]
    R, El = ranks.world, call.routed[0].shape[0]
    dev = x.device
    flat_e = top.reshape(-1)
    order = torch.argsort(flat_e, stable=True)  # routes by expert, then (t, k)
    token_of = order // K
    counts_E = torch.bincount(flat_e, minlength=El * R)
    x_sorted = x.index_select(0, token_of)
    send_splits: list[int] = []
    recv_splits: list[int] = []
    if R > 1:
        recv_E = torch.empty_like(counts_E)  # [source rank, local expert]
        dist.all_to_all_single(recv_E, counts_E, group=ranks.group)
        sent, received = torch.stack([counts_E, recv_E]).tolist()  # the host reads the split sizes
        send_splits = [sum(sent[d * El : (d + 1) * El]) for d in range(R)]
        recv_RE = [received[s * El : (s + 1) * El] for s in range(R)]
        recv_splits = [sum(r) for r in recv_RE]
        x_recv = _all_to_all_rows(x_sorted, recv_splits, send_splits, ranks.group)
    else:
        recv_RE = [counts_E.tolist()]
        x_recv = x_sorted

    # Rows arrive as [source rank][local expert]; the GEMMs want [local expert][source rank],
    # each expert's group padded to GROUP_ALIGN rows, an empty expert given GROUP_ALIGN zero
    # rows (an empty group once hung _grouped_mm's backward).
    rows_E = [sum(recv_RE[s][e] for s in range(R)) for e in range(El)]
    sizes = [max(GROUP_ALIGN, -(-n // GROUP_ALIGN) * GROUP_ALIGN) for n in rows_E]
    group_start, start = [], 0
    for size in sizes:
        group_start.append(start)
        start += size
    seg_sizes, seg_dest = [], []  # segments (source s, expert e) in arrival order
    for s in range(R):
        for e in range(El):
            seg_sizes.append(recv_RE[s][e])
            seg_dest.append(group_start[e] + sum(recv_RE[q][e] for q in range(s)))
    n_rows = sum(seg_sizes)
    sizes_t = torch.tensor(seg_sizes, device=dev)
    seg_id = torch.repeat_interleave(torch.arange(len(seg_sizes), device=dev), sizes_t, output_size=n_rows)
    within = torch.arange(n_rows, device=dev) - (torch.cumsum(sizes_t, 0) - sizes_t)[seg_id]
    dest_N = torch.tensor(seg_dest, device=dev)[seg_id] + within
    x_grouped = x_recv.new_zeros(start, H).index_copy(0, dest_N, x_recv)
    offs = torch.tensor([group_start[e] + sizes[e] for e in range(El)], dtype=torch.int32, device=dev)

    out_grouped = experts(x_grouped, offs, sizes, call.routed)
    out_recv = out_grouped.index_select(0, dest_N)
    out_sorted = _all_to_all_rows(out_recv, send_splits, recv_splits, ranks.group) if R > 1 else out_recv

    w_sorted = w.reshape(-1).index_select(0, order)
    y = x.new_zeros(T, H, dtype=torch.float32).index_add(0, token_of, out_sorted.float() * w_sorted[:, None])
    if call.shared is not None:
        y = y + shared_expert(x, call.shared).float()
    return y.to(x.dtype)


class TorchA2AProvider(Provider):
    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled
        self.name = "torch-a2a-compile" if compiled else "torch-a2a"

    def unavailable(self, shape: Shape, ranks: Ranks, settings: Settings) -> str | None:
        if self.compiled and not ranks.cuda:
            return "the torch.compile variant is measured on CUDA only"
        return None

    def prepare(self, call: LayerCall, ranks: Ranks, settings: Settings) -> Forward:
        experts: Experts
        if ranks.cuda:
            grouped: Callable[..., torch.Tensor] = experts_grouped_mm
            if self.compiled:
                torch._dynamo.reset()  # a fresh cache per case: never fall back to eager on a recompile limit
                grouped = torch.compile(experts_grouped_mm, mode="max-autotune-no-cudagraphs", dynamic=False)

            def experts(x: torch.Tensor, offs: torch.Tensor, sizes: list[int], w: Weights3) -> torch.Tensor:
                return grouped(x, offs, *w)

        else:

            def experts(x: torch.Tensor, offs: torch.Tensor, sizes: list[int], w: Weights3) -> torch.Tensor:
                return experts_mm_loop(x, sizes, *w)

        return lambda: torch_a2a_forward(call, ranks, experts)

    def saved_bytes(self, call: LayerCall, forward: Forward, ranks: Ranks) -> tuple[int | None, str]:
        if not self.compiled:
            return super().saved_bytes(call, forward, ranks)
        # Hooks would make dynamo trace (or recompile) differently; count what the graph keeps instead.
        if not ranks.cuda:
            return None, "not measured"
        torch.cuda.synchronize(ranks.device)
        before = torch.cuda.memory_allocated(ranks.device)
        y = forward()
        torch.cuda.synchronize(ranks.device)
        kept = torch.cuda.memory_allocated(ranks.device) - before - y.untyped_storage().nbytes()
        del y
        return max(kept, 0), "device memory the graph keeps after forward, output excluded"


# ---------------------------------------------------------------------------------------
# torch-loop: the eager per-expert loop (Hugging Face style)


def torch_loop_forward(call: LayerCall) -> torch.Tensor:
    x, top, w = call.x_TH, call.top_experts_TK, call.router_weights_TK
    wg, wu, wd = call.routed
    T, H = x.shape
    E = wg.shape[0]
    y = x.new_zeros(T, H, dtype=torch.float32)
    mask_EKT = F.one_hot(top, E).permute(2, 1, 0)
    for e in (mask_EKT.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():  # experts with tokens, read on the host
        k_pos, tokens = torch.where(mask_EKT[e])
        xe = x[tokens]
        out = torch.mm(F.silu(torch.mm(xe, wg[e].t())) * torch.mm(xe, wu[e].t()), wd[e].t())
        y.index_add_(0, tokens, out.float() * w[tokens, k_pos, None])
    if call.shared is not None:
        y = y + shared_expert(x, call.shared).float()
    return y.to(x.dtype)


class TorchLoopProvider(Provider):
    name = "torch-loop"

    def unavailable(self, shape: Shape, ranks: Ranks, settings: Settings) -> str | None:
        if ranks.world > 1:
            return "one rank only (no expert parallelism in the eager loop)"
        if shape.experts > LOOP_MAX_EXPERTS or shape.tokens > LOOP_MAX_TOKENS:
            return f"small shapes only (E <= {LOOP_MAX_EXPERTS}, T <= {LOOP_MAX_TOKENS})"
        return None

    def prepare(self, call: LayerCall, ranks: Ranks, settings: Settings) -> Forward:
        return lambda: torch_loop_forward(call)


# ---------------------------------------------------------------------------------------
# optional libraries


class OptionalProvider(Provider):
    """A library measured only where it is installed; until then an import check."""

    def __init__(self, name: str, module: str) -> None:
        self.name, self.module = name, module

    def unavailable(self, shape: Shape, ranks: Ranks, settings: Settings) -> str | None:
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # any import failure means "not here"
            return f"not importable ({self.module}: {type(exc).__name__})"
        return f"{self.module} is importable, but the harness has no {self.name} provider yet"


class SonicMoEProvider(Provider):
    """SonicMoE (arXiv 2512.14080) on the case's routing: the one-GPU peer on Hopper."""

    name = "sonicmoe"

    def unavailable(self, shape: Shape, ranks: Ranks, settings: Settings) -> str | None:
        if not ranks.cuda:
            return "CUDA only"
        if ranks.world > 1:
            return "one GPU only (its expert parallelism is not wired into this harness)"
        if shape.shared_inner:
            return "SonicMoE has no shared expert (compare it on the shapes without one)"
        try:
            importlib.import_module("sonicmoe")
        except Exception as exc:  # any import failure means "not here"
            return f"not importable (sonicmoe: {type(exc).__name__}: {exc})"
        return None

    def prepare(self, call: LayerCall, ranks: Ranks, settings: Settings) -> Forward:
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType

        wg, wu, wd = (w.detach() for w in call.routed)
        E, I, H = wg.shape
        # c_fc [E, 2I, H]: row 2i is gate row i, row 2i + 1 up row i (its interleaved layout).
        c_fc = torch.stack([wg, wu], dim=2).reshape(E, 2 * I, H).requires_grad_()
        c_proj = wd.clone().requires_grad_()
        # Its weights are leaves of the call: their gradients are dropped before each timed call
        # and each peak-memory pass as mok's are (not inside its forward, where freeing them
        # hid the gradients' size from its peak), and they are inputs, not saved activations.
        call.extra_leaves += [c_fc, c_proj]
        T, K = call.top_experts_TK.shape
        dev = call.x_TH.device
        # Routes in token order (its token indices must be sorted), as int32.
        token_idx = torch.arange(T, device=dev, dtype=torch.int32).repeat_interleave(K)
        expert_idx = call.top_experts_TK.reshape(-1).to(torch.int32)

        def forward() -> torch.Tensor:
            y, _ = moe_general_routing_inputs(
                call.x_TH, call.router_weights_TK.reshape(-1), token_idx, expert_idx, c_fc.permute(1, 2, 0), None,
                c_proj.permute(1, 2, 0), None, E, torch.cuda.current_stream(dev).cuda_stream, ActivationType.SWIGLU,
            )  # fmt: skip
            return y

        return forward


def make_providers(names: list[str], backends: list[str], precision: str) -> list[Provider]:
    """Providers for `--providers` (mok expands to one per `--backend`)."""
    providers: list[Provider] = []
    for name in names:
        if name == "mok":
            for b in backends:
                providers.append(MokProvider("mok" if len(backends) == 1 else f"mok-{b}", b, precision))
        elif name in DIRECTION_PROVIDERS:
            providers.append(MokProvider(name, backends[0], precision, **DIRECTION_PROVIDERS[name]))
        elif name.startswith("mok-"):
            providers.append(MokProvider(name, name[len("mok-") :], precision))
        elif name in ("torch-a2a", "torch-a2a-compile"):
            providers.append(TorchA2AProvider(compiled=name.endswith("compile")))
        elif name == "torch-loop":
            providers.append(TorchLoopProvider())
        elif name == "deepep":
            providers.append(OptionalProvider(name, "deep_ep"))
        elif name == "sonicmoe":
            providers.append(SonicMoEProvider())
        else:
            raise ValueError(f"unknown provider {name!r}; known: {', '.join(KNOWN_PROVIDERS)}")
    seen: set[str] = set()
    unique = []
    for p in providers:
        if p.name not in seen:
            seen.add(p.name)
            unique.append(p)
    return unique
