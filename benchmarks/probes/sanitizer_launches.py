"""Which launch a compute-sanitizer run fails in: the megakernel test's small forward + backward
(tests/bf16/test_megakernel.py, SANITIZE) under one tool, every launch blocking, so that the
first failing launch raises where it was issued and the Python traceback names it.

    python3 benchmarks/probes/sanitizer_launches.py [--backward-sms N] TOOL KERNELS [sanitizer args ...]

TOOL: memcheck, racecheck, synccheck or initcheck; KERNELS: the substring of the kernel names
to instrument (`--kernel-name kns=KERNELS`; the names of a file's kernels hold the file's name),
or `all` (no filter: every kernel of the run, PyTorch's too).
--backward-sms N: the backward's grouped kernels on N SMs (N = 1: the weight gradients without
clusters). Prints the sanitizer's report and the traceback, at most the last 120 lines of each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    args = sys.argv[1:]
    sms = 0
    if args[:1] == ["--backward-sms"]:
        sms, args = int(args[1]), args[2:]
    if len(args) < 2:
        print(__doc__)
        return 2
    tool, kernels, extra = args[0], args[1], args[2:]
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "bf16")]
    from test_megakernel import SANITIZE

    # The launch that faults raises at its own check (mok's launchers read cudaGetLastError after
    # each launch): faulthandler and the traceback then say which call of the layer it was.
    script = "import faulthandler; faulthandler.enable()\n"
    if sms:
        script += (
            "import functools\nfrom mok_torch.backends import native\n"
            f"native.grouped_backward = functools.partial(native.grouped_backward, num_sms={sms})\n"
            f"native.launch_backward = functools.partial(native.launch_backward, num_sms={sms})\n"
        )
    script += SANITIZE
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTORCH_NO_CUDA_MEMORY_CACHING="1", TORCH_SHOW_CPP_STACKTRACES="0")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    which = [] if kernels == "all" else ["--kernel-name", f"kns={kernels}"]
    cmd = [
        "compute-sanitizer",
        f"--tool={tool}",
        *which,
        *extra,
        sys.executable,
        f.name,
        "full",
    ]
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for name, text in (("stdout", out.stdout), ("stderr", out.stderr)):
        lines = text.splitlines()
        print(f"--- {name} ({len(lines)} lines, the last 120)")
        print("\n".join(lines[-120:]))
    print("exit", out.returncode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
