# Type stubs of the compiled module mok_bf16._C.
from typing import Any

def version() -> str: ...
def build_info() -> dict[str, Any]: ...
def swiglu_forward(
    device: str,
    x: int,
    experts: int,
    w_gate: int,
    w_up: int,
    w_down: int,
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
def grouped_forward(
    device: str,
    x: int,
    offsets: int,
    w_gate: int,
    w_up: int,
    w_down: int,
    out_a: int,
    out_b: int,
    out_h: int,
    out_y: int,
    num_rows: int,
    hidden: int,
    inner: int,
    num_experts: int,
    limit: float | None = None,
    num_sms: int = 0,
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
    w_gate: int,
    w_up: int,
    w_down: int,
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
def exp_f64(x: int, out: int, count: int) -> None: ...
def sigmoid(a: int, out: int, count: int) -> None: ...
