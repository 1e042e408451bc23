"""The benchmark's layer shapes (docs/benchmarks.md "Shapes"), per GPU, resolved for an EP size.

Shape letters: docs/design.md §1.

Two families:

- seed slices: the seed's EP-64 runs cut to one GPU's share. Each GPU keeps E_model / 64
  local experts and 2,048 tokens, so E = R * E_model / 64 grows with R; Is = I. At R = 1
  three of them have fewer experts than K and are skipped (they cannot be routed).
- public models: full expert counts, 8,192 tokens per GPU (SonicMoE's fine-grained 7B: 24,576);
  E must be divisible by R. `deepseek-v3-e32` is DeepSeek-V3 cut to E/8 = 32 experts without its
  shared expert: the coarse shape of the one-GPU comparison with SonicMoE (which has none).

`--shapes` also takes custom shapes, `H=..,I=..,E=..,K=..,T=..[,Is=..]` (E in all), and
the tiny `quick` shapes the CPU smoke run uses.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

SEED_EP = 64  # the seed's expert-parallel size: its slices keep E_model / 64 experts per GPU
SEED_TOKENS = 2048
PUBLIC_TOKENS = 8192


@dataclass(frozen=True)
class SeedSlice:
    name: str
    model_experts: int
    hidden: int
    inner: int
    topk: int

    @property
    def local_experts(self) -> int:
        return self.model_experts // SEED_EP


@dataclass(frozen=True)
class PublicModel:
    name: str
    experts: int
    hidden: int
    inner: int
    topk: int
    shared_inner: int
    tokens: int = PUBLIC_TOKENS


SEED_SLICES = (
    SeedSlice("kimi-k2.7-code", 384, 7168, 2048, 8),
    SeedSlice("glm-5.2", 256, 6144, 2048, 8),
    SeedSlice("qwen3.5-397b-a17b", 512, 4096, 1024, 10),
    SeedSlice("deepseek-v4-pro", 384, 7168, 3072, 6),
)
PUBLIC_MODELS = (
    PublicModel("qwen3-30b-a3b", 128, 2048, 768, 8, 0),
    PublicModel("deepseek-v3", 256, 7168, 2048, 8, 2048),
    PublicModel("mixtral-8x7b", 8, 4096, 14336, 2, 0),
    PublicModel("sonic-7b", 128, 1536, 256, 8, 0, tokens=24576),
    PublicModel("deepseek-v3-e32", 32, 7168, 2048, 8, 0),
)
# The shapes of the one-GPU comparison with SonicMoE (docs/benchmarks.md): `--shapes sonic`.
SONIC_SHAPES = ("sonic-7b", "qwen3-30b-a3b", "deepseek-v3-e32", "mixtral-8x7b")


@dataclass(frozen=True)
class Shape:
    """One layer shape as every rank of an R-rank run sees it.

    `skip` says why the shape cannot run at this R (None when it can).
    """

    name: str
    family: str  # "seed", "public", "custom" or "quick"
    hidden: int
    inner: int
    experts: int  # E in all
    topk: int
    tokens: int  # T per rank
    shared_inner: int
    world: int
    skip: str | None = None

    @property
    def local_experts(self) -> int:
        return self.experts // self.world

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "family": self.family,
            "H": self.hidden,
            "I": self.inner,
            "E": self.experts,
            "El": self.local_experts,
            "K": self.topk,
            "T": self.tokens,
            "Is": self.shared_inner,
        }


def _checked(shape: Shape) -> Shape:
    why = None
    if shape.experts % shape.world:
        why = f"E={shape.experts} is not divisible by the {shape.world} ranks"
    elif shape.experts < shape.topk:
        why = f"only {shape.experts} experts at EP {shape.world}, fewer than K={shape.topk}"
    if why is None:
        return shape
    return dataclasses.replace(shape, skip=why)


def seed_shape(s: SeedSlice, world: int) -> Shape:
    E = world * s.local_experts
    return _checked(Shape(s.name, "seed", s.hidden, s.inner, E, s.topk, SEED_TOKENS, s.inner, world))


def public_shape(m: PublicModel, world: int) -> Shape:
    return _checked(Shape(m.name, "public", m.hidden, m.inner, m.experts, m.topk, m.tokens, m.shared_inner, world))


def quick_shapes(world: int) -> list[Shape]:
    """Tiny shapes the reference backend runs in a blink (the CPU smoke run)."""
    E = max(8, 2 * world)
    return [
        _checked(Shape("quick", "quick", 64, 32, E, 2, 64, 0, world)),
        _checked(Shape("quick-shared", "quick", 64, 32, E, 2, 64, 32, world)),
    ]


_CUSTOM_KEYS = {"H": "hidden", "I": "inner", "E": "experts", "K": "topk", "T": "tokens", "Is": "shared_inner"}


def parse_custom(spec: str, world: int) -> Shape:
    """`H=..,I=..,E=..,K=..,T=..[,Is=..]` (E counts every rank's experts)."""
    values: dict[str, int] = {"shared_inner": 0}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(H|I|E|K|T|Is)\s*=\s*(\d+)\s*", part)
        if m is None:
            raise ValueError(f"custom shape {spec!r}: cannot read {part!r} (want KEY=int, KEY in H, I, E, K, T, Is)")
        values[_CUSTOM_KEYS[m.group(1)]] = int(m.group(2))
    missing = [k for k, v in _CUSTOM_KEYS.items() if v not in values]
    if missing:
        raise ValueError(f"custom shape {spec!r}: missing {', '.join(missing)}")
    for key, field in _CUSTOM_KEYS.items():
        if values[field] < (0 if key == "Is" else 1):
            raise ValueError(f"custom shape {spec!r}: {key} must be >= {0 if key == 'Is' else 1}")
    v = values
    name = f"H{v['hidden']}-I{v['inner']}-E{v['experts']}-K{v['topk']}-T{v['tokens']}"
    if v["shared_inner"]:
        name += f"-Is{v['shared_inner']}"
    return _checked(
        Shape(
            name,
            "custom",
            hidden=v["hidden"],
            inner=v["inner"],
            experts=v["experts"],
            topk=v["topk"],
            tokens=v["tokens"],
            shared_inner=v["shared_inner"],
            world=world,
        )
    )


def resolve_shapes(spec: str, world: int) -> list[Shape]:
    """The shapes `--shapes spec` names, in order, without duplicates.

    spec: comma list of names (seed slices, public models), `seed`, `public`, `all`,
    `sonic` (the SonicMoE comparison's), `quick`; `;` separates a custom shape from other
    items (`seed;H=64,I=32,E=8,K=2,T=64`).
    """
    by_name = {s.name: seed_shape(s, world) for s in SEED_SLICES}
    by_name.update({m.name: public_shape(m, world) for m in PUBLIC_MODELS})
    by_name.update({s.name: s for s in quick_shapes(world)})
    groups = {
        "seed": [seed_shape(s, world) for s in SEED_SLICES],
        "public": [public_shape(m, world) for m in PUBLIC_MODELS],
        "quick": quick_shapes(world),
    }
    groups["all"] = groups["seed"] + groups["public"]
    groups["sonic"] = [by_name[n] for n in SONIC_SHAPES]
    shapes: list[Shape] = []
    items: list[str] = []
    for piece in spec.split(";"):
        items += [piece.strip()] if "=" in piece else [p.strip() for p in piece.split(",")]
    for item in items:
        if not item:
            continue
        if "=" in item:
            found = [parse_custom(item, world)]
        elif item in groups:
            found = groups[item]
        elif item in by_name:
            found = [by_name[item]]
        else:
            known = ", ".join([*groups, *by_name])
            raise ValueError(f"unknown shape {item!r}; known: {known}, or H=..,I=..,E=..,K=..,T=..[,Is=..]")
        shapes += [s for s in found if s.name not in {t.name for t in shapes}]
    if not shapes:
        raise ValueError("--shapes names no shape")
    return shapes
