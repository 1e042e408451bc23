"""examples/train_moe.py: DP + EP training on 2 CPU ranks, and bitwise-identical resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess
EXAMPLE = Path(__file__).parents[2] / "examples" / "train_moe.py"


def _torchrun(tmp: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_resume_continues_bitwise(tmp_path):
    common = ["--steps", "8", "--layers", "1", "--seq-len", "16"]
    _torchrun(tmp_path, *common, "--ckpt-dir", "straight", "--log-json", "straight.json")
    _torchrun(tmp_path, *common, "--ckpt-dir", "resumed", "--stop-after", "4")
    _torchrun(tmp_path, *common, "--ckpt-dir", "resumed", "--resume", "--log-json", "resumed.json")
    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert len(straight["losses"]) == 8 and straight["losses"] == resumed["losses"]
    assert straight["losses"][-1] < straight["losses"][0]
    for rank in range(2):
        a = torch.load(tmp_path / "straight" / f"rank{rank}.pt", map_location="cpu")
        b = torch.load(tmp_path / "resumed" / f"rank{rank}.pt", map_location="cpu")
        for name, t in a["model"].items():
            assert torch.equal(t, b["model"][name]), f"rank {rank}: {name}"
    # the two ranks hold different experts, the same dense weights
    r0 = torch.load(tmp_path / "straight" / "rank0.pt", map_location="cpu")["model"]
    r1 = torch.load(tmp_path / "straight" / "rank1.pt", map_location="cpu")["model"]
    assert torch.equal(r0["embed.weight"], r1["embed.weight"])
    assert not torch.equal(r0["blocks.0.moe.gate_proj"], r1["blocks.0.moe.gate_proj"])
