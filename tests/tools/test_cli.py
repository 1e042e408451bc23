"""The `mok` command line: info, and the demo end to end (short)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mok_torch import demo
from mok_torch.cli import main

ROOT = Path(__file__).resolve().parents[2]


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


def test_mok_torch_declares_numpy():
    """torch warns "Failed to initialize NumPy" on every import where numpy is missing, and
    torch does not require it: mok-torch does, so a fresh install's commands are quiet."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "packages/mok-torch/pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "numpy" for dep in project["dependencies"])


def test_help_is_quiet():
    proc = subprocess.run([sys.executable, "-m", "mok_torch.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout
    assert proc.stderr == ""


def test_info_help_is_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["info", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: mok info")


def test_demo_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for default in ("--steps STEPS", "(default: 200)", "(default: 2)", "(default: auto)", "(default: 0)"):
        assert default in out


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--ranks", "3"], "--ranks 3: the 8 experts must divide evenly among the ranks (use 1, 2, 4, 8)"),
        (["--ranks", "0"], "argument --ranks: must be an int >= 1, got 0"),
        (["--steps", "0"], "argument --steps: must be an int >= 1, got 0"),
    ],
)
def test_demo_rejects_arguments_before_spawning(argv, msg, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        demo.main(argv + ["--device", "cpu"])
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


def test_demo_judges_learning_only_over_enough_steps():
    few = [4.3, 4.25, 4.28]  # three steps: the bits are judged, the loss is not
    assert demo._learned(few, show=False)
    assert not demo._learned(few[:2] + [float("nan")], show=False)
    flat = [4.3] * demo.LEARNING_STEPS
    assert not demo._learned(flat, show=False)  # the default run's criterion stands
    assert demo._learned(flat[:-1] + [4.3 - demo.LEARNING_NATS - 0.01], show=False)
    assert demo.LEARNING_STEPS <= demo.parser().get_default("steps")


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


@pytest.mark.multiprocess
def test_demo_of_three_steps_passes_on_its_bits():
    proc = subprocess.run(
        [sys.executable, "-m", "mok_torch.cli", "demo", "--steps", "3", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss curves bitwise identical: yes (3 steps)" in proc.stdout
    assert "learning not judged: 3 steps are too few" in proc.stdout
    # Not a terminal: progress as plain lines, no bar redraws
    assert "\r" not in proc.stdout and "run A: 3/3 after" in proc.stdout, proc.stdout[-2000:]
