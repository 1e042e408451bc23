"""The layer benchmark (`mok bench`): the quick run's JSON, the baselines against mok, EP 2,
and the README table generator. CPU only and fast: the benchmark's speed is not tested."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_close
from multiproc import run_ranks

from mok_torch import MoKConfig, resolve_backend
from mok_torch.bench import floors, launch
from mok_torch.bench.inputs import LayerCall, make_call, make_weights
from mok_torch.bench.providers import (
    MokProvider,
    Settings,
    TorchA2AProvider,
    TorchLoopProvider,
    make_providers,
    saved_bytes_by_hooks,
)
from mok_torch.bench.runner import bitwise_repeatable
from mok_torch.bench.shapes import Shape, resolve_shapes
from mok_torch.bench.timing import Ranks
from mok_torch.cli import main as mok_main

ROOT = Path(__file__).resolve().parents[2]
CPU = Ranks(torch.device("cpu"), None, 0, 1)
SETTINGS = Settings(allow_slow=False)
# These are CPU tests of the harness (the GPU code paths run in tools/gpu-check's bench stage).
FAST = ["--iters", "2", "--warmup", "1", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a busy 2-core machine OpenMP barriers make tiny ops take ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _report(out: Path) -> dict:
    files = sorted(out.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_quick_run_writes_the_report(tmp_path, capsys):
    assert mok_main(["bench", "--quick", *FAST, "--out", str(tmp_path)]) == 0
    # Not a terminal: one progress line per finished step, no bar redrawn on one line.
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mok bench: ")]
    assert "\r" not in "".join(progress) and len(progress) >= 2, progress
    done, total = progress[-1].split()[2].split("/")
    assert done == total == str(1 + 2 * 3), progress[-1]  # the ceilings, then 2 shapes x 3 providers
    # ... and a line as each part of the work starts (a provider's first call may take minutes).
    started = [line.split(", now ", 1)[1] for line in progress if ", now " in line]
    assert started[0] == "ceilings", started
    for shape in ("quick", "quick-shared"):
        assert f"{shape} balanced forward" in started and f"{shape} balanced mok" in started, started
    report = _report(tmp_path)
    name = sorted(tmp_path.glob("*.json"))[0].name
    assert name.endswith("_cpu_layer-ep1-quick.json") and name[:4].isdigit()
    assert (tmp_path / name).with_suffix(".png").exists()
    assert report["world_size"] == 1 and report["device"]["type"] == "cpu"
    assert report["versions"]["torch"] == torch.__version__
    assert report["command"].startswith("mok bench --quick")
    assert set(report["ceilings"]) == {"bf16_matmul", "fp8_matmul", "hbm", "nvlink"}
    assert all(c["value"] is None and c["skipped"] for c in report["ceilings"].values())
    rows = report["results"]
    assert {(r["shape"]["name"], r["provider"]) for r in rows} == {
        (s, p) for s in ("quick", "quick-shared") for p in ("mok", "torch-a2a", "torch-loop")
    }
    for r in rows:
        assert r["status"] == "ok", r["reason"]
        for p in ("forward", "forward+backward"):
            assert r["ms"][p] > 0 and r["tflops"][p] > 0
            assert len(r["times_ms"][p]) == 2 and min(r["times_ms"][p]) > 0
            assert r["floor_fraction"][p] is None and r["peak_mib"][p] is None  # no ceilings, no CUDA
            assert r["floor"][p]["flops"] > 0 and r["floor"][p]["hbm_bytes"] > 0
            assert r["floor"][p]["nvlink_bytes"] == 0
            assert r["back_to_back_ms"][p] > 0
        assert r["saved_mib"] > 0 and r["deterministic"] is True
        assert r["speedup_vs_torch_a2a"]["forward"] > 0
    mok = next(r for r in rows if r["provider"] == "mok")
    assert mok["backend"] == resolve_backend(MoKConfig(), "cpu").name
    assert mok["saved_method"].startswith("mok ForwardContext")


def test_skips_are_reported_with_a_reason(tmp_path):
    # One rank: three seed slices cannot be routed; the reference backend is too slow for the
    # fourth, and the CPU for every real shape; the optional libraries are not installed here.
    argv = ["--shapes", "seed,mixtral-8x7b", "--providers", "mok,torch-a2a,deepep,sonicmoe", "--backend", "reference"]
    assert launch.main([*argv, "--no-plot", *FAST, "--out", str(tmp_path)]) == 0
    rows = _report(tmp_path)["results"]
    assert len(rows) == 5 * 4 and all(r["status"] == "skipped" for r in rows)
    by = {(r["shape"]["name"], r["provider"]): r["reason"] for r in rows}
    assert "fewer than K=8" in by[("kimi-k2.7-code", "mok")]
    assert by[("deepseek-v4-pro", "mok")].startswith("reference backend: its experts run the reference arithmetic")
    assert by[("mixtral-8x7b", "torch-a2a")] == "too big for a CPU run (use --allow-slow)"
    assert by[("deepseek-v4-pro", "deepep")].startswith("not importable")


def test_mxfp8_experts_are_skipped_at_real_shapes(tmp_path):
    """No FP8 kernels yet: MXFP8 runs the reference arithmetic on every backend, so the real
    shapes are skipped with that reason (the native cpu backend has bf16 kernels, not FP8)."""
    argv = ["--shapes", "deepseek-v4-pro", "--providers", "mok", "--precision", "mxfp8", "--no-plot", *FAST]
    assert launch.main([*argv, "--out", str(tmp_path)]) == 0
    (row,) = _report(tmp_path)["results"]
    assert row["status"] == "skipped" and "MXFP8 experts run the reference arithmetic" in row["reason"]


def test_shapes():
    seed = {s.name: s for s in resolve_shapes("seed", 2)}
    assert (seed["kimi-k2.7-code"].experts, seed["kimi-k2.7-code"].local_experts) == (12, 6)
    assert seed["qwen3.5-397b-a17b"].shared_inner == 1024 and seed["glm-5.2"].tokens == 2048
    public = {s.name: s for s in resolve_shapes("public", 1)}
    assert public["deepseek-v3"].shared_inner == 2048 and public["qwen3-30b-a3b"].shared_inner == 0
    assert public["mixtral-8x7b"].tokens == 8192
    assert resolve_shapes("mixtral-8x7b", 3)[0].skip is not None  # 8 experts over 3 ranks
    (custom,) = resolve_shapes("H=64,I=32,E=8,K=2,T=5,Is=16", 2)
    assert (custom.hidden, custom.local_experts, custom.tokens, custom.shared_inner) == (64, 4, 5, 16)
    assert len(resolve_shapes("all", 1)) == 9
    sonic = {s.name: s for s in resolve_shapes("sonic", 1)}
    assert set(sonic) == {"sonic-7b", "qwen3-30b-a3b", "deepseek-v3-e32", "mixtral-8x7b"}
    assert (sonic["sonic-7b"].tokens, sonic["sonic-7b"].inner, sonic["sonic-7b"].experts) == (24576, 256, 128)
    assert all(s.shared_inner == 0 for s in sonic.values()) and sonic["deepseek-v3-e32"].experts == 32
    with pytest.raises(ValueError, match="unknown shape"):
        resolve_shapes("nope", 1)


def test_flops_and_floors():
    # The seed's count: torch-a2a's kimi-k2.7-code slice at 6.41 / 13.97 ms is 253 / 349 TFLOP/s.
    kimi = resolve_shapes("kimi-k2.7-code", 2)[0]
    assert round(floors.pass_flops(kimi, "forward") / 6.41e-3 / 1e12) == 253
    assert round(floors.pass_flops(kimi, "forward+backward") / 13.97e-3 / 1e12) == 349
    # Two ranks, one expert each: rank 0 keeps 2 routes and sends 1 token; rank 1 keeps 3.
    shape = Shape("t", "custom", 4, 2, 2, 1, 3, 0, 2)
    routes = pairs = [[2.0, 1.0], [0.0, 3.0]]
    fwd1, bwd1 = floors.rank_traffic(shape, routes, pairs, 1)
    assert fwd1.flops == 6 * 4 * 2 * 4 and bwd1.flops == 2 * fwd1.flops  # 4 rows land on rank 1
    assert fwd1.nvlink_bytes == 2 * 4 * 1 and bwd1.nvlink_bytes == fwd1.nvlink_bytes  # one token crosses
    weights, context = 2 * 3 * 4 * 2, 2 * 4 * (4 + 2 * 2)
    assert fwd1.hbm_bytes == 2 * 2 * 3 * 4 + weights + context + 8 * 3
    assert bwd1.hbm_bytes == 2 * 2 * 3 * 4 + 2 * weights + context + 4 * 3
    got = floors.layer_floors(shape, routes, pairs, matmul_tflops=1e-9, hbm_gbps=1e3, nvlink_gbps=1e3)
    assert got["forward"].rank == 1 and got["forward"].bound == "matmul"
    assert got["forward"].ms == pytest.approx(fwd1.flops / 1e3 * 1e3)
    none = floors.layer_floors(shape, routes, pairs, matmul_tflops=None, hbm_gbps=None, nvlink_gbps=None)
    assert none["forward+backward"].ms is None


def _forward_backward(forward, call: LayerCall) -> dict[str, torch.Tensor]:
    call.drop_grads()
    y = forward()
    y.backward(call.dy_TH)
    names = ["dx", "d_router_weights", "dWg", "dWu", "dWd", "dWg_s", "dWu_s", "dWd_s"]
    out = {"y": y.detach()}
    out.update({n: g for n, g in zip(names, call.grads(), strict=False) if g is not None})
    call.drop_grads()
    return out


@pytest.mark.parametrize("routing", ["balanced", "worst"])
@pytest.mark.parametrize("shared", [0, 24])
def test_baselines_match_mok(routing, shared):
    """torch-a2a and torch-loop compute the layer mok computes (bf16 tolerance), gradients too.

    `worst` leaves most experts empty: torch-a2a then pads them with zero rows.
    """
    shape = Shape("t", "custom", 48, 40, 8, 3, 37, shared, 1)
    call = make_call(shape, routing, make_weights(shape, CPU), CPU)
    want = _forward_backward(MokProvider("mok", "reference", "bf16").prepare(call, CPU, SETTINGS), call)
    for provider in (TorchA2AProvider(compiled=False), TorchLoopProvider()):
        got = _forward_backward(provider.prepare(call, CPU, SETTINGS), call)
        assert set(got) == set(want)
        for key in want:
            assert_close(f"{provider.name} {key}", got[key], want[key])


def test_a_providers_own_weights_are_leaves_of_the_call():
    """A provider that runs on weights of its own (SonicMoE's, in its layout) adds them to the
    call's leaves: their gradients are dropped with the call's (before every timed call and every
    peak pass, so a peak counts them as it counts mok's), compared by the bitwise check, and they
    are inputs, not activations saved for the backward."""
    shape = Shape("t", "custom", 48, 40, 8, 3, 37, 0, 1)
    call = make_call(shape, "balanced", make_weights(shape, CPU), CPU)
    own = call.routed[0].detach().clone().requires_grad_()  # [E, I, H]: the provider's copy

    def forward() -> torch.Tensor:
        return (call.x_TH @ own[0].T) @ own[0]  # saves x, a view of `own` and the [T, I] product

    product = shape.tokens * shape.inner * call.x_TH.element_size()
    assert saved_bytes_by_hooks(call, forward) == product + own.nbytes  # not yet a leaf: counted
    call.extra_leaves.append(own)
    assert saved_bytes_by_hooks(call, forward) == product
    forward().backward(call.dy_TH)
    assert own.grad is not None and any(g is own.grad for g in call.grads())
    assert bitwise_repeatable(CPU, forward, call)
    assert own.grad is None  # the check drops the gradients it made
    forward().backward(call.dy_TH)
    call.drop_grads()
    assert own.grad is None and all(g is None for g in call.grads())


def bench_rank(rank: int, world: int, group, out: str) -> dict:
    """One rank of a 2-rank quick bench, and torch-a2a against mok over the group."""
    ranks = Ranks(torch.device("cpu"), group, rank, world)
    opts, _ = launch.options_from(
        ["--quick", "--shapes", "quick-shared", "--routing", "skewed,worst", "--no-plot", *FAST, "--out", out]
    )
    report = json.dumps(launch.bench(opts, ranks))  # plain text: results come back through torch.load
    shape = resolve_shapes("H=48,I=40,E=8,K=3,T=29,Is=24", world)[0]
    call = make_call(shape, "skewed", make_weights(shape, ranks), ranks)
    mok_out = _forward_backward(MokProvider("mok", "reference", "bf16").prepare(call, ranks, SETTINGS), call)
    a2a_out = _forward_backward(TorchA2AProvider(compiled=False).prepare(call, ranks, SETTINGS), call)
    (push_pull,) = make_providers(["mok-push-pull"], ["cpu"], "bf16")
    assert push_pull.config.dispatch == "push" and push_pull.config.combine == "pull"
    moved = _forward_backward(push_pull.prepare(call, ranks, SETTINGS), call)
    return {"report": report, "mok": mok_out, "torch-a2a": a2a_out, "mok-push-pull": moved}


@pytest.mark.multiprocess
def test_two_ranks_on_gloo(tmp_path):
    per_rank = run_ranks(2, "test_bench.bench_rank", str(tmp_path))
    written = _report(tmp_path)  # rank 0 writes, alone
    assert written["world_size"] == 2 and "ep2" in sorted(tmp_path.glob("*.json"))[0].name
    rows = {(r["routing"], r["provider"]): r for r in written["results"]}
    for routing in ("skewed", "worst"):
        for provider in ("mok", "torch-a2a"):
            r = rows[(routing, provider)]
            assert r["status"] == "ok", r["reason"]
            assert r["ms"]["forward+backward"] > 0 and r["deterministic"] is True
            assert r["floor"]["forward"]["nvlink_bytes"] > 0  # tokens cross between the ranks
        assert rows[(routing, "torch-loop")]["status"] == "skipped"
    # every rank got the same report figures (medians are maxima over ranks)
    assert json.loads(per_rank[0]["report"])["results"] == json.loads(per_rank[1]["report"])["results"]
    for res in per_rank:
        for key, want in res["mok"].items():
            assert_close(f"EP 2 torch-a2a {key}", res["torch-a2a"][key], want)
            # the other directions move the same bytes: the cpu backend is bitwise the reference
            assert torch.equal(res["mok-push-pull"][key], want), key


def _synthetic_report(created: str, ms: float) -> dict:
    row = {
        "shape": {"name": "deepseek-v4-pro"},
        "routing": "balanced",
        "provider": "torch-a2a",
        "backend": None,
        "precision": "bf16",
        "status": "ok",
        "reason": None,
        "ms": {"forward": ms, "forward+backward": 2 * ms},
        "tflops": {"forward": 328.0, "forward+backward": 398.0},
        "floor_fraction": {"forward": 0.41, "forward+backward": 0.52},
        "speedup_vs_torch_a2a": {"forward": 1.0, "forward+backward": 1.0},
        "peak_mib": {"forward": 900.0, "forward+backward": 1800.0},
        "saved_mib": 350.0,
        "deterministic": False,
    }
    skipped = dict(row, provider="deepep", status="skipped", reason="not importable (deep_ep: ModuleNotFoundError)")
    return {
        "schema": "mok-bench-layer/1",
        "created": created,
        "device": {"type": "cuda", "name": "NVIDIA H200"},
        "world_size": 2,
        "config": {"precision": "bf16", "quick": False},
        "results": [row, skipped],
    }


def test_readme_table_leaves_out_runs_without_the_baseline(tmp_path):
    """A run without torch-a2a (a study of mok's own settings) gives the table no rows: its rows
    would have no speedup beside them; the runs with the baseline keep theirs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_table
    finally:
        sys.path.pop(0)
    with_baseline = _synthetic_report("2026-12-01T10:00:00+00:00", 9.0)
    with_baseline["config"]["providers"] = ["mok", "torch-a2a"]
    study = _synthetic_report("2026-12-02T10:00:00+00:00", 5.0)
    study["config"]["providers"] = ["mok", "mok-push-pull"]
    for name, report in (("a.json", with_baseline), ("b.json", study)):
        (tmp_path / name).write_text(json.dumps(report))
    runs = readme_table.load_runs(tmp_path, all_runs=False)
    assert [path.name for _, path in runs] == ["a.json"]
    assert len(readme_table.load_runs(tmp_path, all_runs=True)) == 2


def test_readme_table_leaves_out_runs_of_code_not_on_main(tmp_path):
    """A run marked not_on_main (its code did not land) keeps its file but gives the table no
    rows, even when it is the newest."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_table
    finally:
        sys.path.pop(0)
    landed = _synthetic_report("2026-12-01T10:00:00+00:00", 9.0)
    variant = _synthetic_report("2026-12-02T10:00:00+00:00", 5.0)
    variant["not_on_main"] = "a kernel variant measured and not merged"
    for name, report in (("a.json", landed), ("b.json", variant)):
        (tmp_path / name).write_text(json.dumps(report))
    runs = readme_table.load_runs(tmp_path, all_runs=False)
    assert [path.name for _, path in runs] == ["a.json"]
    rows, _ = readme_table.latest_rows(runs)
    assert {r["ms"]["forward"] for r in rows if r.get("status") != "skipped"} == {9.0}
    assert len(readme_table.load_runs(tmp_path, all_runs=True)) == 2


def test_readme_table_drops_a_skip_once_a_newer_run_measured_the_provider():
    """A skip's reason is a fact about its run's code: a later measurement of the same provider
    and shape (any routing) retires it; a skip newer than every measurement stays."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_table
    finally:
        sys.path.pop(0)
    old = _synthetic_report("2026-12-01T10:00:00+00:00", 9.0)
    old["results"] = [dict(r, routing=routing, provider="mok", status="skipped", reason="too slow")
                      for r in old["results"][:1] for routing in ("balanced", "skewed")]  # fmt: skip
    new = _synthetic_report("2026-12-02T10:00:00+00:00", 5.0)
    new["results"] = [dict(new["results"][0], provider="mok"), new["results"][1]]  # mok measured, balanced only
    rows, _ = readme_table.latest_rows([(old, Path("old.json")), (new, Path("new.json"))])
    got = {(r["routing"], r["provider"]): r["status"] for r in rows}
    assert got == {("balanced", "mok"): "ok", ("balanced", "deepep"): "skipped"}
    rows, _ = readme_table.latest_rows([(old, Path("old.json"))])
    assert {r["status"] for r in rows} == {"skipped"} and len(rows) == 2


def test_readme_table_is_generated_and_idempotent(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    (results / "old.json").write_text(json.dumps(_synthetic_report("2026-12-01T10:00:00+00:00", 9.99)))
    (results / "new.json").write_text(json.dumps(_synthetic_report("2026-12-02T10:00:00+00:00", 5.78)))
    cpu = _synthetic_report("2026-12-03T10:00:00+00:00", 1.0)
    cpu["device"] = {"type": "cpu", "name": "x86_64"}
    (results / "cpu.json").write_text(json.dumps(cpu))
    script = [sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--readme", str(readme)]
    script += ["--results", str(results)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run(script, check=True, capture_output=True, env=env)
    text = readme.read_text()
    table = text[text.index("<!-- bench-table:start -->") : text.index("<!-- bench-table:end -->")]
    assert "| NVIDIA H200 | 2 | bf16 | deepseek-v4-pro | balanced | torch-a2a | 5.78 | 11.6 |" in table
    assert "9.99" not in table and "x86_64" not in table  # the latest GPU run only
    assert "- deepep — not importable" in table and "results/new.json`" in table  # skips folded into a list
    outside = _outside_markers(text.replace(table, _between_markers(ROOT / "README.md")))
    assert outside == _outside_markers((ROOT / "README.md").read_text())  # only the tables change
    subprocess.run(script, check=True, capture_output=True, env=env)
    assert readme.read_text() == text
    assert subprocess.run([*script, "--check"], capture_output=True, env=env).returncode == 0


def test_readme_component_tables_come_from_the_latest_gpu_run(tmp_path):
    """The expert-GEMM, MXFP8 GEMM and quantizer tables: the newest GPU run of each, CPU runs ignored."""
    results = tmp_path / "results"
    results.mkdir()
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)

    def experts(created: str, tflops: float, device_type: str = "cuda") -> dict:
        ok = {"status": "ok", "TFLOPs": tflops, "bitwise_repeatable": True}
        row = {"shape_name": "kimi-k2.7-code", "routing": "balanced", "rows": 16416, "mok": ok,
               "mok-gate-up": ok, "mok-gate-up-ab": ok, "torch-grouped-mm": dict(ok, TFLOPs=500.0),
               "speedup_vs_torch": tflops / 500.0}  # fmt: skip
        return {"schema": "mok-bench-experts/1", "created": created, "device": {"type": device_type, "name": "H"},
                "ceilings": {"bf16_matmul": {"value": 700.0}}, "results": [row]}  # fmt: skip

    quantize = {"schema": "mok-bench-quantize/1", "created": "2026-12-01T00:00:00+00:00",
                "device": {"type": "cuda", "name": "H"}, "ceilings": {"hbm": {"value": 4000.0}},
                "results": [{"shape_name": "glm-5.2", "what": "weights", "same_bytes": True,
                             "compiled": {"status": "ok", "GBps": 812.4, "graph_GBps": 901.6},
                             "torch": {"status": "ok", "GBps": 58.0}}]}  # fmt: skip
    (results / "a.json").write_text(json.dumps(experts("2026-12-01T00:00:00+00:00", 411.0)))
    (results / "b.json").write_text(json.dumps(experts("2026-12-02T00:00:00+00:00", 612.0)))
    (results / "c.json").write_text(json.dumps(experts("2026-12-03T00:00:00+00:00", 3.0, "cpu")))
    (results / "q.json").write_text(json.dumps(quantize))
    ok = lambda t: {"status": "ok", "TFLOPs": t, "bitwise_repeatable": True}  # noqa: E731
    mx_row = {"shape_name": "glm-5.2", "routing": "skewed", "rows": 16400, "mok-mxfp8": ok(277.0),
              "mok-mxfp8-gate-up": ok(312.0), "mok-bf16": ok(583.0), "mok-bf16-gate-up": ok(652.0),
              "torch-scaled": {"status": "failed", "why": "x"}, "torch-scaled-gate-up": ok(940.0),
              "gate_up_speedup_vs_torch_scaled": 312 / 940, "gate_up_speedup_vs_bf16": 312 / 652}  # fmt: skip
    mxfp8 = {
        "schema": "mok-bench-mxfp8/1",
        "created": "2026-12-01T00:00:00+00:00",
        "device": {"type": "cuda", "name": "H"},
        "ceilings": {"bf16_matmul": {"value": 700.0}, "fp8_matmul": {"value": 1200.0}},
        "results": [mx_row],
    }
    (results / "m.json").write_text(json.dumps(mxfp8))
    script = [sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--readme", str(readme)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([*script, "--results", str(results)], check=True, capture_output=True, env=env)
    text = readme.read_text()
    table = text[text.index("<!-- experts-table:start -->") : text.index("<!-- experts-table:end -->")]
    assert "| kimi-k2.7-code | balanced | 16416 | 612 | 612 | 612 | 500 | 1.22x | - | - | - | yes |" in table
    assert "411" not in table and "| 3 |" not in table and "results/b.json`" in table
    assert "dense BF16 matmul 700 TFLOP/s" in table
    qtable = text[text.index("<!-- quantize-table:start -->") : text.index("<!-- quantize-table:end -->")]
    assert "| glm-5.2 | weights | 812 | 902 | 58 | yes |" in qtable and "HBM copy 4000 GB/s" in qtable
    mtable = text[text.index("<!-- mxfp8-table:start -->") : text.index("<!-- mxfp8-table:end -->")]
    assert "| glm-5.2 | skewed | 16400 | 277 | 312 | 583 | 652 | failed | 940 | - | 0.33x | 0.48x | yes |" in mtable
    assert "dense BF16 matmul 700, FP8 1200 TFLOP/s" in mtable


def test_readme_experts_table_keeps_rows_a_newer_partial_run_did_not_measure(tmp_path):
    """Per shape and routing the newest row: a newer run of the balanced rows only replaces
    those and keeps the older skewed ones; every run a row comes from is named, with its rate."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_table
    finally:
        sys.path.pop(0)

    def run(created: str, rows: list[tuple[str, float]], dense: float) -> dict:
        ok = lambda t: {"status": "ok", "TFLOPs": t, "bitwise_repeatable": True}  # noqa: E731
        return {"schema": "mok-bench-experts/1", "created": created, "device": {"type": "cuda", "name": "H"},
                "ceilings": {"bf16_matmul": {"value": dense}},
                "results": [{"shape_name": "glm-5.2", "routing": routing, "rows": 16, "mok": ok(t),
                             "mok-gate-up": ok(t), "mok-gate-up-ab": ok(t), "torch-grouped-mm": ok(500.0),
                             "speedup_vs_torch": t / 500.0} for routing, t in rows]}  # fmt: skip

    results = tmp_path / "results"
    results.mkdir()
    (results / "full.json").write_text(
        json.dumps(run("2026-12-01T00:00:00+00:00", [("balanced", 401.0), ("skewed", 433.0)], 700.0))
    )
    (results / "part.json").write_text(json.dumps(run("2026-12-02T00:00:00+00:00", [("balanced", 612.0)], 750.0)))
    rows = readme_table.latest_experts(results, "mok-bench-experts/1")
    assert [(r["routing"], r["mok"]["TFLOPs"], p.name) for r, _, p in rows] == [
        ("balanced", 612.0, "part.json"),
        ("skewed", 433.0, "full.json"),
    ]
    table = readme_table.render_experts(rows, tmp_path)
    assert "| glm-5.2 | balanced | 16 | 612 |" in table and "| glm-5.2 | skewed | 16 | 433 |" in table
    assert "401" not in table
    assert "`results/full.json` (dense BF16 matmul 700 TFLOP/s in that run)" in table
    assert "`results/part.json` (dense BF16 matmul 750 TFLOP/s in that run)" in table


def _between_markers(path: Path) -> str:
    text = path.read_text()
    return text[text.index("<!-- bench-table:start -->") : text.index("<!-- bench-table:end -->")]


def _outside_markers(text: str) -> str:
    """The README without the generated tables (every start ... end marker pair emptied)."""
    for name in ("bench", "experts", "mxfp8", "quantize"):
        start, end = f"<!-- {name}-table:start -->", f"<!-- {name}-table:end -->"
        text = text[: text.index(start) + len(start)] + text[text.index(end) :]
    return text


def test_transport_bench_runs_on_two_cpu_ranks(tmp_path):
    """`mok bench-transport` end to end over gloo and shared memory (the numbers mean nothing here)."""
    from mok_torch.cli import main

    argv = ["bench-transport", "--shapes", "H=64,I=32,E=8,K=2,T=64", "--nproc", "2", "--iters", "2", "--device", "cpu"]
    assert main([*argv, "--warmup", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_transport-ep2.json")
    doc = json.loads(path.read_text())
    (r,) = doc["results"]
    counts = {"2", "4", "8", "16", "24", "32"}
    assert r["rows"] > 0 and r["remote_rows"] > 0
    assert set(r["pull"]) == counts and set(r["push"]) == counts
    assert r["schedule_ms"] > 0 and r["all_to_all_single"]["ms"] > 0 and r["barrier_us"]["back_to_back"] > 0


def test_quantize_bench_runs_and_checks_both_quantizers(tmp_path):
    from mok_torch.cli import main as mok_main

    assert (
        mok_main(
            [
                "bench-quantize",
                "--shapes",
                "quick",
                "--iters",
                "2",
                "--warmup",
                "1",
                "--device",
                "cpu",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    (path,) = tmp_path.glob("*_quantize.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "mok-bench-quantize/1" and doc["ceilings"]["hbm"] is None  # no HBM on a CPU
    whats = [(r["shape_name"], r["what"]) for r in doc["results"]]
    assert ("quick", "activations") in whats and ("quick", "weights") in whats
    for r in doc["results"]:
        assert r["torch"]["status"] == "ok" and r["torch"]["GBps"] > 0
        if r["compiled"]["status"] == "ok":  # mok-mxfp8 installed: the bytes agree
            assert r["same_bytes"] is True
        else:
            assert "no quantizer" in r["compiled"]["why"]


def test_experts_bench_runs_on_the_cpu(tmp_path):
    """The expert-GEMM benchmark's plumbing (the numbers that matter come from a GPU)."""
    from mok_torch.cli import main as mok_main

    argv = ["bench-experts", "--shapes", "quick", "--iters", "1", "--warmup", "0", "--device", "cpu"]
    assert mok_main([*argv, "--routing", "balanced,skewed", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_experts.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "mok-bench-experts/1"
    rows = [r for r in doc["results"] if r.get("status") != "skipped"]
    assert {r["routing"] for r in rows} == {"balanced", "skewed"}
    for r in rows:
        assert r["rows"] % 16 == 0 and r["rows_per_expert"]["min"] % 16 == 0  # the schedule's alignment
        for name in ("mok", "mok-gate-up", "mok-gate-up-ab", "mok-fwd-bwd", "mok-bwd"):
            assert r[name]["status"] == "ok", (name, r[name])
            assert r[name]["ms"] > 0
        assert r["mok"]["bitwise_repeatable"] is True
        assert r["mok-fwd-bwd"]["bitwise_repeatable"] is True


def test_mxfp8_bench_runs_on_the_cpu(tmp_path):
    """The MXFP8 GEMM benchmark's plumbing: mok's providers run (on the CPU, the reference
    arithmetic), two runs give the same bits, torch's FP8 grouped GEMM is reported, not dropped."""
    pytest.importorskip("mok_mxfp8", reason="mok-mxfp8 is not installed")
    from mok_torch.cli import main as mok_main

    argv = ["bench-mxfp8", "--shapes", "quick", "--iters", "1", "--warmup", "0", "--device", "cpu"]
    assert mok_main([*argv, "--routing", "skewed", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*_mxfp8.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "mok-bench-mxfp8/1"
    rows = [r for r in doc["results"] if r.get("status") != "skipped"]
    assert rows
    for r in rows:
        for name in ("mok-mxfp8", "mok-mxfp8-gate-up", "mok-bf16", "mok-bf16-gate-up"):
            assert r[name]["status"] == "ok", (name, r[name])
            assert r[name]["ms"] > 0
        assert r["mok-mxfp8"]["bitwise_repeatable"] is True
        assert 0 < r["mok-mxfp8"]["rel_diff_vs_bf16"] < 0.1  # MXFP8 against BF16: a few percent
        scaled = r["torch-scaled"]  # reported either way: measured, or failed with the reason
        assert scaled["status"] == "ok" or scaled["why"], scaled


def test_mok_forward_on_the_gpu_gemms_is_timed_at_real_shapes(monkeypatch):
    """Where the cuda backend's forward runs mok-bf16's GEMMs, mok is timed at the real shapes:
    forward and backward with an expert alignment that is a multiple of 64 (the backward runs the
    GPU kernels), `--pass forward` only otherwise (its backward is the reference arithmetic)."""
    from mok_torch.backends import native
    from mok_torch.bench import providers

    monkeypatch.setattr(providers, "resolve_backend", lambda cfg, device: native.NativeBackend("cuda"))
    monkeypatch.setattr(native, "gpu_forward_kernels", lambda *args: True)
    shape = resolve_shapes("kimi-k2.7-code", 2)[0]
    mok_cuda = MokProvider("mok", "cuda", "bf16")
    ranks = Ranks(torch.device("cpu"), None, 0, 2)  # the patched check never looks at the device
    assert mok_cuda.unavailable(shape, ranks, Settings(allow_slow=False, passes=("forward",))) is None
    assert mok_cuda.config.expert_alignment % 64 == 0  # the default
    assert mok_cuda.unavailable(shape, ranks, Settings(allow_slow=False)) is None
    mok_cuda.config = dataclasses.replace(mok_cuda.config, expert_alignment=32)
    assert mok_cuda.unavailable(shape, ranks, Settings(allow_slow=False, passes=("forward",))) is None
    both = mok_cuda.unavailable(shape, ranks, Settings(allow_slow=False))
    assert both is not None and "its backward run the reference arithmetic" in both and "--pass forward" in both
    monkeypatch.setattr(native, "gpu_forward_kernels", lambda *args: False)
    fwd = mok_cuda.unavailable(shape, ranks, Settings(allow_slow=False, passes=("forward",)))
    assert fwd is not None and "its experts run the reference arithmetic" in fwd


def _logged_calls(log: list[str], names: str = "abc", fail: str = "", on: int = 0) -> dict:
    """A call per name that appends its name to `log`; `fail`'s call raises on its `on`-th run."""

    def call(name: str):
        def fn() -> None:
            log.append(name)
            if name == fail and log.count(name) == on:
                raise RuntimeError(f"{name} broke")

        return fn

    return {name: call(name) for name in names}


def test_providers_are_timed_in_turns():
    """time_in_turns: every call warmed up first, then iteration i of each before i + 1 of any, in
    balanced_turns' orders (a b c, then a c b); a call that raises is reported with its exception
    and the others go on; preceded_by names the call that ran before each timed one."""
    from mok_torch.bench.timing import Ranks, time_in_turns

    calls: list[str] = []
    ranks = Ranks(torch.device("cpu"), None, 0, 1)
    before: dict[str, list[str | None]] = {}
    got = time_in_turns(ranks, _logged_calls(calls, fail="b", on=3), iters=3, warmup=1, preceded_by=before)
    assert calls == ["a", "b", "c", "a", "b", "c", "a", "c", "b", "a", "c"]
    assert isinstance(got["b"], RuntimeError) and "b broke" in str(got["b"])
    for name in ("a", "c"):
        times = got[name]
        assert isinstance(times, list) and len(times) == 3 and all(t >= 0 for t in times)
    assert before == {"a": ["c", "c", "b"], "b": ["a"], "c": ["b", "a", "a"]}


@pytest.mark.parametrize("n", range(1, 8))
def test_balanced_turns_put_every_call_after_every_other_equally_often(n):
    """balanced_turns(n): permutations of range(n) whose cyclic concatenation has every ordered
    pair of two different calls once and no call after itself (n >= 2)."""
    from collections import Counter

    from mok_torch.bench.timing import balanced_turns

    orders = balanced_turns(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    seq = [c for o in orders for c in o]
    pairs = Counter((seq[i], seq[(i + 1) % len(seq)]) for i in range(len(seq)))
    if n >= 2:
        assert pairs == Counter({(a, b): 1 for a in range(n) for b in range(n) if a != b})
    assert balanced_turns(n) == orders  # the same orders every run


def test_back_to_back_rounds_are_taken_in_turns():
    """back_to_back_in_turns: round r of every call before round r + 1 of any, in balanced_turns'
    orders; 4 rounds by default for three calls (3 for one); a call that raises is reported with its
    exception and the others go on."""
    from mok_torch.bench.timing import Ranks, back_to_back_in_turns

    log: list[str] = []
    ranks = Ranks(torch.device("cpu"), None, 0, 1)
    got = back_to_back_in_turns(ranks, _logged_calls(log, fail="b", on=3), calls=2)
    # rounds of 2 calls: a b c, then a c b (b raises on its third call), then a c, a c
    assert log == ["a", "a", "b", "b", "c", "c", "a", "a", "c", "c", "b", "a", "a", "c", "c", "a", "a", "c", "c"]
    assert isinstance(got["b"], RuntimeError) and "b broke" in str(got["b"])
    assert all(isinstance(got[n], float) and got[n] >= 0 for n in ("a", "c"))
    log.clear()
    back_to_back_in_turns(ranks, _logged_calls(log, names="a"), calls=1)
    assert log == ["a", "a", "a"]


def test_back_to_back_times_a_call_among_calls_issued_together():
    """back_to_back_ms: `rounds` rounds of `calls` calls, before() ahead of each call, the median
    round's time divided by its calls; bad counts are refused by name."""
    from mok_torch.bench.timing import Ranks, back_to_back_ms

    log: list[str] = []
    ranks = Ranks(torch.device("cpu"), None, 0, 1)

    def fn() -> None:
        log.append("call")
        time.sleep(0.004)

    ms = back_to_back_ms(ranks, fn, calls=4, rounds=3, before=lambda: log.append("before"))
    assert log == ["before", "call"] * 12
    assert 4.0 <= ms < 40.0, ms  # a call's 4 ms sleep, not a round's 16 ms nor a fraction of it
    for bad in ({"calls": 0}, {"rounds": 0}):
        with pytest.raises(ValueError, match="calls and rounds"):
            back_to_back_ms(ranks, fn, **bad)


def test_untrustworthy_times_are_flagged():
    from mok_torch.bench.report import timing_warnings

    def row(fwd, fb, times):
        return {"status": "ok", "shape": {"name": "quick"}, "routing": "balanced", "provider": "mok",
                "ms": {"forward": fwd, "forward+backward": fb}, "times_ms": {"forward": times}}  # fmt: skip

    assert timing_warnings([row(1.0, 3.0, [1.0, 1.1])]) == []
    backwards = timing_warnings([row(228.0, 6.7, [1.0, 1.1])])
    assert len(backwards) == 1 and "took longer than the forward + backward" in backwards[0]
    noisy = timing_warnings([row(1.0, 3.0, [1.0, 228.0])])
    assert len(noisy) == 1 and "spread 1-228 ms (228.0x)" in noisy[0]
    assert timing_warnings([{"status": "skipped"}]) == []
    # times that depend on the call before (medians 1.0 after a, 1.1 after b: 10 % apart), 5 of each
    after = dict(row(1.0, 3.0, [1.0, 1.1] * 5), preceded_by={"forward": ["a", "b"] * 5})
    moved = timing_warnings([after])
    assert moved == [
        "quick balanced mok forward: its time depends on the call before it (after a 1 ms, after b 1.1 ms)"
    ]
    few = dict(after, times_ms={"forward": [1.0, 1.1] * 4}, preceded_by={"forward": ["a", "b"] * 4})
    assert timing_warnings([few]) == []  # 4 iterations after each: too few to tell
    after["preceded_by"]["forward"] = ["a", "b"] * 5 + [None]  # None left out; 1.0 and 1.02 within 3 %
    assert timing_warnings([dict(after, times_ms={"forward": [1.0, 1.02] * 5 + [1.5]})]) == []
    after["preceded_by"]["forward"] = ["a"]  # a record of another length: nothing to group
    assert timing_warnings([after]) == []


def test_git_state_takes_the_stamped_commit_where_given(monkeypatch):
    """bench.report.git_state: MOK_GIT_COMMIT / MOK_GIT_DIRTY (tools/gpu-check on a GPU machine,
    from tools/gpu_wheels.py commit) over the working directory's git metadata."""
    from mok_torch.bench.report import git_state

    monkeypatch.setenv("MOK_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("MOK_GIT_DIRTY", "1")
    assert git_state() == {"commit": "0123abc", "dirty": True}
    monkeypatch.setenv("MOK_GIT_DIRTY", "0")
    assert git_state() == {"commit": "0123abc", "dirty": False}
    monkeypatch.delenv("MOK_GIT_COMMIT")
    assert git_state()["commit"] != "0123abc"
