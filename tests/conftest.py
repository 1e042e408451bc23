import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import BACKEND, DEVICE


def pytest_report_header(config):
    return f"mok backend under test: {BACKEND}; device: {DEVICE}; torch {torch.__version__}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with a reason where there is none)")
    config.addinivalue_line("markers", "multiprocess: spawns several processes (gloo on CPU, NCCL on GPUs)")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("MOK_TEST_DEVICE=cuda but torch sees no GPU")


def _chooses_the_backend(module) -> bool:
    """Whether a test module runs the backend under test: it takes the backend from helpers
    (BACKEND itself, or config() / run_functional, which default to it)."""
    import helpers

    return any(
        getattr(module, name, None) is getattr(helpers, name) for name in ("BACKEND", "config", "run_functional")
    )


def pytest_collection_modifyitems(config, items):
    """MOK_TEST_BACKEND_TESTS_ONLY=1 (the CPU suite's second backend, noxfile.py): only the tests
    that run the backend under test; the rest (the kernels against their definitions, the CLI,
    the faults with their own backends) ran already and would give the same result."""
    if os.environ.get("MOK_TEST_BACKEND_TESTS_ONLY") != "1":
        return
    keep, drop = [], []
    for item in items:
        module = getattr(item, "module", None)
        (keep if module is not None and _chooses_the_backend(module) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    """Skipped tests, one line per reason with its count (the GPU-only tests on a CPU machine are
    hundreds of skips with one reason: a list of every location would bury the failures)."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skipped, by reason")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{count:5d}  {reason}")


@pytest.fixture(autouse=True)
def _fresh_workspaces():
    import mok_torch as mok

    yield
    mok.clear_workspace_cache()
