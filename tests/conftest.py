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
