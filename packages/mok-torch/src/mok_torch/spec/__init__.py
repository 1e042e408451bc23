"""The arithmetic every mok backend is held to: the definitions, in plain PyTorch.

- `arith`: the fixed rounding sequences (sequential fp32 sums, the float64 exp).
- `experts`: the SwiGLU experts, their backward, the weight gradients and the combine.
- `schedule`: the schedule table, the send side and each route's row (docs/design.md §6).
- `ring`: the walk over the table's rows in minibatches and macrobatches (docs/design.md §8).

The reference backend (`backends/reference`) is these definitions run as a layer, with torch
collectives for the rows; the native backends run them where no kernel does, and every kernel
is tested bitwise against them.
"""
