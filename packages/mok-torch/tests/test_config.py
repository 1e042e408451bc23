"""MoKConfig defaults, replace(), and the minibatch heuristic."""

from __future__ import annotations

import dataclasses

import pytest

from mok_torch.config import MoKConfig, default_minibatch_size, resolve_batching


def test_defaults_and_frozen():
    cfg = MoKConfig()
    assert (cfg.precision, cfg.backend, cfg.expert_alignment) == ("bf16", "auto", 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.precision = "mxfp8"  # type: ignore[misc]


def test_replace_validates():
    cfg = MoKConfig().replace(minibatch_size=256, macrobatch_size=1024)
    assert (cfg.minibatch_size, cfg.macrobatch_size) == (256, 1024)
    with pytest.raises(ValueError, match="multiple of minibatch_size"):
        cfg.replace(macrobatch_size=384)
    with pytest.raises(TypeError, match="no field"):
        cfg.replace(capacity=3)


def test_heuristic_fills_two_waves():
    # kimi-k2.7-code: 2I/128 = 32 and H/128 = 56 tiles per row block; 264 tiles need 9 blocks.
    assert default_minibatch_size(7168, 2048, 128, num_sms=132) == 9 * 128
    # always a multiple of the alignment
    assert default_minibatch_size(100, 30, 64, num_sms=132) % 64 == 0


def test_resolve_batching_tiles_the_ring():
    cfg = MoKConfig(expert_alignment=128, macrobatch_size=640)
    mini, macro = resolve_batching(cfg, 7168, 2048, 132)
    assert macro == 640 and macro % mini == 0 and mini % 128 == 0
    assert resolve_batching(MoKConfig(expert_alignment=8, minibatch_size=16), 64, 32, 132) == (16, None)
