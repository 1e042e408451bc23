"""A digest of the installed build's bits: one forward + backward of mok.moe per case, every output
(y and the gradients of x, the router weights and every weight) hashed, for telling whether two
builds of a change meant to keep the bits (a kernel's schedule, its loads) kept them.

    python3 benchmarks/probes/bits_digest.py [--device cuda]

Run it under each build (tools/gpu-check's A/B loop installs them in turn) and compare the lines:
each is a case and the SHA-256 of its outputs' bytes in a fixed order. Fixed seeds; the cases
take the GPU's kernel paths (H and I multiples of 64 below H = 4096: the megakernel, the backward
in one call), awkward shapes among them (prime T, K = 1, skewed routing, a shared expert).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib

import torch

import mok_torch as mok
from mok_torch.testing import make_inputs

# (name, T, H, I, E, K, Is, routing)
CASES = (
    ("balanced", 1024, 512, 256, 16, 4, 0, "balanced"),
    ("prime-T-skewed-I768", 331, 256, 768, 8, 2, 0, "skewed"),
    ("one-token-K1", 1, 128, 128, 4, 1, 0, "balanced"),
    ("shared-expert", 200, 256, 256, 8, 2, 128, "balanced"),
)


def digest(device: torch.device, name: str, T: int, H: int, I: int, E: int, K: int, Is: int, routing: str) -> str:
    inp = make_inputs(T, H, I, E, K, Is, routing, seed=T + H).to(device)
    cfg = mok.MoKConfig(expert_alignment=128)
    leaves = [t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.router_weights_TK, *inp.routed)]
    shared = None if inp.shared is None else tuple(t.detach().clone().requires_grad_() for t in inp.shared)
    y = mok.moe(leaves[0], inp.top_experts_TK, leaves[1], tuple(leaves[2:]), shared, config=cfg, max_tokens=T)
    y.backward(inp.dy_TH.to(y.dtype))
    mok.check_errors()
    h = hashlib.sha256()
    outs = [y.detach(), *(t.grad for t in leaves), *(() if shared is None else (t.grad for t in shared))]
    for t in outs:
        assert t is not None
        host = t.detach().contiguous().cpu()
        h.update(ctypes.string_at(host.data_ptr(), host.numel() * host.element_size()))
    return f"{name:24s} {h.hexdigest()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = p.parse_args()
    dev = torch.device(ns.device)
    for case in CASES:
        print(digest(dev, *case), flush=True)


if __name__ == "__main__":
    main()
