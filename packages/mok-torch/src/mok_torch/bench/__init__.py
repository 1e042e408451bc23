"""The layer benchmark (docs/benchmarks.md): `mok bench`, or `python -m mok_torch.bench`.

shapes    the seed slices, public models, custom and quick shapes, resolved per EP size
inputs    one rank's random weights, activations and routing of a case
providers mok and the baselines (torch-a2a, torch-a2a-compile, torch-loop, deepep, sonicmoe)
timing    CUDA-event / perf_counter timing, per-iteration maximum over ranks
ceilings  the machine's matmul, HBM and NVLink rates, measured first
floors    flop counts and the least traffic of a call: the floor a provider is held to
runner    every figure of every (shape, routing, provider) case
report    the JSON, the plot, the plain-text and markdown tables
launch    options, processes (torchrun or --nproc), output
"""

from __future__ import annotations

from .launch import main

__all__ = ["main"]
