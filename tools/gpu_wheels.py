#!/usr/bin/env python3
"""CUDA wheels of the compiled packages for the GPU machines, built on a development machine so
that a GPU call need not compile them (the build took 61-68 s of a call's device time).

    python3 tools/gpu_wheels.py build [--python PY]   # here: .whl/mok/*.whl and .whl/mok/SOURCES
    python3 tools/gpu_wheels.py build --base main     # here: main's wheels in .whl/mok-base
    python3 tools/gpu_wheels.py build --base main --patch prepared/x.patch --out .whl/mok-x
                                                      # here: main + a prepared patch, a third build
                                                      # (--patch again: more patches, in order)
    python3 tools/gpu_wheels.py sonic                 # here: SonicMoE's wheels in .whl/sonic
    python3 tools/gpu_wheels.py check                 # there: exit 0 if the wheels fit the tree
    python3 tools/gpu_wheels.py commit                # there: the commit the tree was built at

`build` runs `pip wheel` for mok-core, mok-bf16 and mok-mxfp8 with MOK_CUDA=ON under PY (a
Python of the GPU machines' version, 3.12, with the build requirements: scikit-build-core,
pybind11, cmake, ninja, setuptools), and for mok-torch (pure Python: an A/B installs each side's
Python glue with its kernels), and lists every source file of the three packages with its SHA-256 in
SOURCES. `build --base REV` builds commit REV's packages the same way (in a temporary git worktree,
removed after) into .whl/mok-base: the other side of tools/gpu-check's `ab` stage, which installs
each folder's wheels in turns on one machine; with `--patch FILE` the patch is applied to REV's
tree first (`git apply`; several `--patch`, in the order given: a kernel patch and a switch that
turns its lane on) and `--out DIR` names another folder, so that a prepared experiment is a
third build of the same `ab` call (MOK_AB=".whl/mok-base .whl/mok .whl/mok-x"). `check` holds
the tree against that list: the wheels count only when every listed file is there with the same
bytes and no other source file exists (build outputs, caches and egg-info are not sources).
tools/gpu-check installs them when `check` passes and they import, and builds the packages as
before otherwise (a binary built on one machine's image may not load on another's).

`sonic` fills .whl/sonic with what tools/gpu-check's `sonic` stages install on a GPU machine (it
has no network): the pinned wheels of SonicMoE and its dependencies (SONIC_WHEELS, for the GPU
machines' Python 3.12 on x86-64 Linux), by `pip download`, with the largest, nvidia-cutlass-dsl-
libs-base (74 MB), repacked as an xz tarball of its files (52 MB; ~3 min on two cores) so that the
folder, mok's wheels and the tree fit one call's 64 MiB (with benchmarks/results, NOTES.md and
docs/ moved out for that call: prepared/call.sh `lean`).

`build` also records in TREE the commit it was run at (and whether tracked files had local
changes) with the SHA-256 of every tracked file that can change what runs. On a GPU machine the
copy of the working tree has no such commit of its own (its git metadata is older), so `commit`
prints "<commit> <dirty 0|1>" when every file TREE lists is there with the same bytes, and
tools/gpu-check hands it to the benchmarks' result files (MOK_GIT_COMMIT, MOK_GIT_DIRTY:
bench.report.git_state).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("packages/mok-core", "packages/mok-bf16", "packages/mok-mxfp8")
OUT = ROOT / ".whl" / "mok"
BASE_OUT = ROOT / ".whl" / "mok-base"
LISTING = OUT / "SOURCES"
STAMP = OUT / "TREE"
NOT_RUN = "benchmarks/results/"  # tracked files that change nothing that runs (besides *.md)
NOT_SOURCES = {"build", "dist", "__pycache__", ".pytest_cache", "_skbuild"}


def sources(root: Path | None = None) -> dict[str, str]:
    """Every source file of the compiled packages under `root` (default: this tree), path
    relative to it -> SHA-256."""
    root = ROOT if root is None else root
    found = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(root / pkg):
            dirnames[:] = sorted(d for d in dirnames if d not in NOT_SOURCES and not d.endswith(".egg-info"))
            for name in sorted(filenames):
                if name.endswith((".so", ".pyc", ".whl")):
                    continue
                path = Path(dirpath) / name
                found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def build(python: str, root: Path | None = None, out: Path | None = None) -> None:
    """The wheels of the packages under `root` (default: this tree) into `out` (default
    .whl/mok), with the list of the sources they were built from."""
    root = ROOT if root is None else root
    out = (OUT if out is None else out).resolve()  # pip runs in `root`: an absolute path
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, MOK_CUDA="ON", CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    pip = [python, "-m", "pip"]
    for pkg in PACKAGES:
        subprocess.run([*pip, "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(out), pkg],
                       cwd=root, env=env, check=True)  # fmt: skip
        if pkg.endswith("mok-core"):  # what the others build against
            wheel = next(out.glob("mok_core-*.whl"))
            subprocess.run([*pip, "install", "-q", "--no-index", "--no-deps", "--force-reinstall", str(wheel)],
                           check=True)  # fmt: skip
    # mok-torch (pure Python) beside them, so that an A/B of two builds swaps the Python glue
    # that calls the kernels with the kernels (tools/gpu-check ab).
    subprocess.run([*pip, "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(out), "packages/mok-torch"],
                   cwd=root, env=env, check=True)  # fmt: skip
    (out / LISTING.name).write_text("".join(f"{digest}  {path}\n" for path, digest in sources(root).items()))
    stamp(root, out / STAMP.name)
    print(f"{len(list(out.glob('*.whl')))} wheels, {LISTING.name} and {STAMP.name} in {out}")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def stamp(root: Path, path: Path) -> None:
    """TREE: "commit <hash> <dirty 0|1>", then every tracked file of `root` that can change what runs
    (not the notes and docs, `*.md`, nor the committed results) with its SHA-256."""
    head = _git(root, "rev-parse", "HEAD").strip()
    dirty = 1 if _git(root, "status", "--porcelain", "--untracked-files=no").strip() else 0
    lines = [f"commit {head} {dirty}\n"]
    for name in _git(root, "ls-files", "-z").split("\0"):
        file = root / name
        if name and not name.endswith(".md") and not name.startswith(NOT_RUN) and file.is_file():
            lines.append(f"{hashlib.sha256(file.read_bytes()).hexdigest()}  {name}\n")
    path.write_text("".join(lines))


def commit() -> int:
    """Prints "<commit> <dirty>" when every file TREE lists is in this tree with its bytes."""
    if not STAMP.is_file():
        print(f"gpu_wheels: no {STAMP.relative_to(ROOT)}", file=sys.stderr)
        return 1
    first, *files = STAMP.read_text().splitlines()
    for line in files:
        digest, name = line.split("  ", 1)
        file = ROOT / name
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            print(f"gpu_wheels: {name} is not the one of {STAMP.relative_to(ROOT)}'s commit", file=sys.stderr)
            return 1
    _, head, dirty = first.split()
    print(f"{head} {dirty}")
    return 0


def build_base(python: str, rev: str, patches: list[Path] | None = None, out: Path | None = None) -> None:
    """Commit `rev`'s wheels (with `patches` applied in order, if given) into `out` (default
    .whl/mok-base), built in a temporary worktree (removed after, whether the build passes or not)."""
    tmp = Path(tempfile.mkdtemp(prefix="mok-base-"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    try:
        for patch in patches or []:
            subprocess.run(["git", "-C", str(tree), "apply", str(patch.resolve())], check=True)
        build(python, tree, BASE_OUT if out is None else out)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


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


# SonicMoE 0.1.2.post1 on QuACK 0.3.11, the versions every comparison since session 17 ran.
SONIC_WHEELS = (
    "sonic-moe==0.1.2.post1",
    "quack-kernels==0.3.11",
    "nvidia-cutlass-dsl==4.4.2",
    "nvidia-cutlass-dsl-libs-base==4.4.2",
    "apache-tvm-ffi==0.1.15.post2",
    "torch-c-dlpack-ext==0.1.5",
)
SONIC_OUT = ROOT / ".whl" / "sonic"
LIBS_BASE = "nvidia_cutlass_dsl_libs_base-"  # the wheel repacked as cutlass_dsl_libs_base-<v>.tar.xz


def download_sonic(into: Path) -> None:
    """SONIC_WHEELS into `into` by pip (binary wheels for CPython 3.12 on manylinux x86-64)."""
    platforms = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "any")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    cmd += ["--implementation", "cp", *(a for p in platforms for a in ("--platform", p)), "-d", str(into)]
    subprocess.run([*cmd, *SONIC_WHEELS], check=True)


def pack_sonic(wheels: Path, out: Path) -> list[Path]:
    """The downloaded wheels into `out` (emptied first): the libs-base wheel as an xz tarball of
    its files (what gpu-check untars into its site folder), the others as they are."""
    import lzma
    import tarfile
    import zipfile

    found = sorted(wheels.glob("*.whl"))
    libs = [w for w in found if w.name.startswith(LIBS_BASE)]
    if len(libs) != 1 or len(found) != len(SONIC_WHEELS):
        raise SystemExit(f"gpu_wheels: expected {len(SONIC_WHEELS)} wheels, one of them {LIBS_BASE}*, in {wheels}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    written = []
    for w in found:
        if w is libs[0]:
            continue
        shutil.copy2(w, out / w.name)
        written.append(out / w.name)
    version = libs[0].name[len(LIBS_BASE) :].split("-")[0]
    tarball = out / f"cutlass_dsl_libs_base-{version}.tar.xz"
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(libs[0]) as z:
            z.extractall(tmp)
        if shutil.which("xz") and shutil.which("tar"):  # xz -T2: the multithreaded compressor
            with open(tarball, "wb") as f:
                tar = subprocess.Popen(["tar", "cf", "-", "-C", tmp, "."], stdout=subprocess.PIPE)
                subprocess.run(["xz", "-9e", "-T2"], stdin=tar.stdout, stdout=f, check=True)
                if tar.wait() != 0:
                    raise SystemExit("gpu_wheels: tar failed")
        else:
            with tarfile.open(tarball, "w:xz", preset=9 | lzma.PRESET_EXTREME) as t:
                t.add(tmp, arcname=".")
    written.append(tarball)
    size = sum(f.stat().st_size for f in written)
    print(f"gpu_wheels: {len(written)} files, {size / 1e6:.1f} MB in {out}")
    return written


def sonic(out: Path | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        download_sonic(Path(tmp))
        pack_sonic(Path(tmp), SONIC_OUT if out is None else out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--python", default="python3.12", help="a Python of the GPU machines' version (default python3.12)")
    b.add_argument("--base", metavar="REV", help="build commit REV (e.g. main) into .whl/mok-base instead")
    b.add_argument(
        "--patch",
        metavar="FILE",
        type=Path,
        action="append",
        help="with --base: apply FILE to REV's tree first (repeatable: applied in order)",
    )
    b.add_argument("--out", metavar="DIR", type=Path, help="with --base: the folder (default .whl/mok-base)")
    sub.add_parser("sonic")
    sub.add_parser("check")
    sub.add_parser("commit")
    ns = p.parse_args()
    if ns.command == "sonic":
        sonic()
        return 0
    if ns.command == "build":
        if (ns.patch or ns.out) and not ns.base:
            p.error("--patch and --out go with --base (this tree's own build is .whl/mok)")
        if ns.base:
            build_base(ns.python, ns.base, ns.patch, ns.out)
        else:
            build(ns.python)
        return 0
    return commit() if ns.command == "commit" else check()


if __name__ == "__main__":
    sys.exit(main())
