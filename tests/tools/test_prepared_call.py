"""prepared/call.sh, the GPU call written out for the prepared patches: its shell parses, every
patch and probe it names exists, and its summary tells equal digests from differing ones. CPU
only: the call itself runs on the GPU machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALL = ROOT / "prepared" / "call.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(CALL)], check=True)


def test_every_patch_and_probe_it_names_exists():
    text = CALL.read_text()
    named = set(re.findall(r"prepared/[\w.-]+\.patch", text))
    probes = set(re.findall(r"\$P/([\w.-]+\.py)", text))
    # in_turns FILE SECONDS "BUILDS" PROBE ...: the probe named without $P/
    probes |= set(re.findall(r'^\s*in_turns \S+ \d+ "[^"]*" \\?\s*([\w.-]+\.py)', text, re.MULTILINE))
    results = set(re.findall(r"benchmarks/results/[\w./-]+\.txt", text))  # the committed digests
    assert probes and results  # (a call may build main alone: no patch named)
    for path in sorted(named):
        assert (ROOT / path).is_file(), path
    for probe in sorted(probes):
        assert (ROOT / "benchmarks" / "probes" / probe).is_file(), probe
    for path in sorted(results):
        assert (ROOT / path).is_file(), path


def test_summary_tells_equal_digests_from_differing_ones(tmp_path):
    one, two = "a" * 64, "b" * 64
    (tmp_path / "bits.txt").write_text(
        f"## base\ncase-x  {one}\ncase-y  {one}\n## patched\ncase-x  {one}\ncase-y  {two}\n"
    )
    (tmp_path / "log").write_text("rc=0 reference tests/x.py\n3 passed in 1.0s\n")
    out = subprocess.run(
        ["bash", str(CALL), "summary", str(tmp_path)], check=True, capture_output=True, text=True
    ).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("case-")}
    assert " SAME " in lines["case-x"]
    assert " DIFFER " in lines["case-y"]
    assert "3 passed" in out


def test_the_call_refuses_to_run_without_out():
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(["bash", str(CALL)], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "OUT" in result.stderr


def test_every_step_it_runs_by_default_is_defined():
    text = CALL.read_text()
    default = re.search(r'"\$\{@:-([\w ]+)\}"', text)
    assert default is not None
    for step in default.group(1).split():
        assert re.search(rf"^step_{step}\(\) \{{", text, re.MULTILINE), step
