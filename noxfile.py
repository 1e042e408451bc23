"""Sessions of the mok monorepo.

nox -s wheels    # the four packages' wheels for this source state, in dist/<key>/ (built once)
nox -s tests     # CPU test suite: all of it on the reference backend, the backend tests on cpu
nox -s demo      # the main job: train a small MoE model, check bitwise reproducibility
nox -s lint      # ruff format + lint, clang-format, mypy
nox -s torchtitan # mok inside torchtitan 0.3.0 (off by default: torchtitan is heavy)
nox -s gpu_tests # on a GPU machine (off by default)
nox -s bench     # on a GPU machine (off by default)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
# The CPU wheel this project's machines keep on disk; override for other machines.
TORCH = os.environ.get("MOK_TORCH_SPEC", "torch==2.13.0")
COMPILED = ["packages/mok-core", "packages/mok-bf16", "packages/mok-mxfp8"]
# Backends the CPU suite runs against; native ones join as they land.
CPU_BACKENDS = ["reference", "cpu"]

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True


def _groups(*names: str) -> list[str]:
    deps: list[str] = []
    for name in names:
        deps += nox.project.dependency_groups(PYPROJECT, name)
    return deps


PACKAGES = [*COMPILED, "packages/mok-torch"]
MOK_TORCH_REQUIRES = nox.project.load_toml(ROOT / "packages/mok-torch/pyproject.toml")["project"]["dependencies"]
NAMES = [Path(p).name for p in PACKAGES]


def _sources(pkg: str) -> list[Path]:
    """The files a package is built from: git's tracked and untracked-but-not-ignored files (a
    build's outputs, ignored, never count)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", pkg],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return sorted(ROOT / f for f in listed if (ROOT / f).is_file())


def _gpu_visible() -> bool:
    nvidia_smi = shutil.which("nvidia-smi")
    return nvidia_smi is not None and subprocess.run([nvidia_smi, "-L"], capture_output=True).returncode == 0


def cuda_mode() -> str:
    """MOK_CUDA for the compiled packages: the environment's, else AUTO (CUDA code wherever nvcc
    is found) on a machine that shows a GPU and OFF on one that does not, where the CUDA code
    could not run and would take minutes of nvcc (`MOK_CUDA=AUTO nox -s wheels` builds it there)."""
    return os.environ.get("MOK_CUDA", "").upper() or ("AUTO" if _gpu_visible() else "OFF")


def source_key() -> str:
    """A digest of every file the four packages are built from (paths and bytes), with the torch
    they build against and the CUDA mode: the wheels of one key are the same wheels."""
    digest = hashlib.sha256(f"{TORCH}\0MOK_CUDA={cuda_mode()}".encode())
    for pkg in PACKAGES:
        for path in _sources(pkg):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def wheel_dir() -> Path:
    return ROOT / "dist" / source_key()


def _have_wheels(where: Path) -> bool:
    return all(any(where.glob(f"{name.replace('-', '_')}-*.whl")) for name in NAMES)


def build_wheels(session: nox.Session) -> Path:
    """The four packages' wheels for this source state in dist/<key>/, built once (mok-core is
    installed first: the others build against its headers and library)."""
    where = wheel_dir()
    if _have_wheels(where):
        session.install(TORCH)
        session.log(f"wheels of this source state: {where.relative_to(ROOT)} (reused)")
        return where
    session.install(TORCH, *_groups("build"))
    partial = where.with_name(where.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2), "MOK_CUDA": cuda_mode()}
    session.log(f"building the wheels with MOK_CUDA={env['MOK_CUDA']}")
    wheel = ["python", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(partial)]
    for pkg in PACKAGES:
        session.run(*wheel, pkg, env=env)
        if pkg == "packages/mok-core":  # what the others build against
            session.install("--no-index", "--no-deps", "--find-links", str(partial), "mok-core")
    partial.rename(where)  # only a complete set is ever found
    return where


def install_mok(session: nox.Session) -> None:
    """torch, then this source state's wheels (built once, by the first session that needs them;
    `nox -s wheels` builds them alone), then mok-torch's own requirements."""
    where = build_wheels(session)
    # mok's own packages only from these wheels (never an index's namesakes); the rest first.
    session.install(*MOK_TORCH_REQUIRES)
    session.install("--no-index", "--find-links", str(where), "mok-torch[all]")


@nox.session
def wheels(session: nox.Session) -> None:
    """Wheels of mok-core, mok-bf16, mok-mxfp8 and mok-torch for this source state in dist/<key>/
    (the other sessions reuse them; `pip install --find-links dist/<key> 'mok-torch[bf16]'`
    installs from them with no network but torch's and numpy's)."""
    where = build_wheels(session)
    session.log(f"pip install --find-links {where.relative_to(ROOT)} 'mok-torch[all]'")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suite in one environment, once per backend of CPU_BACKENDS: the first runs every
    test, the others only the tests that run the backend under test (tests/conftest.py; the rest
    would give the same result again). MOK_TEST_BACKEND=NAME runs that backend's full suite alone."""
    install_mok(session)
    session.install(*_groups("test"))
    chosen = os.environ.get("MOK_TEST_BACKEND")
    for i, backend in enumerate([chosen] if chosen else CPU_BACKENDS):
        env = {"MOK_TEST_BACKEND": backend, "MOK_TEST_BACKEND_TESTS_ONLY": "1" if i > 0 else "0"}
        session.log(f"backend under test: {backend}" + (" (the tests that run it)" if i > 0 else ""))
        session.run("python", "-m", "pytest", *session.posargs, env=env)


@nox.session
def demo(session: nox.Session) -> None:
    install_mok(session)
    session.run("mok", "demo", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*_groups("lint"))
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    sources = [str(p) for p in ROOT.glob("packages/*/**/*") if p.suffix in {".h", ".hpp", ".cpp", ".cu", ".cuh"}]
    session.run("clang-format", "--dry-run", "--Werror", *sources)
    session.install(TORCH)
    session.run("mypy")


# torchtitan is installed without its requirements (they would replace the torch mok is built
# against, and pull datasets, wandb, tensorboard the MoE modules never import); these are the
# ones its MoE, config and distributed modules import.
TORCHTITAN = "torchtitan==0.3.0"
TORCHTITAN_DEPS = ["spmd_types==0.2.3", "tyro", "triton"]


@nox.session(default=False)
def torchtitan(session: nox.Session) -> None:
    """tests/integrations/test_torchtitan.py against torchtitan 0.3.0 (the CPU suite skips it without torchtitan)."""
    install_mok(session)
    session.install(*_groups("test"))
    version = ["python", "-c", "import torch; print(torch.__version__)"]
    before = session.run(*version, silent=True)
    session.install("--no-deps", TORCHTITAN)
    session.install(*TORCHTITAN_DEPS)
    if session.run(*version, silent=True) != before:
        session.error("installing torchtitan changed torch")
    session.run("python", "-m", "pytest", "tests/integrations/test_torchtitan.py", *session.posargs)


@nox.session(python=False, default=False)
def gpu_tests(session: nox.Session) -> None:
    """On a GPU machine: build into the current environment, then the suite on CUDA."""
    session.run("tools/gpu-check", *(session.posargs or [".gpu-out"]), external=True)


@nox.session(python=False, default=False)
def bench(session: nox.Session) -> None:
    session.run("mok", "bench", *session.posargs, external=True)
