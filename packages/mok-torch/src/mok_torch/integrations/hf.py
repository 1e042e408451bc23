"""Hugging Face transformers (v5): mok as an experts implementation, and a mok sparse MoE block.

Shape letters: docs/design.md §1.

Both ways in take the standard v5 experts (classes decorated `@use_experts_implementation`):
`gate_up_proj [E, 2I, H]` (the I gate rows, then the I up rows), `down_proj [E, H, I]`, SiLU
on the gate, no biases; the transposed and interleaved variants of that layout work too.

    from mok_torch.integrations import hf

    # 1. The experts run in mok; the routing stays the model's own.
    hf.register()  # adds "mok" to transformers' ExpertsInterface
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok")
    model.set_experts_implementation("mok")  # or switch a loaded model
    hf.configure_experts(model, config=MoKConfig(...), group=ep_group)  # optional

    # 2. Router and experts in mok: every sparse MoE block becomes a MoKSparseMoeBlock.
    hf.convert_model(model, config=MoKConfig(...), group=ep_group)

Both keep every parameter in its module under its name, so checkpoints load and save through
the standard HF weights. Only (2) is deterministic end to end: the HF routers' `torch.topk`
may break ties differently on different devices, mok's router gives them to the lower id.

With an expert-parallel `group` of R ranks, rank r computes experts [r*El, (r+1)*El). A model
holding all E experts on every rank (replicated) uses views of its own El. Rank r's gradient
of an expert it owns is the sum over every rank's tokens, and zero for the experts it does not
own, so averaging gradients over the group (DDP) gives each expert the gradient plain data
parallelism would. A model already sharded (El experts per module) is used as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..autograd import moe
from ..config import MoKConfig, default_config
from ..layer import route
from ..workspace import group_rank_and_size

try:
    import transformers
    from transformers import activations as hf_activations
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mok_torch.integrations.hf needs Hugging Face transformers v5: pip install 'mok-torch[hf]'"
    ) from exc

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"mok_torch.integrations.hf needs transformers >= 5 (the 3-D experts layout), found {transformers.__version__}"
    )

EXPERTS_IMPLEMENTATION = "mok"

# Blocks whose forward is exactly: logits = gate(x); softmax; top-k; renormalise when
# `gate.norm_topk_prob` (absent: always); experts. No shared expert, nothing else.
CONVERTIBLE_BLOCKS = (
    "Qwen3MoeSparseMoeBlock",
    "Qwen3VLMoeTextSparseMoeBlock",
    "OlmoeSparseMoeBlock",
    "MixtralSparseMoeBlock",
)

Weights3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _is_silu(act: object) -> bool:
    hf_silu = getattr(hf_activations, "SiLUActivation", nn.SiLU)
    return act is F.silu or type(act) in (nn.SiLU, hf_silu)


def _check_config(config: MoKConfig | None) -> MoKConfig:
    cfg = default_config() if config is None else config
    if not isinstance(cfg, MoKConfig):
        raise TypeError(f"config must be a MoKConfig, got {type(cfg).__name__}")
    if cfg.swiglu_limit is not None:
        raise ValueError(
            f"config.swiglu_limit ({cfg.swiglu_limit}) would clamp the SwiGLU; the HF experts mok replaces do not"
        )
    return cfg


def check_experts(experts: nn.Module, where: str = "") -> None:
    """Raise ValueError, naming the module and why, unless mok computes exactly what `experts` does.

    mok runs `down(silu(gate(x)) * up(x))` per expert, without biases.
    """
    name = f"{where} ({type(experts).__name__})" if where else type(experts).__name__
    gate_up, down = _tensor(experts, "gate_up_proj"), _tensor(experts, "down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{name}: mok needs the v5 experts layout, 3-D `gate_up_proj` and `down_proj` parameters")
    if not getattr(experts, "has_gate", True):
        raise ValueError(f"{name}: mok runs gated (SwiGLU) experts; these have no gate projection (has_gate=False)")
    biases = [b for b in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias") if _tensor(experts, b) is not None]
    if biases or getattr(experts, "has_bias", False):
        raise ValueError(
            f"{name}: mok runs experts without biases; these have biases ({', '.join(biases) or 'has_bias=True'})"
        )
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{name}: mok has no norm after each expert; these have one (has_post_expert_norm=True)")
    gating = getattr(type(experts), "_apply_gate", None)
    if gating is not None and getattr(gating, "__module__", None) != "transformers.integrations.moe":
        raise ValueError(
            f"{name}: mok runs silu(gate) * up; these experts gate their own way ({type(experts).__name__}._apply_gate)"
        )
    act = getattr(experts, "act_fn", None)
    if not _is_silu(act):
        hidden_act = getattr(getattr(experts, "config", None), "hidden_act", None)
        said = f" (hidden_act={hidden_act!r})" if isinstance(hidden_act, str) else ""
        raise ValueError(
            f"{name}: mok runs SwiGLU experts (SiLU on the gate); these use {type(act).__name__}{said}, not SiLU"
        )
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(
            f"{name}: transformers' own expert parallelism is on; mok does its own: load the model without it and pass "
            "group=... to mok"
        )
    transposed = bool(getattr(experts, "is_transposed", False))
    E, two_I, H = (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1]) if transposed else tuple(gate_up.shape)
    want_down = (E, two_I // 2, H) if transposed else (E, H, two_I // 2)
    if two_I % 2 or tuple(down.shape) != want_down:
        raise ValueError(
            f"{name}: gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not an [E, 2I, H] / "
            f"[E, H, I] pair{' (transposed)' if transposed else ''}"
        )


def expert_weights(experts: nn.Module, group: Any = None) -> Weights3:
    """(Wg [El, I, H], Wu [El, I, H], Wd [El, H, I]) of this rank's experts: views of the module's weights.

    Views, so gradients flow back to `gate_up_proj` and `down_proj`; mok makes the contiguous bf16
    copies it computes with (the gate and up halves are strided, so they are copied per call).
    """
    check_experts(experts)
    gate_up: torch.Tensor = experts.gate_up_proj  # type: ignore[assignment]
    down: torch.Tensor = experts.down_proj  # type: ignore[assignment]
    if getattr(experts, "is_transposed", False):  # stored [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    I = gate_up.shape[1] // 2
    if getattr(experts, "is_concatenated", True):  # all gate rows, then all up rows
        wg, wu = gate_up[:, :I], gate_up[:, I:]
    else:  # gate and up rows alternate
        wg, wu = gate_up[:, 0::2], gate_up[:, 1::2]
    rank, world = group_rank_and_size(group)
    held = gate_up.shape[0]
    total = getattr(experts, "num_experts", held)
    if world == 1 or held * world == total:
        return wg, wu, down
    if held != total or total % world:
        raise ValueError(
            f"{type(experts).__name__} holds {held} of {total} experts: with a group of {world} ranks it must hold all "
            f"of them (a multiple of {world}) or this rank's {total // world}"
        )
    local = slice(rank * (total // world), (rank + 1) * (total // world))
    return wg[local], wu[local], down[local]


def run_experts(
    experts: nn.Module,
    x_TH: torch.Tensor,
    top_experts_TK: torch.Tensor,
    router_weights_TK: torch.Tensor,
    config: MoKConfig | None = None,
    group: Any = None,
) -> torch.Tensor:
    """y [T, H] = sum_k router_weights[t,k] * E_{top_experts[t,k]}(x[t]) with the weights of `experts`, by mok."""
    return moe(
        x_TH,
        top_experts_TK,
        router_weights_TK,
        expert_weights(experts, group),
        config=_check_config(config),
        group=group,
    )


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The "mok" entry of transformers' ExpertsInterface: the experts of `self`, run by mok.

    hidden_states [T, H], top_k_index [T, K] (global expert ids), top_k_weights [T, K]: the
    model's routing. y [T, H] has hidden_states' dtype. The MoKConfig and the group are the
    ones `configure_experts` set on the module (default: MoKConfig(), one rank).
    """
    config = getattr(self, "mok_config", None)
    return run_experts(self, hidden_states, top_k_index, top_k_weights, config, getattr(self, "mok_group", None))


def register() -> None:
    """Make "mok" a valid `experts_implementation` of transformers (idempotent)."""
    if ALL_EXPERTS_FUNCTIONS.get(EXPERTS_IMPLEMENTATION) is not experts_forward:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if _tensor(m, "gate_up_proj") is not None and _tensor(m, "down_proj") is not None
    ]


def configure_experts(model: nn.Module, config: MoKConfig | None = None, group: Any = None) -> nn.Module:
    """Set the MoKConfig and expert-parallel group the "mok" experts implementation uses in `model`.

    Checks every experts module now (ValueError naming the first that mok cannot run) rather than
    at the first forward. Returns `model`.
    """
    cfg = _check_config(config)
    found = _experts_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no experts module (3-D gate_up_proj and down_proj)")
    for name, experts in found:
        check_experts(experts, name)
        expert_weights(experts, group)  # checks the layout against the group size
    for _, experts in found:
        experts.mok_config = cfg  # type: ignore[assignment]  # plain attributes, read by experts_forward
        experts.mok_group = group
    return model


class MoKSparseMoeBlock(nn.Module):
    """A v5 Qwen3-MoE sparse block whose router and experts run in mok.

    The same submodules and parameters as `Qwen3MoeSparseMoeBlock`, so `state_dict()` does not
    change: `gate` (the router, `gate.weight [E, H]`, `gate.top_k`, `gate.norm_topk_prob`) and
    `experts` (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`). The routing is
    Qwen3's — softmax in fp32, top-k, renormalise when `norm_topk_prob` — with mok's stable top-k
    (ties go to the lower expert id on every device); the router weights stay fp32.

    forward(hidden_states [..., H]) -> [..., H], one tensor as in v5. The logits come out of
    `gate(...)`, so `output_router_logits` and the load-balancing loss see them.

    Args:
        config: the HF model config (Qwen3MoeConfig) the router and experts are built from.
        mok_config: MoKConfig (default MoKConfig()).
        group: expert-parallel process group (None = one rank).
    """

    gate: nn.Module
    experts: nn.Module

    def __init__(self, config: Any, mok_config: MoKConfig | None = None, group: Any = None) -> None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

        super().__init__()
        # Qwen3's registration order (experts, then gate), so parameters() and state_dict() list alike.
        self._attach(Qwen3MoeTopKRouter(config), Qwen3MoeExperts(config), mok_config, group, experts_first=True)

    @classmethod
    def from_block(cls, block: nn.Module, mok_config: MoKConfig | None = None, group: Any = None) -> MoKSparseMoeBlock:
        """A MoKSparseMoeBlock holding `block.gate` and `block.experts` themselves (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        names = list(block._modules)
        experts_first = "experts" in names and "gate" in names and names.index("experts") < names.index("gate")
        new._attach(getattr(block, "gate", None), getattr(block, "experts", None), mok_config, group, experts_first)
        new.train(block.training)
        return new

    def _attach(
        self, gate: object, experts: object, mok_config: MoKConfig | None, group: Any, experts_first: bool
    ) -> None:
        if not isinstance(gate, nn.Module) or _tensor(gate, "weight") is None:
            raise ValueError("the block's `gate` must be a router module with a `weight` [E, H]")
        if not isinstance(experts, nn.Module):
            raise ValueError("the block's `experts` must be an experts module")
        top_k = getattr(gate, "top_k", None)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"the block's gate must have a positive int `top_k`, got {top_k!r}")
        self.mok_config = _check_config(mok_config)
        self.group = group
        expert_weights(experts, group)  # checks the experts and their layout now
        if experts_first:
            self.experts, self.gate = experts, gate
        else:
            self.gate, self.experts = gate, experts
        self.top_k = top_k
        self.norm_topk_prob = bool(getattr(gate, "norm_topk_prob", True))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits_TE = self.gate(x_TH)[0]  # through the module: transformers' output recorders hook it
        top_TK, weights_TK = route(logits_TE, self.top_k, norm_topk_prob=self.norm_topk_prob)
        y_TH = moe(
            x_TH,
            top_TK,
            weights_TK,
            expert_weights(self.experts, self.group),
            config=self.mok_config,
            group=self.group,
        )
        return y_TH.reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, backend={self.mok_config.backend!r}"


def convert_model(model: nn.Module, config: MoKConfig | None = None, group: Any = None) -> nn.Module:
    """Replace, in place, every sparse MoE block of a kind in CONVERTIBLE_BLOCKS by a MoKSparseMoeBlock.

    The new blocks hold the old `gate` and `experts` modules, so parameters (and any optimizer
    state on them), `state_dict()` keys and shapes are unchanged and `save_pretrained` writes
    the standard checkpoint. Converting again sets a new config and group. Raises ValueError,
    naming the block, if a block cannot run in mok (activation, biases, router jitter), or if
    there is no block to convert; nothing is replaced then. Returns `model`.
    """
    cfg = _check_config(config)
    targets: list[tuple[nn.Module, str, nn.Module]] = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if not (isinstance(child, MoKSparseMoeBlock) or type(child).__name__ in CONVERTIBLE_BLOCKS):
                continue
            where = f"{parent_name}.{child_name}" if parent_name else child_name
            jitter = getattr(child, "jitter_noise", 0.0)
            if isinstance(jitter, (int, float)) and jitter > 0:
                raise ValueError(f"{where} ({type(child).__name__}): mok's router has no jitter noise ({jitter})")
            experts = getattr(child, "experts", None)
            if not isinstance(experts, nn.Module):
                raise ValueError(f"{where} ({type(child).__name__}) has no `experts` module")
            check_experts(experts, f"{where}.experts")
            targets.append((parent, child_name, child))
    if not targets:
        known = ", ".join(CONVERTIBLE_BLOCKS)
        raise ValueError(f"{type(model).__name__} has no sparse MoE block mok can replace (it replaces {known})")
    new_blocks = [MoKSparseMoeBlock.from_block(block, cfg, group) for _, _, block in targets]
    for (parent, child_name, _), new in zip(targets, new_blocks, strict=True):
        setattr(parent, child_name, new)
    return model


__all__ = [
    "CONVERTIBLE_BLOCKS",
    "EXPERTS_IMPLEMENTATION",
    "MoKSparseMoeBlock",
    "check_experts",
    "configure_experts",
    "convert_model",
    "expert_weights",
    "experts_forward",
    "register",
    "run_experts",
]
