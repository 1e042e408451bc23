"""Sessions of the mok monorepo.

nox -s tests     # CPU test suite, once per backend (asserts that backend ran)
nox -s demo      # the main job: train a small MoE model, check bitwise reproducibility
nox -s lint      # ruff format + lint, clang-format, mypy
nox -s torchtitan # mok inside torchtitan 0.3.0 (off by default: torchtitan is heavy)
nox -s gpu_tests # on a GPU machine (off by default)
nox -s bench     # on a GPU machine (off by default)
"""

from __future__ import annotations

import os
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


def install_mok(session: nox.Session) -> None:
    """torch, then the compiled packages (mok-core first: the others build against it), then mok-torch."""
    session.install(TORCH, *_groups("build"))
    jobs = str(os.cpu_count() or 2)
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": jobs}
    for pkg in COMPILED:
        session.install("--no-build-isolation", "--no-deps", pkg, env=env)
    session.install("--no-build-isolation", "packages/mok-torch")


@nox.session
@nox.parametrize("backend", CPU_BACKENDS)
def tests(session: nox.Session, backend: str) -> None:
    install_mok(session)
    session.install(*_groups("test"))
    session.run("python", "-m", "pytest", *session.posargs, env={"MOK_TEST_BACKEND": backend})


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
    """tests/test_torchtitan.py against torchtitan 0.3.0 (the CPU suite skips it without torchtitan)."""
    install_mok(session)
    session.install(*_groups("test"))
    version = ["python", "-c", "import torch; print(torch.__version__)"]
    before = session.run(*version, silent=True)
    session.install("--no-deps", TORCHTITAN)
    session.install(*TORCHTITAN_DEPS)
    if session.run(*version, silent=True) != before:
        session.error("installing torchtitan changed torch")
    session.run("python", "-m", "pytest", "tests/test_torchtitan.py", *session.posargs)


@nox.session(python=False, default=False)
def gpu_tests(session: nox.Session) -> None:
    """On a GPU machine: build into the current environment, then the suite on CUDA."""
    session.run("tools/gpu-check", *(session.posargs or [".gpu-out"]), external=True)


@nox.session(python=False, default=False)
def bench(session: nox.Session) -> None:
    session.run("mok", "bench", *session.posargs, external=True)
