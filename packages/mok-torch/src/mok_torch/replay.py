"""Router replay over a whole model: record every MoE layer's choice, replay it later.

    with mok.record_routing(model) as record:
        model(batch)                       # e.g. the inference or rollout pass
    with mok.replay_routing(model, record):
        loss = model(batch).loss           # the training pass routes exactly as recorded
        loss.backward()                    # the router still gets gradients through the weights

A replayed layer keeps the recorded experts and recomputes the router weights from its live
logits (as router-replay implementations for RL post-training do), so the training pass and
the recorded pass agree on every routing decision while the router keeps learning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .layer import MoELayer

RoutingRecord = dict[str, list[torch.Tensor]]


def _moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    if not layers:
        raise ValueError(f"model: {type(model).__name__} contains no mok MoELayer")
    return layers


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Records each MoE layer's `top_experts` per call: {layer name: [tensor per call]}."""
    record: RoutingRecord = {}
    handles = []
    for name, layer in _moe_layers(model).items():
        record[name] = []

        def hook(mod: nn.Module, args: object, out: object, name: str = name) -> None:
            assert isinstance(mod, MoELayer) and mod.last_top_experts is not None
            record[name].append(mod.last_top_experts.clone())

        handles.append(layer.register_forward_hook(hook))
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


@contextmanager
def replay_routing(model: nn.Module, record: RoutingRecord) -> Iterator[None]:
    """Within the block, each MoE layer routes its n-th call as recorded in its n-th entry."""
    layers = _moe_layers(model)
    missing = set(layers) - set(record)
    if missing:
        raise ValueError(f"record has no routing for layer(s) {sorted(missing)}")
    for name, layer in layers.items():
        layer._replay = list(record[name])
    try:
        yield
    finally:
        for layer in layers.values():
            layer._replay = None
