# Type stubs of the compiled module mok_core._C.
from typing import Any

def version() -> str: ...
def build_info() -> dict[str, Any]: ...
def cuda_device_count() -> int: ...
def cuda_device_properties(index: int) -> dict[str, Any]: ...
def schedule_capacity(world_size: int, max_tokens: int, topk: int, num_local_experts: int, alignment: int) -> int: ...
def build_table(
    device: str,
    routes_ptrs: int,
    tokens_ptrs: int,
    world_size: int,
    max_tokens: int,
    topk: int,
    rank: int,
    num_local_experts: int,
    alignment: int,
    capacity: int,
    row_src_rank: int,
    row_route: int,
    expert_offsets: int,
    expert_counts: int,
    recv_counts: int,
    tokens_per_rank: int,
    stream: int = 0,
    route_row_ptrs: int = 0,
    scratch: int = 0,
    error: int = 0,
    local_routes: bool = False,
    routes: int = 0,
    routes_int64: bool = False,
    num_tokens: int = 0,
    route_row: int = 0,
    routes_copy: int = 0,
) -> None: ...
def build_send_side(
    device: str,
    top_experts: int,
    num_tokens: int,
    topk: int,
    num_local_experts: int,
    world_size: int,
    send_order: int,
    send_counts: int,
    stream: int = 0,
    scratch: int = 0,
) -> None: ...
def schedule_scratch_bytes(world_size: int, max_tokens: int, topk: int, num_local_experts: int) -> int: ...
def combine(
    device: str,
    out: int,
    base: int,
    rows: int,
    weights: int,
    num_tokens: int,
    topk: int,
    hidden: int,
    stream: int = 0,
    row_index: int = 0,
    num_rows: int = 0,
    error: int = 0,
    error_mirror: int = 0,
) -> None: ...
def entry_points() -> Any: ...
def plan_ring(
    pass_: int, num_rows: int, macrobatch: int, minibatch: int
) -> list[tuple[int, int, int, int, int, list[int]]]: ...
def pull_rows(
    device: str,
    dst: int,
    src_ptrs: int,
    row_src_rank: int,
    row_route: int,
    capacity: int,
    route_divisor: int,
    row_bytes: int,
    src_stride: int,
    dst_stride: int,
    num_workers: int,
    stream: int = 0,
) -> None: ...
def push_rows(
    device: str,
    src: int,
    dst_ptrs: int,
    row_src_rank: int,
    row_route: int,
    capacity: int,
    row_bytes: int,
    src_stride: int,
    dst_stride: int,
    num_workers: int,
    stream: int = 0,
    src_divisor: int = 1,
    dst_local: int = 0,
) -> None: ...
def zero_rows(
    device: str,
    dst: int,
    row_src_rank: int,
    capacity: int,
    row_bytes: int,
    dst_stride: int,
    num_workers: int,
    stream: int = 0,
) -> None: ...
def barrier(
    device: str,
    epoch: int,
    signal_pad_ptrs: int,
    rank: int,
    world_size: int,
    error: int,
    stage: int,
    timeout_ns: int,
    stream: int = 0,
) -> bool: ...

class ErrorMirror:
    def __init__(self, device: str) -> None: ...
    @property
    def device_address(self) -> int: ...
    def publish(self, error: int, stream: int = 0) -> None: ...
    def read(self) -> list[int]: ...
    def clear(self) -> None: ...

class ShmSegment:
    def __init__(self, name: str, nbytes: int, create: bool) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def created(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def unlink(self) -> None: ...
    def __enter__(self) -> ShmSegment: ...
    def __exit__(self, *args: object) -> bool: ...
