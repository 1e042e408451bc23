"""The backend registry: the requested backend runs, missing ones say why, entry points load."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import BACKEND, DEVICE, config, run_functional

import mok_torch as mok
from mok_torch.backends import BackendRegistry, ReferenceBackend
from mok_torch.testing import make_inputs


def test_requested_backend_ran():
    inp = make_inputs(6, 16, 8, 4, 2, seed=0)
    run_functional(inp, config(expert_alignment=8))  # asserts ctx.backend == BACKEND inside
    assert mok.resolve_backend(config(), DEVICE).name == BACKEND


def test_reference_is_always_available():
    assert "reference" in mok.available_backends("bf16", "cpu")
    assert mok.resolve_backend(mok.MoKConfig(backend="reference"), "cpu").name == "reference"


def test_auto_picks_an_available_backend():
    name = mok.resolve_backend(mok.MoKConfig(), DEVICE).name
    assert name in mok.available_backends("bf16", DEVICE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_missing_backend_says_why():
    with pytest.raises(ValueError, match=r"config\.backend='cuda'"):
        mok.resolve_backend(mok.MoKConfig(backend="cuda"), "cpu")


def test_backend_on_the_wrong_device_says_why():
    if "cpu" not in mok.backends.registered_backends():
        pytest.skip("the native cpu backend is not installed (mok-core missing)")
    for precision in ("bf16", "mxfp8"):
        with pytest.raises(ValueError, match="'cpu' backend runs on cpu tensors, not cuda"):
            mok.resolve_backend(mok.MoKConfig(backend="cpu", precision=precision), "cuda")
    # the reference backend runs both precisions anywhere
    assert mok.resolve_backend(mok.MoKConfig(backend="reference", precision="mxfp8"), "cpu").name == "reference"


class _FakeEntryPoint:
    def __init__(self, name, obj):
        self.name, self.value, self._obj = name, f"fake:{name}", obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


class _EchoBackend(ReferenceBackend):
    name = "echo"


def test_entry_points_register_backends_and_packages():
    info = {"package": "mok-fake", "version": "9", "devices": ["cpu"]}
    eps = [
        _FakeEntryPoint("echo", _EchoBackend()),
        _FakeEntryPoint("fake", lambda: info),
        _FakeEntryPoint("broken", ImportError("no such module")),
        _FakeEntryPoint("odd", lambda: 42),
    ]
    calls = []
    registry = BackendRegistry([ReferenceBackend()], entry_points=lambda: calls.append(1) or eps)
    assert calls == []  # lazy: nothing is read before first use
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert set(registry.backends) == {"reference", "echo"}
    assert registry.packages == {"fake": info}
    assert "ImportError" in registry.errors["broken"] and "neither a backend" in registry.errors["odd"]
    assert len(caught) == 2
    registry.backends  # noqa: B018 - second use reads nothing again
    assert calls == [1]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(_EchoBackend())
    with pytest.raises(TypeError, match="Backend protocol"):
        registry.register(object())


def test_installed_compiled_packages_describe_themselves():
    for name, info in mok.compiled_packages().items():
        assert {"package", "version", "devices", "build"} <= set(info), name
        assert "cpu" in info["devices"]


def test_check_errors_asks_every_backend_that_has_the_hook(monkeypatch):
    """mok.check_errors reaches the backends through their `check_errors` hook, not their state."""
    import mok_torch.backends as backends

    seen = []

    class Recorder(ReferenceBackend):
        name = "recorder"

        def check_errors(self, ws):
            seen.append(ws)
            raise RuntimeError("recorded earlier")

    ws = mok.get_workspace(config(), None, device="cpu", max_tokens=4, hidden_size=8, topk=1, num_experts=2)
    monkeypatch.setattr(backends, "registered_backends", lambda: {"reference": ReferenceBackend(), "r": Recorder()})
    with pytest.raises(RuntimeError, match="recorded earlier"):
        mok.check_errors(ws)
    assert seen == [ws]
