"""The `mok` command line: info, and the demo end to end (short)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mok_torch.cli import main


def test_info(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "reference" in info["backends"]["bf16"]
    assert info["mok_torch"] == __import__("mok_torch").__version__
    assert set(info["expert_paths"]) == {"bf16", "mxfp8"}  # which implementation runs the experts
    assert info["expert_paths"]["bf16"].startswith("forward ")


def test_unknown_command_fails():
    with pytest.raises(SystemExit):
        main(["frobnicate"])


@pytest.mark.multiprocess
def test_demo_runs_and_is_bitwise_reproducible():
    device = "cuda" if os.environ.get("MOK_TEST_DEVICE") == "cuda" and torch.cuda.is_available() else "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "mok_torch.demo", "--steps", "30", "--device", device],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss curves bitwise identical: yes" in proc.stdout
    assert "final weights bitwise identical on every rank: yes" in proc.stdout
