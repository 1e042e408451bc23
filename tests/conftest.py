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


@pytest.fixture(autouse=True)
def _fresh_workspaces():
    import mok_torch as mok

    yield
    mok.clear_workspace_cache()
