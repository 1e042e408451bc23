"""Tests of the installed mok-core: version, build facts, entry points, CMake config, devices.

GPU tests skip, with the reason, when no CUDA device is visible."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mok_core

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
    assert mok_core.version() == expected
    assert mok_core.__version__ == expected
    assert importlib.metadata.version("mok-core") == expected


def test_build_info_fields_and_types() -> None:
    info = mok_core.build_info()
    assert set(info) == set(BUILD_INFO_TYPES)
    for key, kind in BUILD_INFO_TYPES.items():
        assert isinstance(info[key], kind), (key, info[key])
    assert info["package"] == "mok-core"
    assert info["version"] == info["mok_core_version"] == mok_core.__version__
    assert info["cxx_compiler"].strip()
    assert info["build_type"] in {"Release", "Debug", "RelWithDebInfo", "MinSizeRel"}
    if info["cuda"]:
        assert info["backends"] == ["cpu", "cuda"]
        assert info["cuda_architectures"], "a CUDA build names its architectures"
        assert all(isinstance(arch, str) and arch for arch in info["cuda_architectures"])
        assert re.fullmatch(r"\d+\.\d+(\.\d+)?", info["cuda_compiler_version"])
        assert re.fullmatch(r"\d+\.\d+", info["cuda_runtime_version"])
    else:
        assert info["backends"] == ["cpu"]
        assert info["cuda_architectures"] == []
        assert info["cuda_compiler_version"] is None
        assert info["cuda_runtime_version"] is None


def test_build_info_returns_a_fresh_dict() -> None:
    info = mok_core.build_info()
    info["backends"].append("bogus")
    assert "bogus" not in mok_core.build_info()["backends"]


def test_backend_info_shape() -> None:
    info = mok_core.backend_info()
    assert info == {
        "package": "mok-core",
        "version": mok_core.__version__,
        "role": "runtime",
        "precision": None,
        "devices": mok_core.build_info()["backends"],
        "build": mok_core.build_info(),
    }


def test_entry_point_present() -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="mok.backends") if ep.name == "core"]
    assert entry_point.value == "mok_core:backend_info"
    assert entry_point.load() is mok_core.backend_info


def test_cmake_prefix_entry_point_present() -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="cmake.prefix") if ep.name == "MokCore"]
    assert entry_point.value == "mok_core"


def test_installed_headers_and_cmake_config() -> None:
    cmake_dir = Path(mok_core.cmake_dir())
    assert (cmake_dir / "MokCoreConfig.cmake").is_file()
    assert (cmake_dir / "MokCoreConfigVersion.cmake").is_file()
    assert (cmake_dir / "MokCoreTargets.cmake").is_file()
    include_dir = Path(mok_core.include_dir())
    for header in ("version.h", "build_info.h", "hd.h", "pybind/build_info.h"):
        assert (include_dir / "mok" / "core" / header).is_file(), header
    version_h = (include_dir / "mok/core/version.h").read_text()
    assert f'#define MOK_CORE_VERSION_STRING "{mok_core.__version__}"' in version_h


def find_tool(name: str) -> str | None:
    """The tool next to this Python (a venv's cmake/ninja packages), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def test_cmake_config_builds_a_consumer(tmp_path: Path) -> None:
    """find_package(MokCore CONFIG) from the installed wheel gives a usable MokCore::headers."""
    cmake = find_tool("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    ninja = find_tool("ninja")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\n"
        "project(consumer LANGUAGES CXX)\n"
        "find_package(MokCore 0.1 CONFIG REQUIRED)\n"
        "add_executable(consumer main.cpp)\n"
        "target_link_libraries(consumer PRIVATE MokCore::headers)\n"
    )
    (tmp_path / "main.cpp").write_text(
        '#include "mok/core/build_info.h"\n'
        '#include "mok/core/hd.h"\n'
        '#include "mok/core/version.h"\n'
        "MOK_HD inline int twice(int x) { return 2 * x; }\n"
        "int main() {\n"
        '  auto archs = mok::core::split_cmake_list("90a;;100a");\n'
        "  return (archs.size() == 2 && twice(MOK_CORE_VERSION_MAJOR) == 0) ? 0 : 1;\n"
        "}\n"
    )
    build = tmp_path / "build"
    configure = run(
        cmake,
        "-S",
        str(tmp_path),
        "-B",
        str(build),
        *generator,
        f"-DMokCore_DIR={mok_core.cmake_dir()}",
    )
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = run(cmake, "--build", str(build))
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    executable = build / "consumer"
    assert run(str(executable)).returncode == 0


def test_cuda_device_count_is_a_nonnegative_int() -> None:
    count = mok_core.cuda_device_count()
    assert isinstance(count, int) and count >= 0
    assert mok_core.cuda_device_count() == count
    if not mok_core.build_info()["cuda"]:
        assert count == 0


def test_cuda_device_properties_rejects_a_bad_index() -> None:
    if mok_core.build_info()["cuda"]:
        with pytest.raises(ValueError, match="index"):
            mok_core.cuda_device_properties(-1)
        with pytest.raises(ValueError, match="index"):
            mok_core.cuda_device_properties(mok_core.cuda_device_count())
    else:
        with pytest.raises(RuntimeError, match="without CUDA"):
            mok_core.cuda_device_properties(0)
        with pytest.raises(RuntimeError, match="without CUDA"):
            mok_core.cuda_device_properties(-1)


@pytest.mark.gpu
def test_cuda_device_properties_of_each_device() -> None:
    count = mok_core.cuda_device_count()
    if count == 0:
        pytest.skip("no CUDA device visible (built without CUDA, or no GPU/driver on this machine)")
    for index in range(count):
        props = mok_core.cuda_device_properties(index)
        assert set(props) == {
            "name",
            "major",
            "minor",
            "multiprocessor_count",
            "l2_cache_bytes",
            "shared_memory_per_block_optin",
            "total_memory",
        }
        assert isinstance(props["name"], str) and props["name"]
        assert props["major"] >= 7 and props["minor"] >= 0
        assert props["multiprocessor_count"] > 0
        assert props["l2_cache_bytes"] > 0
        assert props["shared_memory_per_block_optin"] >= 48 * 1024
        assert props["total_memory"] > 2**30


def test_cuda_device_count_with_no_visible_device() -> None:
    """A process that may see no GPU gets 0 devices, no exception, and exits cleanly."""
    result = subprocess.run(
        [sys.executable, "-c", "import mok_core; print(mok_core.cuda_device_count())"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
