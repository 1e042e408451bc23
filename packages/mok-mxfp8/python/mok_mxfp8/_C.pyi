# Type stubs of the compiled module mok_mxfp8._C.
from typing import Any

def version() -> str: ...
def build_info() -> dict[str, Any]: ...
def quantize(
    device: str,
    src: int,
    src_dtype: str,
    batch: int,
    rows: int,
    cols: int,
    src_batch_stride: int,
    src_row_stride: int,
    src_col_stride: int,
    data: int,
    scales: int,
    scale_row_stride: int,
    scale_block_stride: int,
    rule: str = "rceil",
    num_threads: int = 1,
    stream: int = 0,
) -> None: ...

_Weight = tuple[int, int, int, int]  # data, scales, data_t, scales_t

def swiglu_forward(
    device: str,
    x: int,
    experts: int,
    gate: _Weight,
    up: _Weight,
    down: _Weight,
    out_a: int,
    out_b: int,
    out_y: int,
    num_rows: int,
    hidden: int,
    inner: int,
    num_experts: int,
    limit: float | None = None,
    num_threads: int = 1,
    stream: int = 0,
) -> None: ...
def swiglu_backward(
    device: str,
    x: int,
    a: int,
    b: int,
    dy: int,
    router_weights: int,
    experts: int,
    gate: _Weight,
    up: _Weight,
    down: _Weight,
    out_dx: int,
    out_d_w: int,
    acc_gate_up: int,
    acc_down: int,
    num_rows: int,
    hidden: int,
    inner: int,
    num_experts: int,
    limit: float | None = None,
    num_threads: int = 1,
    stream: int = 0,
) -> None: ...
