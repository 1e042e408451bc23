"""The `mok` command: `mok demo`, `mok info`, `mok bench` and the component benchmarks `mok bench-*`."""

from __future__ import annotations

import argparse
import json
import sys


def _info(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="mok info", description=f"Print {COMMANDS['info'][0]} as JSON.").parse_args(argv)
    import torch

    import mok_torch as mok
    from mok_torch.backends import entry_point_errors
    from mok_torch.backends.native import describe_expert_paths

    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {
        "mok_torch": mok.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "backends": {p: mok.available_backends(p, device) for p in ("bf16", "mxfp8")},
        "auto": {p: _auto(p, device) for p in ("bf16", "mxfp8")},
        # what runs the routed experts with the default config at one rank (H, I multiples of 64)
        "expert_paths": describe_expert_paths(torch.device(device)),
        "compiled_packages": mok.compiled_packages(),
        "entry_point_errors": entry_point_errors(),
    }
    print(json.dumps(info, indent=2))
    return 0


def _auto(precision: str, device: str) -> str:
    import mok_torch as mok

    try:
        return mok.resolve_backend(mok.MoKConfig(precision=precision), device).name
    except ValueError as exc:
        return f"none ({exc})"


COMMANDS = {
    "demo": ("train a small MoE model twice and check the runs agree bitwise", "mok_torch.demo:main"),
    "info": ("versions, compiled packages and the backends available here", None),
    "bench": ("the layer benchmark against baselines (torchrun for several GPUs)", "mok_torch.bench:main"),
    "bench-transport": ("dispatch/combine GB/s, barrier latency, schedule time", "mok_torch.bench.transport:main"),
    "bench-quantize": ("MXFP8 quantizer GB/s (activations, weights) against the HBM copy rate", None),
    "bench-experts": ("BF16 expert GEMMs (GPU) against torch._grouped_mm and the dense matmul rate", None),
    "bench-mxfp8": ("MXFP8 expert GEMMs (GPU) against torch._scaled_grouped_mm, mok's BF16 and the dense rates", None),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(
            prog="mok",
            description=__doc__,
            epilog="`mok COMMAND --help` shows a command's options.",
        )
        sub = parser.add_subparsers(dest="command", required=True)
        for name, (help_text, _) in COMMANDS.items():
            sub.add_parser(name, help=help_text)
        parser.parse_args(argv)  # prints usage / the error and exits
        return 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        return _info(rest)
    if command == "bench-transport":
        from mok_torch.bench.transport import main as transport_main

        return transport_main(rest)
    if command == "bench-quantize":
        from mok_torch.bench.quantize import main as quantize_main

        return quantize_main(rest)
    if command == "bench-experts":
        from mok_torch.bench.experts import main as experts_main

        return experts_main(rest)
    if command == "bench-mxfp8":
        from mok_torch.bench.mxfp8 import main as mxfp8_main

        return mxfp8_main(rest)
    if command == "bench":
        from mok_torch.bench import main as bench_main

        return bench_main(rest)
    from mok_torch.demo import main as demo_main

    return demo_main(rest)


if __name__ == "__main__":
    sys.exit(main())
