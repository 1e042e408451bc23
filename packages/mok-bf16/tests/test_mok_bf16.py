"""Tests of the installed mok-bf16 package: version, build facts, backend entry point."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import mok_bf16

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
BUILD_INFO_TYPES = {
    "package": str,
    "version": str,
    "mok_core_version": str,
    "cuda": bool,
    "cuda_architectures": list,
    "cuda_compiler_version": (str, type(None)),
    "cuda_runtime_version": (str, type(None)),
    "cxx_compiler": str,
    "build_type": str,
    "backends": list,
}


def pyproject_version() -> str:
    match = re.search(r'^version\s*=\s*"([^"]+)"', PYPROJECT.read_text(), re.MULTILINE)
    assert match, f"no version in {PYPROJECT}"
    return match.group(1)


def test_version_matches_pyproject_and_metadata() -> None:
    expected = pyproject_version()
    assert mok_bf16.version() == expected
    assert mok_bf16.__version__ == expected
    assert importlib.metadata.version("mok-bf16") == expected


def test_build_info_fields_and_types() -> None:
    info = mok_bf16.build_info()
    assert set(info) == set(BUILD_INFO_TYPES)
    for key, kind in BUILD_INFO_TYPES.items():
        assert isinstance(info[key], kind), (key, info[key])
    assert info["package"] == "mok-bf16"
    assert info["version"] == mok_bf16.__version__
    assert info["cxx_compiler"].strip()
    assert info["build_type"] in {"Release", "Debug", "RelWithDebInfo", "MinSizeRel"}
    if info["cuda"]:
        assert info["backends"] == ["cpu", "cuda"]
        assert info["cuda_architectures"], "a CUDA build names its architectures"
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?", info["cuda_compiler_version"])
        assert re.fullmatch(r"\d+\.\d+", info["cuda_runtime_version"])
    else:
        assert info["backends"] == ["cpu"]
        assert info["cuda_architectures"] == []
        assert info["cuda_compiler_version"] is None
        assert info["cuda_runtime_version"] is None


def test_compiled_against_a_compatible_mok_core() -> None:
    """The mok-core headers it was built with share the installed mok-core's minor release."""
    compiled_against = mok_bf16.build_info()["mok_core_version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", compiled_against)
    installed = importlib.metadata.version("mok-core")
    assert compiled_against.split(".")[:2] == installed.split(".")[:2]


def test_backend_info_shape() -> None:
    info = mok_bf16.backend_info()
    assert info == {
        "package": "mok-bf16",
        "version": mok_bf16.__version__,
        "role": "precision",
        "precision": "bf16",
        "devices": mok_bf16.build_info()["backends"],
        "build": mok_bf16.build_info(),
    }


def test_entry_point_present() -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="mok.backends") if ep.name == "bf16"]
    assert entry_point.value == "mok_bf16:backend_info"
    assert entry_point.load() is mok_bf16.backend_info
