#!/usr/bin/env python3
"""CUDA wheels of the compiled packages for the GPU machines, built on a development machine so
that a GPU call need not compile them (the build took 61-68 s of a call's device time).

    python3 tools/gpu_wheels.py build [--python PY]   # here: .whl/mok/*.whl and .whl/mok/SOURCES
    python3 tools/gpu_wheels.py check                 # there: exit 0 if the wheels fit the tree

`build` runs `pip wheel` for mok-core, mok-bf16 and mok-mxfp8 with MOK_CUDA=ON under PY (a
Python of the GPU machines' version, 3.12, with the build requirements: scikit-build-core,
pybind11, cmake, ninja), and lists every source file of the three packages with its SHA-256 in
SOURCES. `check` holds the tree against that list: the wheels count only when every listed file
is there with the same bytes and no other source file exists (build outputs, caches and
egg-info are not sources). tools/gpu-check installs them when `check` passes and they import,
and builds the packages as before otherwise (a binary built on one machine's image may not load
on another's).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("packages/mok-core", "packages/mok-bf16", "packages/mok-mxfp8")
OUT = ROOT / ".whl" / "mok"
LISTING = OUT / "SOURCES"
NOT_SOURCES = {"build", "dist", "__pycache__", ".pytest_cache", "_skbuild"}


def sources() -> dict[str, str]:
    """Every source file of the compiled packages (path relative to the root -> SHA-256)."""
    found = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(ROOT / pkg):
            dirnames[:] = sorted(d for d in dirnames if d not in NOT_SOURCES and not d.endswith(".egg-info"))
            for name in sorted(filenames):
                if name.endswith((".so", ".pyc", ".whl")):
                    continue
                path = Path(dirpath) / name
                found[str(path.relative_to(ROOT))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def build(python: str) -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    env = dict(os.environ, MOK_CUDA="ON", CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    pip = [python, "-m", "pip"]
    for pkg in PACKAGES:
        subprocess.run([*pip, "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(OUT), pkg],
                       cwd=ROOT, env=env, check=True)  # fmt: skip
        if pkg.endswith("mok-core"):  # what the others build against
            wheel = next(OUT.glob("mok_core-*.whl"))
            subprocess.run([*pip, "install", "-q", "--no-index", "--no-deps", "--force-reinstall", str(wheel)],
                           check=True)  # fmt: skip
    LISTING.write_text("".join(f"{digest}  {path}\n" for path, digest in sources().items()))
    print(f"{len(list(OUT.glob('*.whl')))} wheels and {LISTING.relative_to(ROOT)} in {OUT.relative_to(ROOT)}")


def check() -> int:
    if not LISTING.is_file():
        print(f"gpu_wheels: no {LISTING.relative_to(ROOT)}: the packages are built here")
        return 1
    listed = {}
    for line in LISTING.read_text().splitlines():
        digest, path = line.split("  ", 1)
        listed[path] = digest
    now = sources()
    changed = sorted(p for p in listed.keys() | now.keys() if listed.get(p) != now.get(p))
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        print(f"gpu_wheels: the prebuilt wheels are of other sources ({shown}): the packages are built here")
        return 1
    print(f"gpu_wheels: the prebuilt wheels fit the tree ({len(now)} source files)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--python", default="python3.12", help="a Python of the GPU machines' version (default python3.12)")
    sub.add_parser("check")
    ns = p.parse_args()
    if ns.command == "build":
        build(ns.python)
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
