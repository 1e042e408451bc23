"""tools/gpu_wheels.py: prebuilt wheels count only for the sources they were built from (what
tools/gpu-check asks before it installs them instead of building). CPU only: the build itself
needs a Python 3.12 and nvcc, and runs by hand."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tool(tmp_path, monkeypatch):
    """The tool over a small tree in tmp_path: two packages' sources and a build output."""
    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for pkg in ("packages/a", "packages/b"):
        (tmp_path / pkg / "src").mkdir(parents=True)
        (tmp_path / pkg / "src" / "k.cu").write_text(f"// {pkg}\n")
        (tmp_path / pkg / "build").mkdir()
        (tmp_path / pkg / "build" / "out.o").write_text("not a source")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "PACKAGES", ("packages/a", "packages/b"))
    monkeypatch.setattr(module, "OUT", tmp_path / ".whl" / "mok")
    monkeypatch.setattr(module, "LISTING", tmp_path / ".whl" / "mok" / "SOURCES")
    return module


def listed(tool) -> None:
    tool.OUT.mkdir(parents=True)
    tool.LISTING.write_text("".join(f"{d}  {p}\n" for p, d in tool.sources().items()))


def test_no_listing_means_build(tool, capsys):
    assert tool.check() == 1
    assert "no .whl/mok/SOURCES" in capsys.readouterr().out


def test_the_same_sources_pass_and_build_outputs_do_not_count(tool):
    listed(tool)
    assert sorted(tool.sources()) == ["packages/a/src/k.cu", "packages/b/src/k.cu"]
    (tool.ROOT / "packages/a/build/more.o").write_text("another output")
    assert tool.check() == 0


@pytest.mark.parametrize("change", ["edit", "add", "remove"])
def test_any_other_source_means_build(tool, change, capsys):
    listed(tool)
    src = tool.ROOT / "packages/b/src"
    if change == "edit":
        (src / "k.cu").write_text("// changed\n")
    elif change == "add":
        (src / "new.cuh").write_text("// new\n")
    else:
        (src / "k.cu").unlink()
    assert tool.check() == 1
    assert "packages/b/src/" in capsys.readouterr().out


def committed(root: Path, *paths: str):
    """A git repository at `root` with `paths` committed; returns its git (args -> stdout)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True)
        return done.stdout

    git("init", "-q")
    git("add", *paths)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return git


def test_base_builds_the_commit_in_a_worktree_removed_after(tool, monkeypatch):
    """`build --base REV` builds REV's sources, not the working tree's, into .whl/mok-base, and
    leaves no worktree behind even when the build fails."""
    root = tool.ROOT
    git = committed(root, "packages")
    (root / "packages/a/src/k.cu").write_text("// changed after the commit\n")
    monkeypatch.setattr(tool, "BASE_OUT", root / ".whl" / "mok-base")
    seen = {}

    def failing_build(python: str, tree: Path, out: Path) -> None:
        seen.update(source=(tree / "packages/a/src/k.cu").read_text(), tree=tree, out=out)
        raise RuntimeError("the build failed")

    monkeypatch.setattr(tool, "build", failing_build)
    with pytest.raises(RuntimeError, match="the build failed"):
        tool.build_base("python3", "HEAD")
    assert seen["source"] == "// packages/a\n"  # the commit's bytes
    assert seen["out"] == root / ".whl" / "mok-base"
    assert not seen["tree"].exists()
    assert len(git("worktree", "list").splitlines()) == 1  # only the main one


def test_base_with_a_patch_builds_the_patched_commit_into_its_folder(tool, monkeypatch, tmp_path):
    """`build --base REV --patch FILE --out DIR`: REV's tree with FILE applied, into DIR (a third
    build for the `ab` stage), the working tree untouched."""
    root = tool.ROOT
    git = committed(root, "packages")
    (root / "packages/a/src/k.cu").write_text("// patched\n")
    patch = tmp_path / "x.patch"
    patch.write_text(git("diff"))
    git("checkout", "-q", "--", "packages")
    seen = {}

    def build(python: str, tree: Path, out: Path) -> None:
        seen.update(source=(tree / "packages/a/src/k.cu").read_text(), out=out)

    monkeypatch.setattr(tool, "build", build)
    tool.build_base("python3", "HEAD", [patch], root / ".whl" / "mok-x")
    assert seen == {"source": "// patched\n", "out": root / ".whl" / "mok-x"}
    assert (root / "packages/a/src/k.cu").read_text() == "// packages/a\n"
    assert len(git("worktree", "list").splitlines()) == 1


def test_base_with_two_patches_applies_them_in_order(tool, monkeypatch, tmp_path):
    """`--patch A --patch B`: B is made against REV + A (a kernel patch, then the switch that turns
    its lane on), so it applies only after A; given the other way round the build fails."""
    root = tool.ROOT
    git = committed(root, "packages")
    k = root / "packages/a/src/k.cu"
    k.write_text("// kernel\n")
    first = tmp_path / "a.patch"
    first.write_text(git("diff"))
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "a")
    k.write_text("// kernel\n// lane on\n")
    second = tmp_path / "b.patch"
    second.write_text(git("diff"))
    git("checkout", "-q", "--", "packages")
    git("reset", "-q", "--hard", "HEAD~1")
    seen = {}

    def build(python: str, tree: Path, out: Path) -> None:
        seen.update(source=(tree / "packages/a/src/k.cu").read_text(), out=out)

    monkeypatch.setattr(tool, "build", build)
    tool.build_base("python3", "HEAD", [first, second], root / ".whl" / "mok-x")
    assert seen == {"source": "// kernel\n// lane on\n", "out": root / ".whl" / "mok-x"}
    seen.clear()
    with pytest.raises(subprocess.CalledProcessError):
        tool.build_base("python3", "HEAD", [second, first], root / ".whl" / "mok-y")
    assert seen == {}
    assert k.read_text() == "// packages/a\n"
    assert len(git("worktree", "list").splitlines()) == 1


def test_commit_is_the_stamped_one_while_the_tree_is(tool, capsys):
    """`commit` prints the commit TREE was stamped at (and its dirty flag) while every file it lists
    that can change what runs has its bytes; notes and results may differ; any other edit: none."""
    root = tool.ROOT
    stamp_file = root / ".whl" / "mok" / "TREE"
    tool.STAMP = stamp_file
    (root / "NOTES.md").write_text("notes\n")
    (root / "benchmarks/results").mkdir(parents=True)
    (root / "benchmarks/results/r.json").write_text("{}\n")
    head = committed(root, "packages", "NOTES.md", "benchmarks")("rev-parse", "HEAD").strip()
    assert tool.commit() == 1  # no TREE yet
    stamp_file.parent.mkdir(parents=True)
    tool.stamp(root, stamp_file)
    capsys.readouterr()
    assert tool.commit() == 0 and capsys.readouterr().out == f"{head} 0\n"
    (root / "NOTES.md").write_text("more notes\n")
    (root / "benchmarks/results/r.json").write_text('{"new": 1}\n')
    assert tool.commit() == 0 and capsys.readouterr().out == f"{head} 0\n"
    (root / "packages/a/src/k.cu").write_text("// edited\n")
    assert tool.commit() == 1
    assert "packages/a/src/k.cu" in capsys.readouterr().err
    tool.stamp(root, stamp_file)  # stamped with the edit: dirty
    capsys.readouterr()
    assert tool.commit() == 0 and capsys.readouterr().out == f"{head} 1\n"


def test_build_into_a_relative_folder_lands_where_the_caller_names_it(tool, monkeypatch, tmp_path):
    """`--out DIR` relative to the caller's directory: pip runs in the tree it builds (a base's
    worktree), so the folder must be made absolute first (session 30: the patched build's wheels
    went into the worktree and were removed with it)."""
    root = tool.ROOT
    committed(root, "packages")
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)

    def pip(args, cwd=None, env=None, check=False, **kw):  # a wheel named for the package, as pip would
        if "wheel" in args:
            folder = Path(args[args.index("-w") + 1])
            folder = folder if folder.is_absolute() else Path(cwd) / folder
            (folder / f"{Path(args[-1]).name.replace('-', '_')}-0-py3-none-any.whl").write_text("")
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(
        tool.subprocess, "run", lambda args, **kw: pip(args, **kw) if "pip" in args else _real_run(args, **kw)
    )
    tool.build("python3", root, Path(".whl/mok-x"))
    made = sorted(p.name for p in (caller / ".whl/mok-x").glob("*.whl"))
    assert made == ["a-0-py3-none-any.whl", "b-0-py3-none-any.whl", "mok_torch-0-py3-none-any.whl"]
    assert (caller / ".whl/mok-x/TREE").read_text().startswith("commit ")
    assert not (root / ".whl/mok-x").exists()


_real_run = subprocess.run


def _fake_wheel(path: Path, files: dict[str, str]) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


def test_sonic_wheels_packed_with_libs_base_as_a_tarball(tool, tmp_path):
    """`sonic`: the downloaded wheels into the folder, the libs-base wheel's files as an xz tarball
    (what gpu-check's sonic stages untar into their site folder), the rest as they are; a
    download that lacks a wheel is an error naming the folder."""
    import tarfile

    got = tmp_path / "dl"
    got.mkdir()
    names = [spec.split("==")[0].replace("-", "_") + "-1.0-py3-none-any.whl" for spec in tool.SONIC_WHEELS]
    for name in names:
        files = {"pkg/__init__.py": f"# {name}\n"}
        if name.startswith(tool.LIBS_BASE):
            name = tool.LIBS_BASE + "4.4.2-cp312-cp312-manylinux_2_28_x86_64.whl"
            files = {"nvidia_cutlass_dsl/lib/libx.so": "binary", "libs_base.dist-info/RECORD": ""}
        _fake_wheel(got / name, files)
    out = tmp_path / "sonic"
    (out / "stale.whl").parent.mkdir()
    (out / "stale.whl").write_text("from an earlier run")
    written = tool.pack_sonic(got, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written)
    assert len(written) == len(tool.SONIC_WHEELS) and not (out / "stale.whl").exists()
    tarball = out / "cutlass_dsl_libs_base-4.4.2.tar.xz"
    with tarfile.open(tarball) as t:
        members = {m.name.removeprefix("./") for m in t.getmembers() if m.isfile()}
        assert members == {"nvidia_cutlass_dsl/lib/libx.so", "libs_base.dist-info/RECORD"}
        lib = t.extractfile(next(m for m in t.getmembers() if m.name.endswith("libx.so")))
        assert lib is not None and lib.read() == b"binary"
    next(got.glob(tool.LIBS_BASE + "*")).unlink()
    with pytest.raises(SystemExit, match="expected 6 wheels"):
        tool.pack_sonic(got, out)
