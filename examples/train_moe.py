"""Train a small MoE transformer with data + expert parallelism, checkpoint, and resume.

    torchrun --standalone --nproc-per-node=4 examples/train_moe.py --ep 2 --steps 200 --ckpt-dir /tmp/ckpt
    torchrun ... --ckpt-dir /tmp/ckpt --resume          # continues bitwise where it stopped

Ranks form expert-parallel groups of `--ep` consecutive ranks; each group holds every expert
once (El = E / ep per rank). All ranks are data parallel: each reads its own batches. Dense
parameters are averaged over all ranks; expert parameters over the ranks that hold the same
experts (one per EP group). With mok, a run that stops and resumes from a checkpoint
continues with bitwise the same losses and weights as a run that never stopped.

The data is synthetic (an order-2 Markov chain, drawn per step and rank from seeded
generators), so the example needs no download. Each rank takes its own GPU; with fewer GPUs than
ranks on a machine, every rank runs on the CPU (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mok_torch as mok


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, args: argparse.Namespace, ep_group: object) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(args.dim), RMSNorm(args.dim)
        self.attn = Attention(args.dim, args.heads)
        cfg = mok.MoKConfig(backend=args.backend, expert_alignment=16)
        self.moe = mok.MoELayer(
            args.dim,
            args.inner,
            args.experts,
            args.topk,
            shared_intermediate_size=args.inner,
            group=ep_group,
            config=cfg,
            max_tokens=args.batch * args.seq_len,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoETransformer(nn.Module):
    def __init__(self, args: argparse.Namespace, ep_group: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.blocks = nn.ModuleList(Block(args, ep_group) for _ in range(args.layers))
        self.norm = RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def is_expert_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")


def make_batch(args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    """[batch, seq_len + 1] tokens of an order-2 Markov chain (same chain on every rank)."""
    chain = torch.Generator().manual_seed(args.seed)
    table = torch.randint(0, args.vocab, (args.vocab, args.vocab), generator=chain)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    noise = torch.rand(args.batch, args.seq_len + 1, generator=g) < 0.1
    for i in range(2, args.seq_len + 1):
        follow = table[tokens[:, i - 2], tokens[:, i - 1]]
        tokens[:, i] = torch.where(noise[:, i], tokens[:, i], follow)
    return tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all ranks)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stop-after", type=int, default=None, help="stop (after checkpointing) at this step")
    p.add_argument("--ckpt-dir", type=Path, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log-json", type=Path, default=None, help="rank 0 writes the loss per step here")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--inner", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # One GPU per local rank, or every rank on the CPU (a machine with fewer GPUs than local
    # ranks runs on the CPU rather than failing; every rank sees the same counts).
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep or world
    if world % ep or args.experts % ep:
        raise ValueError(f"--ep ({ep}) must divide the world size ({world}) and --experts ({args.experts})")
    # Every rank creates every group, in the same order (a torch.distributed rule).
    ep_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    expert_dp_groups = [dist.new_group(list(range(i, world, ep))) for i in range(ep)]
    ep_group = ep_groups[rank // ep] if ep > 1 else None
    expert_dp = expert_dp_groups[rank % ep]
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    torch.manual_seed(args.seed)  # dense weights: equal on every rank
    model = MoETransformer(args, ep_group).to(device)
    torch.manual_seed(args.seed + 1 + rank % ep)  # experts: one stream per expert shard
    for module in model.modules():
        if isinstance(module, mok.MoELayer):
            module.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    start, losses = 0, []
    ckpt = None if args.ckpt_dir is None else args.ckpt_dir / f"rank{rank}.pt"
    if args.resume:
        if ckpt is None or not ckpt.exists():
            raise ValueError(f"--resume: no checkpoint at {ckpt}")
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start, losses = state["step"], state["losses"]

    global_tokens = args.batch * args.seq_len * world
    stop = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
    for step in range(start, stop):
        tokens = make_batch(args, step, rank).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1), reduction="sum")
        (loss / global_tokens).backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if not is_expert_param(name):
                dist.all_reduce(p.grad)  # dense: data parallel over every rank
            elif world > ep:
                dist.all_reduce(p.grad, group=expert_dp)  # experts: over the replicas of this shard
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach() / global_tokens
        dist.all_reduce(total)
        losses.append(total.item())
        if rank == 0 and (step % 20 == 0 or step == stop - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)

    if ckpt is not None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": stop, "losses": losses}, ckpt)
    if rank == 0 and args.log_json is not None:
        args.log_json.write_text(json.dumps({"losses": losses, "step": stop}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
