"""The main job: train a small MoE language model twice and check the runs agree bitwise.

The model: token embedding, a stack of pre-norm MoE blocks (routed SwiGLU experts plus a
shared expert, expert-parallel over all ranks), a final norm and an LM head. The data:
sequences of a fixed random Markov chain, drawn per (step, rank) from seeded generators, so
the loss has something to learn and every run sees the same batches.

Run A uses the default batching; run B uses a small minibatch and a ring of one
macrobatch, so its backward replays most of the forward. The contract says that cannot
change a bit: the demo checks the loss curves and every final weight for equality.

On a machine with a GPU it trains there (one rank per GPU under torchrun); otherwise it
spawns two CPU processes that talk over gloo.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import MoKConfig
from .layer import MoELayer
from .progress import progress_bar

# The loss falls by 0.5 nats within 10 steps at seeds 0, 1 and 2 (measured on the CPU), by
# 0.03-0.15 in 3 steps, about the step-to-step noise: a shorter run is judged on its bits alone.
LEARNING_STEPS = 20
LEARNING_NATS = 0.5


@dataclass(frozen=True)
class DemoShape:
    vocab: int = 64
    hidden: int = 64
    layers: int = 2
    experts: int = 8
    topk: int = 2
    inner: int = 64
    shared_inner: int = 64
    batch: int = 8  # sequences per rank and step
    seq_len: int = 32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, device: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TinyMoELM(nn.Module):
    def __init__(self, shape: DemoShape, config: MoKConfig, group: Any, device: torch.device) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.hidden, device=device)
        self.norms = nn.ModuleList(RMSNorm(shape.hidden, device) for _ in range(shape.layers))
        self.moes = nn.ModuleList(
            MoELayer(
                shape.hidden,
                shape.inner,
                shape.experts,
                shape.topk,
                shape.shared_inner,
                group=group,
                config=config,
                max_tokens=shape.batch * shape.seq_len,
                device=device,
            )
            for _ in range(shape.layers)
        )
        self.final_norm = RMSNorm(shape.hidden, device)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes, strict=True):
            h = h + moe(norm(h))
        return self.head(self.final_norm(h))

    def is_expert_param(self, name: str) -> bool:
        """Routed-expert weights live on one rank each; everything else is replicated."""
        return name.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")


def markov_chain(vocab: int, seed: int) -> torch.Tensor:
    """A transition matrix with four likely successors per token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g)
    logits.scatter_(1, torch.randint(0, vocab, (vocab, 4), generator=g), 4.0)
    return torch.softmax(logits, dim=-1)


def batch(chain: torch.Tensor, shape: DemoShape, seed: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((seed, step, rank)) & 0x7FFFFFFF)
    tokens = torch.empty(shape.batch, shape.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, shape.vocab, (shape.batch,), generator=g)
    for i in range(shape.seq_len):
        tokens[:, i + 1] = torch.multinomial(chain[tokens[:, i]], 1, generator=g)[:, 0]
    return tokens


@dataclass
class RunResult:
    losses: list[float]
    weights: dict[str, torch.Tensor]  # this rank's final parameters
    tokens_per_s: float


def train(
    shape: DemoShape,
    config: MoKConfig,
    *,
    steps: int,
    seed: int,
    group: Any,
    device: torch.device,
    label: str,
    show_progress: bool,
) -> RunResult:
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    torch.manual_seed(seed)
    model = TinyMoELM(shape, config, group, device)
    # Replicated weights are equal on every rank (same seed); each rank's experts get a stream of their own.
    torch.manual_seed(seed + 1 + rank)
    for moe in model.moes:
        assert isinstance(moe, MoELayer)
        for p in moe.routed_weights:
            nn.init.uniform_(p, -(p.shape[-1] ** -0.5), p.shape[-1] ** -0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    chain = markov_chain(shape.vocab, seed)
    global_tokens = shape.batch * shape.seq_len * world
    losses: list[float] = []
    progress = None
    if show_progress:
        progress = progress_bar(steps, label, unit="step", file=sys.stdout)
    start = time.perf_counter()
    for step in range(steps):
        tokens = batch(chain, shape, seed, step, rank).to(device)
        logits = model(tokens[:, :-1])
        # Sum over local tokens over the global count: the ranks' losses add up to the mean.
        loss = (
            F.cross_entropy(logits.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1), reduction="sum") / global_tokens
        )
        loss.backward()
        total = loss.detach().clone()
        if world > 1:
            for name, p in model.named_parameters():
                if not model.is_expert_param(name) and p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
            dist.all_reduce(total, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
        if progress is not None:
            elapsed = time.perf_counter() - start
            progress.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{global_tokens * (step + 1) / elapsed:,.0f}")
            progress.update()
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.close()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return RunResult(losses, weights, global_tokens * steps / elapsed)


def _same_weights_on_all_ranks(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], group: Any) -> bool:
    """Every parameter of run A equals run B's bitwise, on every rank."""
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    flag = torch.tensor([0 if same else 1], device=next(iter(a.values())).device)
    if group is not None:
        dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0


def run_demo(args: argparse.Namespace, group: Any, device: torch.device) -> bool:
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    shape = DemoShape()
    lead = rank == 0
    if lead:
        print(
            f"mok demo: {shape.layers} MoE layers, {shape.experts} experts (top-{shape.topk}) + shared expert, "
            f"H={shape.hidden}, {world} rank(s) on {device.type}, {args.steps} steps, "
            f"{shape.batch * shape.seq_len} tokens per rank and step",
            flush=True,
        )
    # On a GPU the expert segments start at multiples of 64, so the backward runs mok-bf16's
    # kernels too (their weight gradients take 64-row blocks; with less alignment the routed
    # experts' backward falls back to the slow reference arithmetic). On the CPU smaller
    # alignments keep the padding rows few.
    align_a, align_b = (64, 64) if device.type == "cuda" else (16, 8)
    run_a = MoKConfig(backend=args.backend, expert_alignment=align_a)
    run_b = MoKConfig(backend=args.backend, expert_alignment=align_b, minibatch_size=128, macrobatch_size=256)
    a = train(
        shape, run_a, steps=args.steps, seed=args.seed, group=group, device=device, label="run A", show_progress=lead
    )
    b = train(
        shape,
        run_b,
        steps=args.steps,
        seed=args.seed,
        group=group,
        device=device,
        label="run B (ring + replay)",
        show_progress=lead,
    )
    same_losses = a.losses == b.losses
    same_weights = _same_weights_on_all_ranks(a.weights, b.weights, group)
    if lead:
        print(f"loss: {a.losses[0]:.4f} -> {a.losses[-1]:.4f} (chance level {math.log(shape.vocab):.4f})")
        print(f"throughput: run A {a.tokens_per_s:,.0f} tokens/s, run B {b.tokens_per_s:,.0f} tokens/s")
        print("run B used minibatch 128 and a 256-row ring (backward replays the forward); run A did not.")
        print(f"loss curves bitwise identical: {'yes' if same_losses else 'NO'} ({len(a.losses)} steps)")
        print(f"final weights bitwise identical on every rank: {'yes' if same_weights else 'NO'}")
    return same_losses and same_weights and _learned(a.losses, show=lead)


def _learned(losses: list[float], *, show: bool) -> bool:
    """Finite losses, and over LEARNING_STEPS steps or more, a fall of LEARNING_NATS."""
    if not all(math.isfinite(loss) for loss in losses):
        if show:
            print("the loss is not finite: training is broken")
        return False
    if len(losses) < LEARNING_STEPS:
        if show:
            print(
                f"learning not judged: {len(losses)} steps are too few (the loss must fall by "
                f"{LEARNING_NATS} nats over {LEARNING_STEPS} steps or more); the bitwise checks above still count"
            )
        return True
    if losses[-1] < losses[0] - LEARNING_NATS:
        return True
    if show:
        print(f"the loss did not fall by {LEARNING_NATS} nats in {len(losses)} steps: training is broken")
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        results[rank] = run_demo(args, dist.group.WORLD, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=200,
        help=f"training steps of each run (the loss must fall by {LEARNING_NATS} nats when >= {LEARNING_STEPS})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument(
        "--ranks",
        type=_positive_int,
        default=2,
        help=f"CPU processes when there is no GPU; must divide the {DemoShape.experts} experts",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if there is a GPU")
    p.add_argument("--backend", default="auto", help="MoKConfig.backend")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    # Checked before any process starts: a count that does not divide the experts would fail
    # in every rank's MoELayer, in tracebacks from each process.
    if "WORLD_SIZE" in os.environ:
        world, what = int(os.environ["WORLD_SIZE"]), "torchrun's WORLD_SIZE"
    elif use_cuda:
        world, what = 1, "one GPU"
    else:
        world, what = args.ranks, "--ranks"
    experts = DemoShape.experts
    if experts % world:
        fits = ", ".join(str(r) for r in range(1, experts + 1) if experts % r == 0)
        p.error(f"{what} {world}: the {experts} experts must divide evenly among the ranks (use {fits})")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)  # a non-deterministic torch op fails loudly here

    if "WORLD_SIZE" in os.environ:  # under torchrun: one rank per process
        local = int(os.environ.get("LOCAL_RANK", 0))
        if use_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        try:
            device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
            ok = run_demo(args, dist.group.WORLD if dist.get_world_size() > 1 else None, device)
        finally:
            dist.destroy_process_group()
        return 0 if ok else 1
    if use_cuda:
        return 0 if run_demo(args, None, torch.device("cuda", torch.cuda.current_device())) else 1
    import torch.multiprocessing as mp

    # Forked where the platform can (the CPU ranks need no CUDA, and nothing here has started a
    # thread pool yet): a fresh interpreter per rank would import torch again, seconds each.
    start = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    results = mp.get_context(start).Manager().dict()
    mp.start_processes(
        _cpu_worker, args=(args.ranks, _free_port(), args, results), nprocs=args.ranks, join=True, start_method=start
    )
    return 0 if all(results.get(r, False) for r in range(args.ranks)) else 1


if __name__ == "__main__":
    sys.exit(main())
